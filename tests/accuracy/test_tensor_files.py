"""Tensor data files: the dump's writer thread (snapshots, bounded memory, errors, the end of the
session) and reading .pt files without torch (numpy only, pickle-free)."""

import errno
import json
import os
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn as nn

from npukit.accuracy.dump import DumpSession
from npukit.accuracy.metrics import PairJob, compare_pairs
from npukit.accuracy.tensor_io import TensorFileWriter, read_tensor, tensor_to_numpy
from npukit.errors import UserError


def _dump(root, step=0):
    rank_dir = root / f"step{step}" / "rank0"
    return rank_dir, json.loads((rank_dir / "dump.json").read_text())["data"]


def _stored(rank_dir, leaf):
    return read_tensor(rank_dir / "dump_tensor_data" / leaf["data_name"], leaf["dtype"], leaf["shape"])


class Doubler(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return self.fc(x) * 2


def test_a_tensor_changed_in_place_after_it_was_recorded_is_dumped_with_the_value_it_had(tmp_path):
    torch.manual_seed(0)
    model = Doubler(256)  # 256x256 outputs: 256 KB, taken from the reused buffers
    recorded = []
    with torch.no_grad(), DumpSession(tmp_path, level="mix", mode="tensor") as session:
        for step in range(3):
            out = model(torch.full((256, 256), float(step + 1)))
            recorded.append(out.clone())
            out.zero_()  # in place, right after the dump recorded it: the file keeps the value it had
            session.step()
    for step in range(3):
        rank_dir, data = _dump(tmp_path, step)
        stored = _stored(rank_dir, data["Tensor.__mul__.0.forward"]["output"][0])  # the model's output
        assert np.array_equal(stored, recorded[step].numpy()), step  # not zeros, not another step's


def test_a_tensor_file_that_cannot_be_written_is_reported_once_and_the_run_goes_on(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("a" * 250, nn.Linear(8, 8))  # its files' names are too long for the file system
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with DumpSession(tmp_path, level="mix", mode="tensor"):
        for _ in range(3):
            loss = model(torch.ones(2, 8)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    assert len(losses) == 3 and losses[2] < losses[0]  # the training ran to its end
    err = capsys.readouterr().err
    assert err.count("cannot write tensor data") == 1, err
    assert "File name too long" in err and "the run goes on" in err and "internal error" not in err
    for step in range(3):  # every step's dump.json, and the files that could be written
        rank_dir, data = _dump(tmp_path, step)
        linear = data["Functional.linear.0.forward"]["output"][0]
        assert _stored(rank_dir, linear).shape == (2, 8)


def test_the_end_of_the_session_waits_for_every_file(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(6)))
    x = torch.randn(64, 512)
    with torch.no_grad(), DumpSession(tmp_path, level="mix", mode="tensor") as session:
        model(x)
        session.step()
        output = model(x)  # step 1: its files are still queued for the writer when the session ends
    for step in (0, 1):
        rank_dir, data = _dump(tmp_path, step)
        for entry in data.values():
            for leaf in entry.get("output", []) + entry.get("input_args", []):
                assert (rank_dir / "dump_tensor_data" / leaf["data_name"]).is_file(), (step, leaf["data_name"])
    rank_dir, data = _dump(tmp_path, 1)
    assert np.array_equal(_stored(rank_dir, data["Module.5.Linear.forward.0"]["output"][0]), output.numpy())


def test_a_tensor_passed_on_unchanged_shares_its_file_bytes_with_every_leaf_naming_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    with torch.no_grad(), DumpSession(tmp_path, level="mix", mode="tensor") as session:
        model(torch.randn(4, 64))
        session.step()
    rank_dir, data = _dump(tmp_path)
    produced = rank_dir / "dump_tensor_data" / data["Functional.linear.0.forward"]["output"][0]["data_name"]
    consumed = rank_dir / "dump_tensor_data" / data["Functional.relu.0.forward"]["input_args"][0]["data_name"]
    assert produced != consumed  # a file per leaf, as msprobe pairs rows by file
    assert os.path.samefile(produced, consumed)  # written once: one copy, one write
    assert torch.equal(torch.load(consumed, weights_only=True), torch.load(produced, weights_only=True))


def test_copies_waiting_for_the_writer_stay_within_their_bound():
    writer = TensorFileWriter(max_bytes=3 << 20)
    first = writer.copy(torch.ones(512, 1024))  # 2 MB
    second_taken = threading.Event()

    def take_second():
        writer.copy(torch.ones(512, 1024))
        second_taken.set()

    thread = threading.Thread(target=take_second)
    thread.start()
    assert not second_taken.wait(0.3)  # 4 MB would wait: the second copy waits for the first's write
    writer._release(first[1], first[2])
    assert second_taken.wait(10)
    thread.join()


def test_writes_reuse_buffers_and_keep_each_files_values(tmp_path):
    writer = TensorFileWriter()
    with ThreadPoolExecutor(max_workers=1) as thread:
        tensors = [torch.full((300, 300), float(i)) for i in range(6)]
        for i, tensor in enumerate(tensors):
            thread.submit(writer.write, tmp_path / f"{i}.pt", writer.copy(tensor))
    for i, tensor in enumerate(tensors):
        assert torch.equal(torch.load(tmp_path / f"{i}.pt", weights_only=True), tensor)
    assert not writer.failed


VIEWS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.t(),
    "sliced": lambda t: t[1:4, ::2],
    "scalar": lambda t: t[2, 3],
    "empty": lambda t: t[:0],
}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int64, torch.int32, torch.int8, torch.uint8, torch.uint16, torch.bool, torch.complex64]


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pt_files_read_exactly_for_every_dtype_and_view(tmp_path, dtype, view):
    base = (torch.randn(6, 5) * 10).to(dtype) if dtype.is_floating_point or dtype.is_complex \
        else torch.arange(30).to(dtype).view(6, 5)
    tensor = VIEWS[view](base)
    torch.save(tensor, tmp_path / "t.pt")  # a view's file holds its whole storage (msprobe's may too)
    stored = read_tensor(tmp_path / "t.pt", str(dtype), list(tensor.shape))
    expected = tensor_to_numpy(tensor)
    assert stored.dtype == expected.dtype and stored.shape == expected.shape
    assert stored.tobytes() == expected.tobytes()


def test_a_pt_file_whose_tensor_lies_outside_its_storage_is_refused(tmp_path):
    path = tmp_path / "t.pt"
    torch.save(torch.zeros(4), path)
    data = bytearray(path.read_bytes())
    shape_at = data.index(b"K\x04\x85")  # the shape (4,) in data.pkl: make it (9,)
    data[shape_at + 1] = 9
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"t\.pt"):
        read_tensor(path, "torch.float32", [9])


def test_pt_files_only_torch_reads_are_compared_in_the_main_process(tmp_path):
    # A saved Parameter (torch._utils._rebuild_parameter): the numpy reader leaves it to torch,
    # which a forked worker never imports: the parent reads it. Enough elements for the process pool.
    golden, target = torch.randn(3, 3_000_000), torch.randn(3, 3_000_000)
    jobs = []
    for i in range(3):
        for side, tensor in (("g", golden[i]), ("t", target[i])):
            torch.save(nn.Parameter(tensor.clone()), tmp_path / f"{side}{i}.pt")
        jobs.append(PairJob(str(tmp_path / f"g{i}.pt"), "torch.float32", str(tmp_path / f"t{i}.pt"), "torch.float32",
                            3_000_000))
    metrics = compare_pairs(jobs, workers=2)
    for i, result in enumerate(metrics):
        expected = torch.nn.functional.cosine_similarity(golden[i].double(), target[i].double(), dim=0)
        assert result.cosine == pytest.approx(float(expected), abs=1e-12)


def test_a_dump_whose_writer_falls_behind_waits_for_it_loses_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    from npukit.accuracy import tensor_io

    slow_write = tensor_io._write_file

    def slow_disk(*args, **kwargs):
        time.sleep(0.02)
        slow_write(*args, **kwargs)

    monkeypatch.setattr(tensor_io, "_write_file", slow_disk)
    monkeypatch.setattr(tensor_io, "_default_pending_bytes", lambda: 1 << 20)  # room for 4 of the 256 KB outputs
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))
    outputs = []
    with torch.no_grad(), DumpSession(tmp_path, level="mix", mode="tensor") as session:
        for _ in range(3):
            outputs.append(model(torch.randn(256, 256)))
            session.step()
    err = capsys.readouterr().err
    assert err.count("wait for the writer") == 1, err
    assert "nothing is dropped" in err and "cannot write" not in err
    for step, output in enumerate(outputs):  # every file is there, with its values
        rank_dir, data = _dump(tmp_path, step)
        assert np.array_equal(_stored(rank_dir, data["Module.7.Linear.forward.0"]["output"][0]), output.numpy())
        assert {path.name for path in (rank_dir / "dump_tensor_data").iterdir()} == set(_data_names(data))


def _data_names(value):
    if isinstance(value, dict):
        if "data_name" in value:
            yield value["data_name"]
        for item in value.values():
            yield from _data_names(item)
    elif isinstance(value, list):
        for item in value:
            yield from _data_names(item)


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct I/O", "no direct I/O"])
def test_dumped_pt_files_are_whole_zips_torch_and_unzip_read(tmp_path, monkeypatch, direct_io):
    """The dump writes .pt files itself (one write of a buffer laid out as the file, bypassing the
    page cache where the file system allows): torch.load (plain and memory-mapped) and zip's
    checksums agree with torch.save's files, also where the file system refuses direct I/O."""
    from npukit.accuracy import tensor_io

    if not direct_io:
        real_open = os.open

        def no_direct_io(path, flags, *args):
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(errno.EINVAL, "Invalid argument")  # tmpfs, some network file systems
            return real_open(path, flags, *args)

        monkeypatch.setattr(tensor_io.os, "open", no_direct_io)
        monkeypatch.setattr(tensor_io, "_direct_io", [True])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 3))  # 256 KB and 96 B outputs
    x = torch.randn(128, 64).to(torch.bfloat16)
    with torch.no_grad(), DumpSession(tmp_path, level="mix", mode="tensor") as session:
        model.to(torch.bfloat16)(x)
        session.step()
    rank_dir, data = _dump(tmp_path)
    leaves = [leaf for entry in data.values() for leaf in entry.get("output", [])]
    assert {leaf["shape"][-1] for leaf in leaves} == {512, 3}
    for leaf in leaves:
        path = rank_dir / "dump_tensor_data" / leaf["data_name"]
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None, path  # every record's checksum right
        for mmap in (False, True):
            loaded = torch.load(path, weights_only=True, mmap=mmap)
            assert loaded.dtype == torch.bfloat16 and list(loaded.shape) == leaf["shape"]
            assert loaded.view(torch.uint16).numpy().tobytes() == _stored(rank_dir, leaf).tobytes()
    assert not list((rank_dir / "dump_tensor_data").glob(".*.tmp"))


def test_the_dumps_checksum_is_zlibs_crc32_for_every_length_and_start():
    """The .pt files' zip checksums come from the folded CRC-32 (64 bytes a step, the rest and
    short buffers byte by byte): the same value as zlib.crc32 at every length, offset and start."""
    import zlib

    from npukit.watch._stats import crc32

    data = np.random.default_rng(0).integers(0, 256, 70_000, dtype=np.uint8).tobytes()
    for length in [*range(0, 200), 4095, 4096, 4097, 65_536 + 13]:
        for offset in (0, 1, 7):
            piece = memoryview(data)[offset:offset + length]
            assert crc32(piece) == zlib.crc32(piece), (length, offset)
            assert crc32(piece, 0xDEADBEEF) == zlib.crc32(piece, 0xDEADBEEF), (length, offset)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_the_dump_writer_runs_below_the_training_threads_priority(tmp_path):
    """The writer takes the cores training leaves idle: its thread runs WRITER_NICE nice levels
    below the training thread, whose own priority the dump leaves as it was."""
    from npukit.accuracy.tensor_io import WRITER_NICE

    training = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, training)
    model = Doubler(8)
    with torch.no_grad(), DumpSession(tmp_path, level="mix", mode="tensor") as session:
        model(torch.randn(4, 8))
        session.step()
        writers = [thread for thread in threading.enumerate() if thread.name.startswith("npukit-dump")]
        assert writers
        for writer in writers:
            assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == min(19, before + WRITER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, training) == before
