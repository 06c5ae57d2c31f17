"""ZeroTensors on the npu: the gradient sgn's backward returns for real inputs owns no memory.

The ZeroTensor dispatch key lets clone, copy_, dot, views and the factory/utility functions fall
through to the device kernel with the ZeroTensor itself; the device used to hand their CPU kernel an
alias of its (absent) memory, a null pointer, and the process died (SIGSEGV) on `grad.clone()`,
printing the gradient or comparing it (PyTorch's test_ops `sgn` tests). Each case runs in its own
interpreter, so a crash fails that case instead of killing the test run.
"""

import signal

import pytest

from tests.npu_backend.conftest import run_python

# The gradient of sgn for real inputs: an npu ZeroTensor.
PRELUDE = """
import torch
import npukit.npu_backend  # noqa: F401
x = torch.tensor([-1.5, 0.0, 2.0], device="npu", requires_grad=True)
grad, = torch.autograd.grad(torch.sgn(x).sum(), x)
assert grad._is_zerotensor() and grad.device.type == "npu", grad
"""

CASES = {
    "clone": """
        copy = grad.clone()
        assert copy.device.type == "npu" and not copy._is_zerotensor() and copy.tolist() == [0.0] * 3
        copy.add_(1)  # a clone is a real, mutable tensor
        assert copy.tolist() == [1.0] * 3
        """,
    "print": """
        assert repr(grad) == "tensor([0., 0., 0.], device='npu:0')", repr(grad)
        assert str(grad.view(3, 1).t()) == "tensor([[0., 0., 0.]], device='npu:0')"
        """,
    "isclose": """
        zeros = torch.zeros(3, device="npu")
        assert torch.isclose(grad, zeros).all() and torch.allclose(grad, zeros) and torch.equal(grad, zeros)
        torch.testing.assert_close(grad, zeros)
        """,
    "arithmetic": """
        ones = torch.ones(3, device="npu")
        assert (grad + 1).tolist() == [1.0] * 3 and (ones + grad).tolist() == [1.0] * 3
        assert (grad * ones)._is_zerotensor() and (grad * 2).tolist() == [0.0] * 3
        assert torch.dot(grad, ones).item() == 0.0 and (-grad).abs().sum().item() == 0.0
        """,
    "copy_and_views": """
        target = torch.ones(3, device="npu")
        target.copy_(grad)
        assert target.tolist() == [0.0] * 3
        assert grad.view(3, 1).expand(3, 2).contiguous().tolist() == [[0.0, 0.0]] * 3
        assert grad[1:].clone().tolist() == [0.0, 0.0] and grad.to(torch.float16).tolist() == [0.0] * 3
        assert grad.cpu().tolist() == [0.0] * 3 and grad.flip(0).tolist() == [0.0] * 3
        """,
    "immutable": """
        try:
            grad.add_(1)
        except RuntimeError as error:
            assert "ZeroTensors are immutable" in str(error), error
        else:
            raise AssertionError("a ZeroTensor was written in place")
        """,
    "complex": """
        z = torch._efficientzerotensor(2, dtype=torch.complex64, device="npu")
        assert z.conj().clone().tolist() == [0j, 0j] and torch.view_as_real(z).clone().tolist() == [[0.0, 0.0]] * 2
        """,
    "gradcheck": """
        # gradcheck compares the analytical gradient (a ZeroTensor) with the numerical one; float64
        # elementwise ops run on the npu (only the cube unit refuses float64).
        real = torch.tensor([-0.7, 0.4, 1.3], dtype=torch.float64, device="npu", requires_grad=True)
        assert torch.autograd.gradcheck(torch.sgn, (real,))
        assert torch.autograd.gradgradcheck(torch.sgn, (real,))
        complex_input = torch.tensor([0.3 + 0.4j, -1.0 + 2.0j], dtype=torch.complex128, device="npu",
                                     requires_grad=True)
        assert torch.autograd.gradcheck(torch.sgn, (complex_input,))
        # accumulated into .grad (a ZeroTensor there too, as on the CPU), read by an optimizer step
        leaf = torch.tensor([0.5, -2.0, 3.0], device="npu", requires_grad=True)
        (torch.sgn(leaf) * 2).sum().backward()
        assert leaf.grad._is_zerotensor() and leaf.grad.tolist() == [0.0] * 3
        torch.optim.SGD([leaf], lr=0.1, momentum=0.9, weight_decay=0.1).step()
        assert torch.allclose(leaf.detach().cpu(), torch.tensor([0.5, -2.0, 3.0]) * 0.99)
        """,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sgn_backward_zero_tensor_is_usable(case):
    import textwrap

    result = run_python(PRELUDE + textwrap.dedent(CASES[case]) + "print('done')\n", timeout=120)
    assert result.returncode != -signal.SIGSEGV, f"{case} crashed the process (SIGSEGV)\n{result.stderr}"
    assert result.returncode == 0 and result.stdout.strip().endswith("done"), result.stdout + result.stderr
