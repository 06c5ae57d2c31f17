"""The hccl backend keeps HCCL's rules, not gloo's (#30).

What torch_npu's ProcessGroupHCCL accepts works: all_gather_into_tensor into a flat, stacked or
concatenated output of world_size times the input's elements (accelerate's gather, gather_for_metrics,
pad_across_processes and Trainer.predict give a flat one; gloo refused it with "invalid tensor
size"), reduce_scatter_tensor likewise, all_gather into outputs of other shapes and uneven sizes, AVG
and PREMUL_SUM, every dtype HCCL has (int16, uint16/32/64 and float8 although gloo has none of
them). What it refuses is refused with its message: BAND/BOR/BXOR, the dtypes HCCL cannot reduce,
AVG of integers, PREMUL_SUM of integers, mismatched sizes and dtypes, non-contiguous tensors,
recv from any source, allgather_coalesced. Two ranks under `npu-run --nproc-per-node 2`.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

# Runs every check on both ranks; each writes results_<rank>.json beside the script: check name -> True,
# or what went wrong (a file, not a printed line: the two ranks' long lines interleave in the
# launcher's output). Each rank's values depend on its rank, so a result shows where its parts came from.
SEMANTICS_SCRIPT = textwrap.dedent(r'''
    import json, pathlib, sys, warnings
    import torch, torch.distributed as dist

    dist.init_process_group("hccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("npu", rank)
    results = {}

    def check(name, run):
        try:
            outcome = run()
            results[name] = True if outcome is True else f"wrong result: {outcome}"
        except Exception as error:  # noqa: BLE001 (recorded: the test names the check that failed)
            results[name] = f"{type(error).__name__}: {error}"

    def refused(name, run, message, error_type=RuntimeError, hccl_code=None):
        try:
            run()
        except error_type as error:
            text = str(error)
            ok = message in text and (hccl_code is None or f"ERR02{hccl_code} DIST" in text)
            results[name] = True if ok else f"other message: {text}"
        except Exception as error:  # noqa: BLE001
            results[name] = f"other error {type(error).__name__}: {error}"
        else:
            results[name] = "not refused"

    def same_bits(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))

    def values(r, shape, dtype, low=1, high=4):
        """Rank r's tensor: small integers (exact in every dtype, products and sums included)."""
        count = torch.Size(shape).numel()
        ints = (torch.arange(count) * 7 + 3 * r) % (high - low + 1) + low
        if dtype == torch.bool:
            return (ints % 2 == 0).view(shape)
        return ints.view(shape).to(dtype)

    ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
                  torch.int16, torch.int32, torch.int64, torch.bool, torch.uint16, torch.uint32, torch.uint64,
                  torch.float8_e4m3fn, torch.float8_e5m2]
    REDUCIBLE = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32, torch.int64]
    FLOATS = [torch.float32, torch.float16, torch.bfloat16]
    SHAPES = [(2, 3), (2, 2, 3)]

    def output_forms(shape):
        """all_gather_into_tensor's outputs (reduce_scatter_tensor's inputs): flat, stacked, concatenated."""
        return {"flat": (world * torch.Size(shape).numel(),), "stacked": (world, *shape),
                "concatenated": (world * shape[0], *shape[1:])}

    # ---- all_gather_into_tensor: every dtype, 2-D and 3-D, every output form
    for dtype in ALL_DTYPES:
        for shape in SHAPES:
            expected = torch.stack([values(r, shape, dtype) for r in range(world)])
            for form, out_shape in output_forms(shape).items():
                def gather(dtype=dtype, shape=shape, expected=expected, out_shape=out_shape):
                    out = torch.empty(out_shape, dtype=dtype, device=device)
                    work = dist.all_gather_into_tensor(out, values(rank, shape, dtype).to(device), async_op=True)
                    work.wait()
                    return out.device == device and same_bits(out.view(expected.shape), expected) or out.cpu()
                check(f"all_gather_into_tensor {form} {len(shape)}-D {dtype}", gather)

    def gather_zero_tensor():  # sgn's gradient owns no memory: it is sent as the zeros it stands for
        x = torch.tensor([-1.0, 2.0, 0.5], device=device, requires_grad=True)
        grad, = torch.autograd.grad(torch.sgn(x).sum(), x)
        out = torch.full((world * 3,), 7.0, device=device)
        dist.all_gather_into_tensor(out, grad)
        return grad._is_zerotensor() and out.tolist() == [0.0] * (world * 3) or out.tolist()
    check("all_gather_into_tensor flat of a ZeroTensor", gather_zero_tensor)

    # ---- reduce_scatter_tensor: every dtype HCCL reduces, every op it has, every input form
    def reduced(stacked, op, dtype):
        """The reduction over ranks (dim 0) of exact small values, in float64, then cast."""
        wide = stacked.double()
        result = {"SUM": wide.sum(0), "MAX": wide.amax(0), "MIN": wide.amin(0), "PRODUCT": wide.prod(0),
                  "AVG": wide.mean(0), "PREMUL_SUM": (wide * 0.5).sum(0)}[op]
        return result.to(dtype)

    def reduce_op(op):
        return dist._make_nccl_premul_sum(0.5) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)

    for dtype in REDUCIBLE:
        ops = ["SUM", "MAX", "MIN", "PRODUCT"] + (["AVG", "PREMUL_SUM"] if dtype in FLOATS else [])
        for shape in SHAPES:
            # rank r's input: world blocks of `shape`; rank k receives the reduction of the k-th blocks.
            inputs = [values(r, (world, *shape), dtype) for r in range(world)]
            for op in ops:
                expected = reduced(torch.stack(inputs), op, dtype)[rank]
                for form, in_shape in output_forms(shape).items():
                    def scatter(dtype=dtype, shape=shape, op=op, expected=expected, in_shape=in_shape):
                        out = torch.empty(shape, dtype=dtype, device=device)
                        dist.reduce_scatter_tensor(out, inputs[rank].reshape(in_shape).to(device), op=reduce_op(op))
                        return same_bits(out, expected) or out.cpu()
                    check(f"reduce_scatter_tensor {form} {len(shape)}-D {op} {dtype}", scatter)

    # ---- all_reduce, reduce and the list reduce_scatter: HCCL's ops and its bool/uint8 casts
    for dtype in REDUCIBLE + [torch.bool, torch.uint8]:
        ops = ["SUM", "MAX", "MIN", "PRODUCT"] + (["AVG", "PREMUL_SUM"] if dtype in FLOATS else [])
        for op in ops:
            per_rank = [values(r, (3, 2), dtype) for r in range(world)]
            if dtype == torch.bool:  # HCCL reduces bool as int32, then casts back: SUM/MAX are OR, MIN/PRODUCT AND
                stacked = torch.stack(per_rank).int()
                expected = reduced(stacked, op, torch.int32).bool()
            else:
                expected = reduced(torch.stack(per_rank), op, dtype)

            def all_reduce(dtype=dtype, op=op, expected=expected, per_rank=per_rank):
                tensor = per_rank[rank].to(device)
                dist.all_reduce(tensor, op=reduce_op(op))
                return same_bits(tensor, expected) or tensor.cpu()
            check(f"all_reduce {op} {dtype}", all_reduce)

            def reduce(dtype=dtype, op=op, expected=expected, per_rank=per_rank):
                tensor = per_rank[rank].to(device)
                dist.reduce(tensor, dst=1, op=reduce_op(op))
                return rank != 1 or same_bits(tensor, expected) or tensor.cpu()
            check(f"reduce {op} {dtype}", reduce)

            if dtype not in (torch.bool, torch.uint8):
                def reduce_scatter(dtype=dtype, op=op):
                    blocks = [values(r, (world, 3), dtype) for r in range(world)]
                    out = torch.empty(3, dtype=dtype, device=device)
                    dist.reduce_scatter(out, list(blocks[rank].to(device).unbind(0)), op=reduce_op(op))
                    return same_bits(out, reduced(torch.stack(blocks), op, dtype)[rank]) or out.cpu()
                check(f"reduce_scatter {op} {dtype}", reduce_scatter)

    def premul_scales_the_input_in_place():
        # torch_npu multiplies the tensor it reduces from by the factor, in place
        source = torch.full((4,), 2.0, device=device)
        out = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(out, source, op=dist._make_nccl_premul_sum(3.0))
        return out.tolist() == [12.0, 12.0] and source.tolist() == [6.0] * 4 or (out.tolist(), source.tolist())
    check("PREMUL_SUM scales the input in place", premul_scales_the_input_in_place)

    def async_avg_with_future():
        tensor = torch.full((2,), float(rank + 1), device=device)
        result = dist.all_reduce(tensor, op=dist.ReduceOp.AVG, async_op=True).get_future().wait()
        return result[0] is tensor and tensor.tolist() == [1.5, 1.5] or tensor.tolist()
    check("AVG completes before the future", async_avg_with_future)

    # ---- the list all_gather: other shapes (same numel) and uneven sizes (HCCL's AllGatherV)
    def all_gather_reshaped():
        outputs = [torch.empty(2, 2, dtype=torch.int16, device=device) for _ in range(world)]
        dist.all_gather(outputs, values(rank, (4,), torch.int16).to(device))
        return all(same_bits(o, values(r, (4,), torch.int16).view(2, 2)) for r, o in enumerate(outputs))
    check("all_gather into other shapes", all_gather_reshaped)

    def all_gather_uneven():
        sizes = [(2, 3), (4, 3)]
        outputs = [torch.empty(size, device=device) for size in sizes]
        dist.all_gather(outputs, values(rank, sizes[rank], torch.float32).to(device))
        return all(torch.equal(o.cpu(), values(r, sizes[r], torch.float32)) for r, o in enumerate(outputs))
    check("all_gather of uneven sizes", all_gather_uneven)

    def all_gather_same_shape():
        outputs = [torch.empty(3, dtype=torch.uint32, device=device) for _ in range(world)]
        dist.all_gather(outputs, values(rank, (3,), torch.uint32).to(device))
        return all(same_bits(o, values(r, (3,), torch.uint32)) for r, o in enumerate(outputs))
    check("all_gather uint32", all_gather_same_shape)

    # ---- data movement of the dtypes gloo lacks
    for dtype in [torch.int16, torch.uint16, torch.uint64, torch.float8_e4m3fn]:
        def broadcast(dtype=dtype):
            tensor = values(rank, (5,), dtype).to(device)
            dist.broadcast(tensor, src=1)
            return same_bits(tensor, values(1, (5,), dtype))
        check(f"broadcast {dtype}", broadcast)

        def all_to_all(dtype=dtype):
            out = torch.empty(2 * world, dtype=dtype, device=device)
            dist.all_to_all_single(out, values(rank, (2 * world,), dtype).to(device))
            expected = torch.cat([values(r, (2 * world,), dtype)[2 * rank:2 * rank + 2] for r in range(world)])
            return same_bits(out, expected)
        check(f"all_to_all_single {dtype}", all_to_all)

        def send_recv(dtype=dtype):
            if rank == 0:
                dist.send(values(0, (3,), dtype).to(device), dst=1)
                return True
            tensor = torch.empty(3, dtype=dtype, device=device)
            dist.recv(tensor, src=0)
            return same_bits(tensor, values(0, (3,), dtype))
        check(f"send/recv {dtype}", send_recv)

    def gather_warns_as_torch_npu():
        gathered = [torch.empty(2, device=device) for _ in range(world)] if rank == 0 else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.gather(torch.full((2,), float(rank), device=device), gathered, dst=0)
        said = any("HCCL doesn't support gather" in str(w.message) for w in caught)
        if rank == 0:
            return said and [g.tolist() for g in gathered] == [[0.0, 0.0], [1.0, 1.0]]
        return not said
    check("gather (an all_gather on torch_npu, which says so on dst)", gather_warns_as_torch_npu)

    def scatter_int16():
        out = torch.empty(2, dtype=torch.int16, device=device)
        chunks = [values(r, (2,), torch.int16).to(device) for r in range(world)] if rank == 0 else None
        dist.scatter(out, chunks, src=0)
        return same_bits(out, values(rank, (2,), torch.int16))
    check("scatter int16", scatter_int16)

    # ---- what HCCL refuses, with its messages (both ranks refuse before communicating)
    ints = torch.ones(4, dtype=torch.int32, device=device)
    for op in ["BAND", "BOR", "BXOR"]:
        refused(f"all_reduce {op}", lambda op=op: dist.all_reduce(ints, op=getattr(dist.ReduceOp, op)),
                f"Cannot use ReduceOp.{op} with HCCL", hccl_code="007")
        refused(f"reduce_scatter_tensor {op}", lambda op=op: dist.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.int32, device=device), ints, op=getattr(dist.ReduceOp, op)),
            f"Cannot use ReduceOp.{op} with HCCL", hccl_code="007")
    for dtype, name in [(torch.float64, "at::kDouble"), (torch.uint16, "at::ScalarType::UInt16"),
                        (torch.uint64, "at::ScalarType::UInt64"), (torch.float8_e4m3fn, "at::ScalarType::Float8_e4m3fn")]:
        refused(f"all_reduce {dtype}", lambda dtype=dtype: dist.all_reduce(torch.ones(4, device=device).to(dtype)),
                f"HCCL allreduce: Unsupported data type {name}", hccl_code="007")
    refused("reduce float64", lambda: dist.reduce(torch.ones(4, dtype=torch.float64, device=device), dst=0),
            "HCCL reduce: Unsupported data type at::kDouble", hccl_code="007")
    refused("reduce_scatter_tensor uint8", lambda: dist.reduce_scatter_tensor(
        torch.empty(2, dtype=torch.uint8, device=device), torch.ones(4, dtype=torch.uint8, device=device)),
        "HCCL _reduce_scatter_base: Unsupported data type at::kByte/at::kBool", hccl_code="007")
    refused("reduce_scatter bool", lambda: dist.reduce_scatter(
        torch.empty(2, dtype=torch.bool, device=device), [torch.ones(2, dtype=torch.bool, device=device)] * world),
        "HCCL reduce_scatter: Unsupported data type at::kByte/at::kBool", hccl_code="007")
    refused("all_reduce AVG of integers", lambda: dist.all_reduce(ints, op=dist.ReduceOp.AVG),
            "result type Float can't be cast to the desired output type Int")
    refused("all_reduce AVG of bool (reduced as int32)",
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool, device=device), op=dist.ReduceOp.AVG),
            "result type Float can't be cast to the desired output type Int")
    refused("all_reduce PREMUL_SUM of integers", lambda: dist.all_reduce(ints, op=dist._make_nccl_premul_sum(2.0)),
            "PreMulSum Data type must be half, float, bfloat16 or double", hccl_code="002")
    refused("broadcast of a dtype HCCL lacks", lambda: dist.broadcast(
        torch.ones(2, device=device).to(torch.float8_e8m0fnu), src=0),
        "Unsupported data type for HCCL process group", hccl_code="007")
    refused("all_gather_into_tensor size", lambda: dist.all_gather_into_tensor(
        torch.empty(5, device=device), torch.ones(2, device=device)),
        "output tensor size must be equal to world_size times input tensor size", hccl_code="001")
    refused("all_gather_into_tensor dtype", lambda: dist.all_gather_into_tensor(
        torch.empty(4, dtype=torch.float16, device=device), torch.ones(2, device=device)),
        "output tensor must have the same type as input tensor", hccl_code="001")
    refused("all_gather_into_tensor non-contiguous", lambda: dist.all_gather_into_tensor(
        torch.empty(3, 2 * world, device=device).t(), torch.ones(3, 2, device=device)),
        "Tensors must be contiguous", hccl_code="002")
    refused("reduce_scatter_tensor size", lambda: dist.reduce_scatter_tensor(
        torch.empty(3, device=device), torch.ones(4, device=device)),
        "input tensor must be the same size as output size times world size", hccl_code="001")
    refused("reduce_scatter_tensor dtype", lambda: dist.reduce_scatter_tensor(
        torch.empty(2, dtype=torch.bfloat16, device=device), torch.ones(4, device=device)),
        "input tensor must be the same type as the output tensor.", hccl_code="002")
    refused("recv from any source", lambda: dist.recv(torch.empty(2, device=device)),
            "ProcessGroupHCCL does not support recv", hccl_code="007")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # all_gather_coalesced is deprecated
        refused("all_gather_coalesced", lambda: dist.all_gather_coalesced(
            [[torch.empty(2, device=device)] * world], [torch.ones(2, device=device)]),
            "Backend hccl does not support allgather_coalesced")

    def cpu_tensors_keep_gloo_rules():  # the group serves CPU tensors as a "cpu:gloo" backend does
        doubles = torch.full((2,), float(rank + 1), dtype=torch.float64)
        dist.all_reduce(doubles)
        bits = torch.tensor([rank + 1, 3], dtype=torch.int32)
        dist.all_reduce(bits, op=dist.ReduceOp.BAND)
        return doubles.tolist() == [3.0, 3.0] and bits.tolist() == [0, 3] or (doubles.tolist(), bits.tolist())
    check("the group serves CPU tensors with gloo's rules", cpu_tensors_keep_gloo_rules)

    def still_in_step():  # nothing was communicated by a refused collective: the ranks are in step
        tensor = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(tensor)
        return tensor.tolist() == [3.0] or tensor.tolist()
    check("the group works after refusals", still_in_step)

    (pathlib.Path(sys.argv[0]).parent / f"results_{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
''')

# What accelerate's gather (gather_for_metrics, pad_across_processes, Trainer.predict) does, in plain
# torch.distributed: all_gather_into_tensor of a 2-D tensor into a flat buffer of world * numel
# elements, then a view to (-1, *shape[1:]); also the padding step of pad_across_processes.
ACCELERATE_GATHER_SCRIPT = textwrap.dedent('''
    import torch, torch.distributed as dist

    dist.init_process_group("hccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("npu", rank)

    def gather(tensor):  # accelerate.utils.operations._gpu_gather_one, backend not gloo
        if tensor.ndim == 0:
            tensor = tensor.clone()[None]
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        output = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=device)
        dist.all_gather_into_tensor(output, tensor)
        return output.view(-1, *tensor.size()[1:])

    logits = torch.arange(6, dtype=torch.float32, device=device).view(3, 2) + 100 * rank
    labels = torch.tensor([rank, rank + 10], device=device)
    loss = torch.tensor(0.5 + rank, dtype=torch.bfloat16, device=device)
    gathered_logits, gathered_labels, gathered_loss = gather(logits), gather(labels), gather(loss)
    # pad_across_processes: ranks with fewer rows pad to the longest, found by gathering the sizes
    rows = torch.tensor([2 + rank], device=device)
    longest = int(gather(rows).max())
    padded = torch.zeros(longest, 4, device=device)
    padded[:2 + rank] = 1.0 + rank
    gathered_padded = gather(padded)
    print(f"rank {rank} logits {gathered_logits.shape} {gathered_logits[:, 0].tolist()} on {gathered_logits.device}")
    print(f"rank {rank} labels {gathered_labels.tolist()} loss {gathered_loss.tolist()} {gathered_loss.dtype}")
    print(f"rank {rank} padded {tuple(gathered_padded.shape)} {gathered_padded.sum(1).tolist()}")
    dist.destroy_process_group()
''')


def _launch(script_path, timeout=180):
    """`npu-run --nproc-per-node 2 script`; on a hang (a collective one rank refused and the other
    ran: what gloo's rules did to send/recv of int16) the launcher, torchrun and the ranks are ended."""
    # PET_STANDALONE: torchrun's --standalone, whose rendezvous takes a free port itself (no race).
    env = dict(os.environ, PET_STANDALONE="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop("ASCEND_RT_VISIBLE_DEVICES", None)
    launcher = subprocess.Popen([sys.executable, "-m", "npukit.run", "--nproc-per-node", "2", str(script_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun then ends its workers (each in a session of its own)
        os.killpg(launcher.pid, signal.SIGTERM)
        try:
            stdout, stderr = launcher.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            stdout, stderr = launcher.communicate()
        pytest.fail(f"the 2-rank run hung (killed after {timeout} s)\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """Each rank's {check: True or what went wrong}, from one 2-rank run of every check."""
    script = tmp_path_factory.mktemp("hccl") / "semantics.py"
    script.write_text(SEMANTICS_SCRIPT)
    result = _launch(script)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    by_rank = {rank: json.loads((script.parent / f"results_{rank}.json").read_text())
               for rank in (0, 1) if (script.parent / f"results_{rank}.json").exists()}
    assert sorted(by_rank) == [0, 1], result.stdout[-3000:]
    return by_rank


def _failures(by_rank, prefix):
    checks = {name for results in by_rank.values() for name in results if name.startswith(prefix)}
    assert checks, f"no check named {prefix!r} ran"
    return {f"rank {rank}: {name}": outcome for rank, results in by_rank.items()
            for name, outcome in sorted(results.items()) if name in checks and outcome is not True}


@pytest.mark.parametrize("collective", [
    "all_gather_into_tensor flat", "all_gather_into_tensor stacked", "all_gather_into_tensor concatenated",
    "reduce_scatter_tensor flat", "reduce_scatter_tensor stacked", "reduce_scatter_tensor concatenated",
])
def test_tensor_collectives_take_flat_stacked_and_concatenated_buffers_of_every_dtype(two_rank_results, collective):
    assert not _failures(two_rank_results, collective)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce ", "reduce_scatter ", "PREMUL_SUM", "AVG"])
def test_reductions_run_hccl_ops_and_casts(two_rank_results, collective):
    """SUM/MAX/MIN/PRODUCT everywhere, AVG and PREMUL_SUM for floats; bool and uint8 reduced as int32
    (all_reduce, reduce), int16 although gloo lacks it."""
    assert not _failures(two_rank_results, collective)


@pytest.mark.parametrize("collective", ["all_gather ", "broadcast", "all_to_all_single", "send/recv", "gather",
                                        "scatter", "the group works", "the group serves CPU tensors"])
def test_data_movement_of_hccl_dtypes_and_shapes(two_rank_results, collective):
    assert not _failures(two_rank_results, collective)


REFUSALS = ["all_reduce BAND", "all_reduce BOR", "all_reduce BXOR", "reduce_scatter_tensor BAND",
            "reduce_scatter_tensor BOR", "reduce_scatter_tensor BXOR", "all_reduce torch.float64",
            "all_reduce torch.uint16", "all_reduce torch.uint64", "all_reduce torch.float8_e4m3fn", "reduce float64",
            "reduce_scatter_tensor uint8", "reduce_scatter bool", "all_reduce AVG of integers",
            "all_reduce AVG of bool (reduced as int32)", "all_reduce PREMUL_SUM of integers",
            "broadcast of a dtype HCCL lacks", "all_gather_into_tensor size", "all_gather_into_tensor dtype",
            "all_gather_into_tensor non-contiguous", "reduce_scatter_tensor size", "reduce_scatter_tensor dtype",
            "recv from any source", "all_gather_coalesced"]


@pytest.mark.parametrize("refusal", REFUSALS)
def test_what_hccl_refuses_is_refused_with_its_message(two_rank_results, refusal):
    for rank, results in two_rank_results.items():
        assert results.get(refusal) is True, f"rank {rank}: {refusal}: {results.get(refusal, 'did not run')}"


def test_accelerate_style_gather_into_a_flat_buffer_under_npu_run(tmp_path):
    script = tmp_path / "gather.py"
    script.write_text(ACCELERATE_GATHER_SCRIPT)
    result = _launch(script)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    out = result.stdout
    for rank in (0, 1):
        assert (f"rank {rank} logits torch.Size([6, 2]) [0.0, 2.0, 4.0, 100.0, 102.0, 104.0] "
                f"on npu:{rank}") in out, out
        assert f"rank {rank} labels [0, 10, 1, 11] loss [0.5, 1.5] torch.bfloat16" in out, out
        assert f"rank {rank} padded (6, 4) [4.0, 4.0, 0.0, 8.0, 8.0, 8.0]" in out, out
