"""flash_attn.losses.cross_entropy.CrossEntropyLoss as its triton kernel computes it: per row, in fp32,
lse - label_smoothing * sum(logits) / vocab - (1 - label_smoothing) * logits[target], 0 for an ignored
row; 'mean' divides the sum by the number of rows not ignored. The loss is fp32 whatever the logits' dtype."""

import torch


class CrossEntropyLoss(torch.nn.Module):
    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, logit_scale=1.0,
                 lse_square_scale=0.0, inplace_backward=False, process_group=None, return_z_loss=False):
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing

    def forward(self, input, target, precomputed_lse=None):
        logits = input.float()
        kept = target != self.ignore_index
        picked = logits.gather(-1, target.masked_fill(~kept, 0)[:, None])[:, 0]
        smoothing = self.label_smoothing
        loss = logits.logsumexp(-1) - smoothing * logits.sum(-1) / logits.shape[-1] - (1 - smoothing) * picked
        loss = loss.masked_fill(~kept, 0.0)
        if self.reduction == "mean":
            return loss.sum() / kept.sum()
        return loss.sum() if self.reduction == "sum" else loss
