"""TensorBoard event files of scalars, written without tensorflow or tensorboard.

The file is what `torch.utils.tensorboard.SummaryWriter.add_scalar` writes: TFRecords (length,
masked CRC-32C of the length, an `Event` protocol buffer, masked CRC-32C of the event) after a
`file_version: "brain.Event:2"` event. Written here because SummaryWriter needs the tensorboard
package (grpcio, protobuf, werkzeug ... for a run that only writes numbers) and checksums every
record in pure Python (3 ms per 10 kB measured): a monitored step's few thousand scalars go in one
event whose checksum is computed over many chunks at once with numpy.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

_CASTAGNOLI = 0x82F63B78  # CRC-32C's polynomial, reflected


@lru_cache(maxsize=1)
def _byte_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_CASTAGNOLI), table >> 1).astype(np.uint32)
    return table


@lru_cache(maxsize=64)
def _zeros_tables(count: int) -> np.ndarray:
    """4 x 256 tables: the CRC state x after `count` zero bytes is the XOR of tables[i][byte i of x]
    (the update is linear over GF(2) without its initial and final inversions)."""
    if count == 1:
        table = _byte_table()
        images = np.array([1 << bit for bit in range(32)], dtype=np.uint32)
        images = table[images & 0xFF] ^ (images >> 8)
    else:
        half = _zeros_tables(count // 2)
        basis = np.array([1 << bit for bit in range(32)], dtype=np.uint32)
        images = _shift(_shift(basis, half), half) if count % 2 == 0 else _shift(_shift(basis, half), _zeros_tables(count - count // 2))
    values = np.arange(256, dtype=np.uint32)
    tables = np.zeros((4, 256), dtype=np.uint32)
    for byte in range(4):
        for bit in range(8):
            tables[byte] ^= np.where((values >> bit) & 1, images[8 * byte + bit], np.uint32(0)).astype(np.uint32)
    return tables


def _shift(states: np.ndarray, tables: np.ndarray) -> np.ndarray:
    return (tables[0][states & 0xFF] ^ tables[1][(states >> 8) & 0xFF] ^ tables[2][(states >> 16) & 0xFF]
            ^ tables[3][states >> 24])


_CHUNK = 16


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, as TFRecord checksums it."""
    table = _byte_table()
    if len(data) <= 256:
        state = 0xFFFFFFFF
        for byte in data:
            state = int(table[(state ^ byte) & 0xFF]) ^ (state >> 8)
        return state ^ 0xFFFFFFFF
    head = bytes(b ^ 0xFF for b in data[:4]) + data[4:]  # the initial 0xFFFFFFFF, as inverted first bytes
    # Leading zero bytes leave a zero state unchanged: pad to chunks x _CHUNK, chunks a power of two,
    # run every chunk at once, then fold neighbours (the left one shifted past the right one's bytes).
    chunks = 1 << (-(-len(head) // _CHUNK) - 1).bit_length()
    padded = np.zeros(chunks * _CHUNK, dtype=np.uint8)
    padded[len(padded) - len(head):] = np.frombuffer(head, dtype=np.uint8)
    columns = padded.reshape(chunks, _CHUNK).T.astype(np.uint32)
    states = np.zeros(chunks, dtype=np.uint32)
    for column in columns:
        states = table[(states ^ column) & 0xFF] ^ (states >> 8)
    width = _CHUNK
    while len(states) > 1:
        states = _shift(states[0::2], _zeros_tables(width)) ^ states[1::2]
        width *= 2
    return int(states[0]) ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


@lru_cache(maxsize=65536)
def _value_head(tag: str) -> bytes:
    """A Summary.Value's bytes up to its simple_value's 4 bytes (tag = 1, simple_value = 2): the same
    every step for a tag."""
    tag_field = _length_delimited(1, tag.encode())
    return b"\x0a" + _varint(len(tag_field) + 5) + tag_field + b"\x15"


def scalar_event(step: int, values: list[tuple[str, float]], wall_time: float | None = None) -> bytes:
    """An Event (wall_time = 1, step = 2, summary = 5) whose Summary holds one simple_value per tag."""
    with np.errstate(over="ignore"):  # a float64 statistic beyond float32's range is inf in TensorBoard
        packed = np.array([value for _, value in values], dtype=np.float64).astype("<f4").tobytes()
    summary = b"".join(_value_head(tag) + packed[4 * i:4 * i + 4] for i, (tag, _) in enumerate(values))
    return (b"\x09" + struct.pack("<d", time.time() if wall_time is None else wall_time)
            + b"\x10" + _varint(step & 0xFFFFFFFFFFFFFFFF) + _length_delimited(5, summary))


def _record(event: bytes) -> bytes:
    length = struct.pack("<Q", len(event))
    return length + struct.pack("<I", masked_crc32c(length)) + event + struct.pack("<I", masked_crc32c(event))


class ScalarEventFile:
    """One events.out.tfevents.* file in `directory`, appended to step by step and flushed."""

    def __init__(self, directory: Path, suffix: str = "") -> None:
        now = time.time()
        self.path = Path(directory) / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}{suffix}"
        self._file = open(self.path, "ab")  # noqa: SIM115 (kept open for the run, closed by close())
        self._file.write(_record(b"\x09" + struct.pack("<d", now) + _length_delimited(3, b"brain.Event:2")))
        self._file.flush()

    def write(self, step: int, values: list[tuple[str, float]]) -> None:
        if values:
            self._file.write(_record(scalar_event(step, values)))
            self._file.flush()

    def close(self) -> None:
        self._file.close()
