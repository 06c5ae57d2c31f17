"""TensorBoard event files of scalars, written without tensorflow or tensorboard.

The file is what `torch.utils.tensorboard.SummaryWriter.add_scalar` writes: TFRecords (length,
masked CRC-32C of the length, an `Event` protocol buffer, masked CRC-32C of the event) after a
`file_version: "brain.Event:2"` event. Written here because SummaryWriter needs the tensorboard
package (grpcio, protobuf, werkzeug ... for a run that only writes numbers) and checksums every
record in pure Python (3 ms per 10 kB measured): a monitored step's few thousand scalars go in one
event, checksummed in C (npukit.watch._stats.crc32c).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from npukit.watch._stats import crc32c, fill_float32


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
    return _event(step, _summary(values), wall_time)


def _summary(values: list[tuple[str, float]]) -> bytes:
    packed = _float32_bytes([value for _, value in values])
    return b"".join(_value_head(tag) + packed[4 * i:4 * i + 4] for i, (tag, _) in enumerate(values))


def _float32_bytes(values) -> bytes:
    with np.errstate(over="ignore"):  # a float64 statistic beyond float32's range is inf in TensorBoard
        return np.array(values, dtype=np.float64).astype("<f4").tobytes()


def _event(step: int, summary: bytes, wall_time: float | None = None) -> bytes:
    return (b"\x09" + struct.pack("<d", time.time() if wall_time is None else wall_time)
            + b"\x10" + _varint(step & 0xFFFFFFFFFFFFFFFF) + _length_delimited(5, summary))


class SummaryLayout:
    """The Summary bytes of a fixed list of tags with the values' 4 bytes left open, filled in by one
    numpy assignment: a monitored step writes the same tags every step (thousands of them), and
    joining a value's head and bytes per tag took most of the writer's time."""

    def __init__(self, tags: list[str]) -> None:
        template, holes = bytearray(), []
        for tag in tags:
            template += _value_head(tag)
            holes.append(len(template))
            template += bytes(4)
        self.count = len(tags)
        self._template = bytes(template)
        self._holes = np.array(holes, dtype=np.int64).tobytes()

    def summary(self, values: list[float]) -> bytes:
        """values: a float per tag, in the layout's order (rounded to float32 as _float32_bytes does)."""
        return fill_float32(self._template, self._holes, values)


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

    def write(self, step: int, values: list[tuple[str, float]], layout: SummaryLayout | None = None,
              laid_out: list[float] | None = None) -> None:
        """values: (tag, value) pairs; before them, when given, a float per tag of `layout` (laid_out)."""
        summary = layout.summary(laid_out) if layout is not None and layout.count else b""
        if values:
            summary += _summary(values)
        if summary:
            self._file.write(_record(_event(step, summary)))
            self._file.flush()

    def close(self) -> None:
        self._file.close()
