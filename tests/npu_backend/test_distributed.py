"""The hccl backend: gloo collectives on npu memory; DDP and FSDP2 under `npu-run --nproc-per-node 2`."""

import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from npukit.npu_backend.distributed import ProcessGroupHCCL, _AliasWork, cpu_alias

DDP_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F

    dist.init_process_group("hccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("npu", torch.npu.current_device())
    print(f"rank {rank} device {device} count {torch.npu.device_count()} backend {dist.get_backend()}")

    def batch(step, r):
        g = torch.Generator().manual_seed(100 * step + r)
        return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

    torch.manual_seed(rank)  # different initial weights: DDP must start every rank from rank 0's
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model.to(device), device_ids=[device.index])
    reference.load_state_dict({k: v.cpu() for k, v in ddp.module.state_dict().items()})
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        x, y = batch(step, rank)  # each rank its own data: only the gradient all-reduce keeps them equal
        optimizer.zero_grad()
        F.mse_loss(ddp(x.to(device)), y.to(device)).backward()
        optimizer.step()
        # The same step on one CPU model over both ranks' data (mean loss = mean of rank gradients).
        xs, ys = zip(*(batch(step, r) for r in range(world)))
        reference_optimizer.zero_grad()
        F.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
        reference_optimizer.step()

    # FSDP2 (fully_shard: DTensor parameters over a DeviceMesh of npu devices), same data and reference.
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    sharded = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    fsdp_reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    fsdp_reference.load_state_dict({k: v.cpu() for k, v in sharded.state_dict().items()})
    fully_shard(sharded)
    fsdp_optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
    fsdp_reference_optimizer = torch.optim.SGD(fsdp_reference.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step, rank)
        fsdp_optimizer.zero_grad()
        F.mse_loss(sharded(x.to(device)), y.to(device)).backward()
        fsdp_optimizer.step()
        xs, ys = zip(*(batch(step, r) for r in range(world)))
        fsdp_reference_optimizer.zero_grad()
        F.mse_loss(fsdp_reference(torch.cat(xs)), torch.cat(ys)).backward()
        fsdp_reference_optimizer.step()
    full = torch.cat([p.full_tensor().reshape(-1).cpu() for p in sharded.parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in fsdp_reference.parameters()])
    print(f"rank {rank} fsdp2-matches-reference {torch.allclose(full, expected, atol=1e-5)}")

    # FSDP1 from a CPU model with device_id: parameters move by `.data =`, shards are freed
    # with storage._resize_(0), and gradients are reduce-scattered with record_stream.
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    fsdp1_reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    fsdp1_reference.load_state_dict(cpu_model.state_dict())
    fsdp1 = FSDP(cpu_model, device_id=device.index)
    fsdp1_optimizer = torch.optim.SGD(fsdp1.parameters(), lr=0.1)
    fsdp1_reference_optimizer = torch.optim.SGD(fsdp1_reference.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step, rank)
        fsdp1_optimizer.zero_grad()
        F.mse_loss(fsdp1(x.to(device)), y.to(device)).backward()
        fsdp1_optimizer.step()
        xs, ys = zip(*(batch(step, r) for r in range(world)))
        fsdp1_reference_optimizer.zero_grad()
        F.mse_loss(fsdp1_reference(torch.cat(xs)), torch.cat(ys)).backward()
        fsdp1_reference_optimizer.step()
    with FSDP.summon_full_params(fsdp1):
        full1 = torch.cat([p.detach().reshape(-1).cpu() for p in fsdp1.module.parameters()])
    expected1 = torch.cat([p.detach().reshape(-1) for p in fsdp1_reference.parameters()])
    print(f"rank {rank} fsdp1-matches-reference {torch.allclose(full1, expected1, atol=1e-5)}")

    flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    print(f"rank {rank} identical {all(torch.equal(g, gathered[0]) for g in gathered)} "
          f"matches-reference {torch.allclose(flat.cpu(), expected, atol=1e-5)}")

    into = torch.empty(2 * world, device=device)
    dist.all_gather_into_tensor(into, torch.tensor([rank, 10.0 + rank], device=device))
    scattered = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(scattered, torch.arange(2.0 * world, device=device) * (rank + 1))
    listed = torch.empty(2, device=device)
    dist.reduce_scatter(listed, [torch.full((2,), float(r + rank), device=device) for r in range(world)])
    broadcast = torch.full((3,), float(rank + 5), device=device)
    dist.broadcast(broadcast, src=1)
    total = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(total)
    if rank == 0:
        dist.send(torch.tensor([42.0, 43.0], device=device), dst=1)
        received = [0.0, 0.0]
    else:
        buffer = torch.zeros(2, device=device)
        dist.recv(buffer, src=0)
        received = buffer.tolist()
    import torch.distributed._functional_collectives as funcol
    functional = funcol.all_reduce(torch.tensor([rank + 1.0], device=device), "sum", dist.group.WORLD)
    print(f"rank {rank} functional all_reduce {functional.tolist()} on {functional.device}")
    dist.barrier()

    # Saturation mode: only rank 0 overflows (finite, clamped gradients); the flag is all-reduced,
    # so both ranks skip the step together and keep identical parameters.
    from npukit.npu_backend import numerics
    numerics.configure(fp16_mode="saturation")
    scaler = torch.amp.GradScaler("npu", init_scale=2.0**16)
    before = [p.detach().clone() for p in ddp.module.parameters()]
    optimizer.zero_grad()
    with torch.autocast("npu", dtype=torch.float16):
        loss = ddp(torch.full((4, 8), 1e6 if rank == 0 else 0.01, device=device)).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    skipped = all(torch.equal(a, p) for a, p in zip(before, ddp.module.parameters()))
    print(f"rank {rank} saturation-skipped {skipped} scale {scaler.get_scale()}")
    print(f"rank {rank} into {into.tolist()} scattered {scattered.tolist()} listed {listed.tolist()} "
          f"broadcast {broadcast.tolist()} total {total.tolist()} received {received} "
          f"on {into.device} {scattered.device} {total.device}")
    dist.destroy_process_group()
""")


def test_npu_run_two_rank_ddp_and_fsdp_train_like_one_process_and_collectives_work(tmp_path):
    script = tmp_path / "train_ddp.py"
    script.write_text(DDP_SCRIPT)
    # PET_STANDALONE: torchrun's --standalone, whose rendezvous takes a free port itself (no race).
    env = dict(os.environ, PET_STANDALONE="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop("ASCEND_RT_VISIBLE_DEVICES", None)
    result = subprocess.run([sys.executable, "-m", "npukit.run", "--nproc-per-node", "2", str(script)],
                            capture_output=True, text=True, env=env, timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for rank in (0, 1):
        assert f"rank {rank} device npu:{rank} count 8 backend hccl" in out
        assert f"rank {rank} identical True matches-reference True" in out
        assert f"rank {rank} saturation-skipped True scale 32768.0" in out
        assert f"rank {rank} fsdp2-matches-reference True" in out
        assert f"rank {rank} fsdp1-matches-reference True" in out
        assert f"rank {rank} functional all_reduce [3.0] on npu:{rank}" in out
    # world 2: rank r contributes [r, 10 + r]; reduce-scatter sums rank-scaled inputs [0, 1, 2, 3].
    assert ("rank 0 into [0.0, 10.0, 1.0, 11.0] scattered [0.0, 3.0] listed [1.0, 1.0] "
            "broadcast [6.0, 6.0, 6.0] total [3.0] received [0.0, 0.0] on npu:0 npu:0 npu:0") in out
    assert ("rank 1 into [0.0, 10.0, 1.0, 11.0] scattered [6.0, 9.0] listed [3.0, 3.0] "
            "broadcast [6.0, 6.0, 6.0] total [3.0] received [42.0, 43.0] on npu:1 npu:1 npu:1") in out


META_INIT_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    device = torch.device("npu", int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend=dist.get_default_backend_for_device(device), device_id=device)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=device)
    for layer in model:
        layer.reset_parameters()  # DTensor random ops: each rank draws its own shard
    weight = model[0].weight.full_tensor()
    model(torch.ones(2, 16, device=device)).sum().backward()
    print(f"rank {dist.get_rank()} weight {weight.sum().item():.6f} {weight.abs().max().item() <= 0.25} "
          f"shards differ {not torch.equal(weight[:16], weight[16:])} grad {model[0].weight.grad is not None}")
    dist.destroy_process_group()
""")


def test_fsdp2_meta_device_init_draws_each_shard_of_one_weight(tmp_path):
    """FSDP2's documented initialisation (pytorch/examples' FSDP2 example): a model built on the
    meta device, sharded, materialised on the rank's npu and reset, then trained."""
    script = tmp_path / "meta_init.py"
    script.write_text(META_INIT_SCRIPT)
    env = dict(os.environ, PET_STANDALONE="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "npukit.run", "--nproc-per-node", "2", str(script)],
                            capture_output=True, text=True, env=env, timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    # the two ranks' prints may land on one line of the launcher's output: read them by pattern
    lines = sorted(re.findall(r"rank \d weight -?[\d.]+ (?:True|False) shards differ (?:True|False) grad (?:True|False)", result.stdout))
    assert len(lines) == 2 and lines[0][len("rank 0"):] == lines[1][len("rank 1"):], lines  # one weight
    assert lines[0].endswith("True shards differ True grad True"), lines  # kaiming-uniform bound 1/sqrt(16)


@pytest.fixture
def single_rank_group():
    def init(backend: str):
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return dist.group.WORLD

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_hccl_is_registered_for_npu_and_available():
    assert dist.is_hccl_available() is True
    assert dist.Backend.HCCL == "hccl"
    assert dist.Backend.default_device_backend_map["npu"] == "hccl"


def test_hccl_group_runs_collectives_in_place_on_npu_tensors(single_rank_group):
    group = single_rank_group("hccl")
    assert isinstance(group, ProcessGroupHCCL) and dist.get_backend() == "hccl" and group.name() == "hccl"
    tensor = torch.arange(6.0, device="npu").view(2, 3)[:, 1:]  # a strided view: aliases keep strides
    pointer = tensor.data_ptr()
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
    work.wait()
    assert work.get_future().wait()[0] is tensor  # the future yields the npu tensor, not a CPU copy
    assert tensor.data_ptr() == pointer and tensor.tolist() == [[1.0, 2.0], [4.0, 5.0]]
    out = torch.zeros(2, device="npu")
    dist.all_gather_into_tensor(out, torch.tensor([7.0, 8.0], device="npu"))
    assert out.device.type == "npu" and out.tolist() == [7.0, 8.0]


def test_a_group_bound_to_its_npu_with_device_id_runs_collectives():
    """`init_process_group(backend=get_default_backend_for_device(d), device_id=d)`, as
    pytorch/examples' FSDP2 example writes it, asks the group for its npu backend; it failed with
    "No backend type associated with device type npu"."""
    device = torch.device("npu", 0)
    backend = dist.get_default_backend_for_device(device)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        tensor = torch.arange(3.0, device=device)
        dist.all_reduce(tensor)
        assert backend == "hccl" and tensor.device == device and tensor.tolist() == [0.0, 1.0, 2.0]
    finally:
        dist.destroy_process_group()


def test_destroying_the_group_first_finishes_the_collectives_whose_futures_run_python(single_rank_group):
    """A gloo thread completing a future with a Python callback needs the GIL: a group destroyed
    with such a collective in flight (DDP alive after destroy_process_group) hung both ranks of a
    2-rank `npu-run --profile` at exit, 2 runs in 6. destroy_process_group now waits for them, and
    finished ones are not kept (they hold the caller's tensors)."""
    from npukit.npu_backend import distributed as hccl

    single_rank_group("hccl")
    for _ in range(50):
        work = dist.all_reduce(torch.ones(4, device="npu"), async_op=True)
        work.get_future()
        work.wait()
    assert len(hccl._WITH_PYTHON_CALLBACKS) <= 1  # the finished ones were dropped as new ones came
    pending = dist.all_reduce(torch.ones(4, device="npu"), async_op=True)
    pending.get_future()
    assert hccl._WITH_PYTHON_CALLBACKS
    dist.destroy_process_group()
    assert not hccl._WITH_PYTHON_CALLBACKS and pending.is_completed()


def test_a_failed_collective_fails_the_future_ddp_waits_on():
    class FailedWork:
        def get_future(self):
            future = torch.futures.Future()
            future.set_exception(RuntimeError("connection closed by peer"))
            return future

    future = _AliasWork([FailedWork()], [torch.ones(1, device="npu")]).get_future()
    with pytest.raises(RuntimeError, match="connection closed by peer"):
        future.wait()


def test_mixed_npu_hccl_cpu_gloo_group_serves_both_devices(single_rank_group):
    single_rank_group("npu:hccl,cpu:gloo")
    on_npu, on_cpu = torch.ones(3, device="npu"), torch.ones(3)
    dist.all_reduce(on_npu)
    dist.all_reduce(on_cpu)
    dist.broadcast(on_npu, src=0)
    dist.barrier()
    assert on_npu.device.type == "npu" and on_npu.tolist() == [1.0, 1.0, 1.0] and on_cpu.tolist() == [1.0] * 3


def test_cpu_alias_is_zero_copy_and_keeps_npu_memory_alive():
    npu = torch.arange(12, dtype=torch.bfloat16, device="npu").view(3, 4).t()
    alias = cpu_alias(npu)
    assert alias.device.type == "cpu" and alias.data_ptr() == npu.data_ptr()
    assert alias.stride() == npu.stride() and alias.dtype == torch.bfloat16
    alias.mul_(2)
    assert torch.equal(npu.cpu(), torch.arange(12, dtype=torch.bfloat16).view(3, 4).t() * 2)
    expected = alias.clone()
    del npu  # the alias holds the npu tensor, so its memory is not freed and reused under it
    torch.ones(64, device="npu")
    assert torch.equal(alias, expected)
    assert cpu_alias(torch.empty(0, 4, device="npu")).shape == (0, 4)


def test_local_rank_and_visible_devices_select_the_device(tmp_path):
    script = tmp_path / "which.py"
    script.write_text("import torch\nprint(torch.npu.current_device(), torch.npu.device_count())\n")
    env = dict(os.environ, ASCEND_RT_VISIBLE_DEVICES="4,6", LOCAL_RANK="1")
    result = subprocess.run([sys.executable, "-m", "npukit.run", str(script)], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "2"]  # two visible devices, renumbered 0 and 1; rank 1 on npu:1


# ---------------------------------------------------------------- the input pipeline of a training job
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("pin_memory_device", ["", "npu"])
def test_dataloader_pins_batches_for_non_blocking_copies_to_npu(workers, pin_memory_device):
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    assert torch.accelerator.current_accelerator().type == "npu"  # what pin_memory pins for
    features, labels = torch.randn(10, 3), torch.arange(10)
    loader = DataLoader(TensorDataset(features, labels), batch_size=4, pin_memory=True, num_workers=workers,
                        pin_memory_device=pin_memory_device)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # PyTorch 2.13 itself deprecates the argument (it pins for the current accelerator, npu).
        warnings.filterwarnings("ignore", "pin_memory_device is deprecated", UserWarning)
        for batch_features, batch_labels in loader:
            assert batch_features.is_pinned() and batch_labels.is_pinned()
            on_device = batch_features.to("npu", non_blocking=True)
            torch.npu.synchronize()
            assert on_device.device.type == "npu" and torch.equal(on_device.cpu(), batch_features)
            seen.append(batch_labels)
    assert torch.equal(torch.cat(seen), labels)


def test_tensor_pin_memory_pins_a_copy_on_the_host():
    tensor = torch.arange(6.0).view(2, 3)
    pinned = tensor.pin_memory()
    assert pinned.is_pinned() and not tensor.is_pinned()
    assert pinned.device.type == "cpu" and torch.equal(pinned, tensor)
    assert torch.equal(pinned.to("npu", non_blocking=True).cpu(), tensor)


def _two_ranks_in_this_process() -> dict[int, ProcessGroupHCCL]:
    """Ranks 0 and 1 of one hccl group, both in this process (each made on its own thread: gloo's
    connection waits for the peer)."""
    from datetime import timedelta

    store = dist.HashStore()
    groups: dict[int, ProcessGroupHCCL] = {}

    def make(rank):
        groups[rank] = ProcessGroupHCCL(store, rank, 2, timedelta(seconds=60))

    makers = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    for maker in makers:
        maker.start()
    for maker in makers:
        maker.join()
    return groups


def test_a_gloo_thread_never_frees_what_a_collective_was_given():
    """A gloo thread retiring a collective whose caller has dropped its tensors frees them, which needs
    the GIL; during the interpreter's exit that thread is ended in place and the process aborted ("terminate
    called without an active exception", a 2-rank accelerate script ending without
    destroy_process_group, 1 run in 8). The group now holds what it hands to gloo until gloo lets it go,
    and the thread that calls a later collective frees it. Two ranks of one group in this process: rank
    0's all_reduce waits in its gloo thread for rank 1 while rank 0 drops every reference to it."""
    import weakref

    groups = _two_ranks_in_this_process()
    freed_on: list[str] = []

    def record():
        freed_on.append("caller" if threading.current_thread() is threading.main_thread() else "gloo")

    for _ in range(3):
        mine = torch.ones(1000, device="npu")
        weakref.finalize(mine, record).atexit = False
        opts = dist.AllreduceOptions()
        groups[0].allreduce([mine], opts)  # rank 0's gloo thread now waits for rank 1
        del mine  # and the work: only gloo holds rank 0's tensor
        theirs = torch.ones(1000, device="npu")
        groups[1].allreduce([theirs], dist.AllreduceOptions()).wait()
        assert theirs.tolist() == [2.0] * 1000
        time.sleep(0.2)  # rank 0's gloo thread retires its work (it completed with rank 1's)
    # each collective let go of the earlier ones' tensors, on the calling thread
    assert freed_on and set(freed_on) == {"caller"}, freed_on


def test_a_gloo_thread_letting_go_of_a_collective_touches_no_python_object():
    """Not freeing is not enough: a tensor's Python object is incref'd when a C++ reference takes its
    count from 1 to 2 and decref'd, under the GIL, when one takes it back to 1 (torch's PyObject
    preservation). Where gloo's was that second reference, its gloo thread takes the GIL to drop it, and
    during the interpreter's exit that aborts the process ("terminate called without an active
    exception" after a 2-rank accelerate script ended correctly, 1 run in 40 under load). Rank 0's
    all_reduce waits in its gloo thread for rank 1 while rank 0 drops the work and its tensor; once the
    gloo thread has let the collective go, the Python objects of what rank 0 handed gloo have the
    refcounts they had while gloo held them."""
    from npukit.npu_backend import distributed as hccl

    groups = _two_ranks_in_this_process()
    mine = torch.ones(1000, device="npu")
    groups[0].allreduce([mine], dist.AllreduceOptions())  # rank 0's gloo thread now waits for rank 1
    del mine
    _, handed, counts, _ = hccl._HANDED._entries[-1]
    assert handed and all(t._use_count() > count for t, count in zip(handed, counts))  # gloo holds them
    refcounts = [sys.getrefcount(t) for t in handed]
    # rank 1 through its gloo backend itself: no collective of the group lets rank 0's entry go meanwhile
    theirs = torch.ones(1000)
    groups[1]._get_backend(torch.device("cpu")).allreduce([theirs]).wait()
    assert theirs.tolist() == [2.0] * 1000
    deadline = time.monotonic() + 30
    while any(t._use_count() > count for t, count in zip(handed, counts)) and time.monotonic() < deadline:
        time.sleep(0.01)  # rank 0's gloo thread retires the completed work
    assert all(t._use_count() <= count for t, count in zip(handed, counts)), "gloo never let go"
    assert [sys.getrefcount(t) for t in handed] == refcounts, "a gloo thread decref'd a Python object"


def test_at_exit_collectives_whose_futures_run_python_finish_first_within_a_bound():
    """At interpreter exit a collective still to complete a future with a Python callback (DDP's) is
    finished while its gloo thread can take the GIL; one whose peer never comes holds the exit only
    for the bound."""
    from npukit.npu_backend import distributed as hccl

    groups = _two_ranks_in_this_process()
    pending = groups[0].allreduce([torch.ones(4, device="npu")], dist.AllreduceOptions())
    pending.get_future()
    started = time.monotonic()
    hccl._finish_callbacks_at_exit(seconds=0.5)  # rank 1 never joins
    assert 0.4 < time.monotonic() - started < 5 and not pending.is_completed()
    peer = threading.Timer(0.3, lambda: groups[1].allreduce([torch.ones(4, device="npu")],
                                                            dist.AllreduceOptions()).wait())
    peer.start()
    hccl._finish_callbacks_at_exit(seconds=30)
    peer.join()
    assert pending.is_completed() and pending.result()[0].tolist() == [2.0] * 4
