import torch
import torch_npu

from npukit.npu_backend import numerics


def test_float_status_reads_and_clears_the_sticky_overflow_flag():
    """The apex-style check: alloc a status, run fp16 work, get the status, clear it."""
    numerics.set_fp16_mode("saturation")
    status = torch_npu.npu_alloc_float_status(torch.zeros(1, device="npu"))
    assert status.shape == (8,) and status.dtype == torch.float32 and not status.any()

    x = torch.full((4,), 60000.0, dtype=torch.float16, device="npu")
    _ = x + x  # saturates, sets the flag
    assert float(torch_npu.npu_get_float_status(status).sum()) > 0
    torch_npu.npu_clear_float_status(status)
    assert float(torch_npu.npu_get_float_status(status).sum()) == 0

    _ = x * 0.5  # finite work leaves it clear
    assert float(torch_npu.npu_get_float_status(status).sum()) == 0
