"""apex's amp_C multi-tensor kernels (csrc/multi_tensor_{l2norm,scale,axpby}_kernel.cu), their math
written out in fp32: every element read as fp32, the overflow flag set to 1 when the kernel sees a
non-finite value (l2norm: a sum of squares; scale and axpby: an input arg_to_check names)."""

import torch


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    squares = torch.stack([t.float().pow(2).sum() for t in tensor_lists[0]])
    if not squares.isfinite().all():
        noop_flag.fill_(1)
    total = squares.sum().sqrt().reshape(1)
    return total, squares.sqrt() if per_tensor else torch.empty(0, device=total.device)


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    for source, target in zip(*tensor_lists):
        if not source.isfinite().all():
            noop_flag.fill_(1)
        target.copy_(source.float() * scale)


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check):
    for x, y, out in zip(*tensor_lists):
        checked = {-1: (x, y), 0: (x,), 1: (y,)}[arg_to_check]
        if not all(t.isfinite().all() for t in checked):
            noop_flag.fill_(1)
        out.copy_(a * x.float() + b * y.float())
