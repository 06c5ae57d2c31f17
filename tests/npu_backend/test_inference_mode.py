"""torch.inference_mode() on the emulated NPU, then training in the same process (evaluation between
epochs): the device's cached CPU aliases must not carry inference mode out of it."""

import torch
import torch.nn as nn


def test_training_after_evaluation_under_inference_mode():
    """The CPU alias made for a weight under inference_mode was reused by optimizer.step() after it:
    'Inplace update to inference tensor outside InferenceMode'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).to("npu")
    reference = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    reference.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for _epoch in range(5):
        with torch.inference_mode():  # evaluation: every batch size, results written in place
            for n in range(1, 12):
                x = torch.randn(n, 4)
                y = model(x.to("npu"))
                y.add_(1)
                torch.testing.assert_close(y.cpu(), reference(x) + 1, rtol=1e-5, atol=1e-6)
        x = torch.randn(3, 4)
        for m, optimizer, batch in zip((model, reference), optimizers, (x.to("npu"), x)):
            loss = m(batch).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert not p.is_inference()


def test_views_of_normal_tensors_under_inference_mode():
    """view_as_real / .real / unfold of an npu tensor made outside inference_mode, taken inside it
    (a rotary model's complex buffer during evaluation): 'Cannot set version_counter for inference tensor'."""
    freqs = torch.polar(torch.ones(8, 4), torch.randn(8, 4))
    on_npu = freqs.to("npu")
    signal = torch.randn(16).to("npu")
    with torch.inference_mode():
        torch.testing.assert_close(torch.view_as_real(on_npu).cpu(), torch.view_as_real(freqs))
        torch.testing.assert_close(on_npu.real.cpu(), freqs.real)
        torch.testing.assert_close(signal.unfold(0, 4, 2).cpu(), signal.cpu().unfold(0, 4, 2))
        made_inside = torch.view_as_complex(torch.view_as_real(on_npu) * 2)
        assert made_inside.is_inference()
    assert not torch.view_as_real(on_npu).is_inference()
