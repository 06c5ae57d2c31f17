"""nn.LSTM / nn.GRU / nn.RNN and their cells on npu: forward and backward agree with CPU."""

import pytest
import torch

from npukit.npu_backend import numerics


def _compare(module_factory, input_shape, needs_state: bool):
    torch.manual_seed(0)
    module = module_factory()
    x = torch.randn(*input_shape)
    outputs, grads = [], []
    for device in ("cpu", "npu"):
        m = module.to(device)
        m.zero_grad()
        xd = x.to(device).detach().requires_grad_()
        out = m(xd)
        flat = out[0] if isinstance(out, tuple) else out
        if isinstance(flat, tuple):
            flat = flat[0]
        extra = out[1] if needs_state and isinstance(out, tuple) else None
        loss = flat.square().sum()
        if extra is not None:
            states = extra if isinstance(extra, tuple) else (extra,)
            loss = loss + sum(s.sum() for s in states)
        loss.backward()
        # Copies: moving the module to npu swaps its parameters (and their grads) in place, as
        # torch_npu does, which would otherwise change the CPU results kept here.
        outputs.append(flat.detach().cpu().clone())
        grads.append([xd.grad.cpu().clone()] + [p.grad.cpu().clone() for p in m.parameters()])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    for npu_grad, cpu_grad in zip(grads[1], grads[0]):
        torch.testing.assert_close(npu_grad, cpu_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
@pytest.mark.parametrize("bias", [True, False])
def test_recurrent_layers_match_cpu(cls, bias):
    with numerics.golden():
        _compare(lambda: cls(6, 10, num_layers=2, batch_first=True, bias=bias, bidirectional=True), (3, 7, 6), True)


@pytest.mark.parametrize("cls", [torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell])
def test_recurrent_cells_match_cpu(cls):
    with numerics.golden():
        _compare(lambda: cls(5, 8), (4, 5), False)


def test_lstm_gradient_through_cell_state_only():
    torch.manual_seed(0)
    cell = torch.nn.LSTMCell(4, 3)
    x = torch.randn(2, 4)
    results = []
    for device in ("cpu", "npu"):
        c = cell.to(device)
        c.zero_grad()
        _, cy = c(x.to(device))
        cy.sum().backward()  # grad_hy is undefined in the fused backward
        results.append(c.weight_ih.grad.cpu().clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_lstm_fp16_runs_on_npu():
    lstm = torch.nn.LSTM(8, 8).half().npu()
    out, (h, c) = lstm(torch.randn(5, 2, 8, dtype=torch.float16, device="npu"))
    assert out.dtype == torch.float16 and out.device.type == "npu" and torch.isfinite(out.cpu()).all()
