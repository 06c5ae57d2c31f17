"""The advisor does not blame the user's code for what the emulator's own kernels do inside an op.

Found on VeOmni's NPU MoE (npu_moe_token_permute -> npu_grouped_matmul -> npu_swiglu, tokens per
expert from torch.histc of the int expert ids): npu-profile --advise reported host syncs at the
npu_grouped_matmul line (the emulator reads group_list on the host to check it) and host<->device
copies at the histc and npu_grouped_matmul lines (the emulator's integer histc counts on a host
copy). On an Ascend device each is one kernel reading its inputs on the device: no sync, no copy.
"""

from __future__ import annotations

import torch

import npukit.profiler
from npukit.npu_backend.torch_npu_shim import install_torch_npu
from npukit.profiler.advisor import advise
from npukit.profiler.table import KIND_OP, EventTable


def _record(tmp_path, step_fn, steps: int = 3) -> EventTable:
    with npukit.profiler.profile(tmp_path, trace=False, auto_steps=False) as prof:
        for index in range(steps):
            step_fn(index)
            prof.step()
    return EventTable.load(tmp_path / "rank0")


def test_grouped_matmul_and_integer_histc_are_no_host_sync_or_copy_of_the_user(tmp_path, npu_device):
    torch_npu = install_torch_npu()
    expert_ids = torch.randint(0, 4, (32,), device=npu_device)
    tokens = torch.randn(32, 16, device=npu_device, dtype=torch.bfloat16)
    weights = torch.randn(4, 16, 32, device=npu_device, dtype=torch.bfloat16)

    def step(index: int) -> None:
        tokens_per_expert = torch.histc(expert_ids, bins=4, min=0, max=4)
        permuted = tokens[torch.argsort(expert_ids)]
        torch_npu.npu_grouped_matmul([permuted], [weights], group_list=tokens_per_expert, split_item=2,
                                     group_type=0, group_list_type=1)

    table = _record(tmp_path, step)
    rules = {finding.rule for finding in advise(table)}
    assert not rules & {"host-sync", "host-device-copies"}, rules
    # the ops the user called stay theirs; only the emulator's work inside them is set aside
    names = table.string_array()[table.name_id]
    user_ops = {names[r] for r in range(len(table)) if table.kind[r] == KIND_OP and not table.framework[r]}
    assert {"aten::histc", "npu::npu_grouped_matmul"} <= user_ops
    inside = {names[r] for r in range(len(table)) if table.kind[r] == KIND_OP and table.framework[r]}
    assert "aten::_grouped_mm" in inside


def test_a_sync_the_user_writes_next_to_a_fused_op_is_still_reported(tmp_path, npu_device):
    torch_npu = install_torch_npu()
    x = torch.randn(8, 64, device=npu_device)
    weight = torch.ones(64, device=npu_device)

    def step(index: int) -> None:
        y = torch_npu.npu_rms_norm(x, weight)[0]
        y.sum().item()

    fired = {finding.rule: finding for finding in advise(_record(tmp_path, step))}
    assert any("test_emulator_kernel_advice.py" in line for line in fired["host-sync"].evidence)
