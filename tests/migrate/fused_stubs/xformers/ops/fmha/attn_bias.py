"""xformers' block-diagonal bias kinds (batch 1, the sequences concatenated): query i of a sequence sees
the keys of its own sequence only; the causal kinds also mask, within the sequence, key j > i + offset
(BlockDiagonalCausalMask: the diagonal at each block's top-left corner; ...FromBottomRightMask: bottom-right)."""

import torch


class BlockDiagonalMask:
    offset = None  # not causal

    def __init__(self, q_seqlen, kv_seqlen):
        self.q_seqlen, self.kv_seqlen = list(q_seqlen), list(kv_seqlen)

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None, *, device=None):
        return cls(q_seqlen, q_seqlen if kv_seqlen is None else kv_seqlen)

    def masked(self) -> torch.Tensor:
        """[Tq, Tkv] True where the score is masked out."""
        q_ids = torch.repeat_interleave(torch.arange(len(self.q_seqlen)), torch.tensor(self.q_seqlen))
        k_ids = torch.repeat_interleave(torch.arange(len(self.kv_seqlen)), torch.tensor(self.kv_seqlen))
        masked = q_ids[:, None] != k_ids[None, :]
        if self.offset is not None:
            q_starts = torch.tensor([0, *self.q_seqlen]).cumsum(0)[q_ids]
            k_starts = torch.tensor([0, *self.kv_seqlen]).cumsum(0)[k_ids]
            i = torch.arange(len(q_ids)) - q_starts  # positions within each sequence
            j = torch.arange(len(k_ids)) - k_starts
            shift = torch.tensor([self.offset(lq, lk) for lq, lk in zip(self.q_seqlen, self.kv_seqlen)])[q_ids]
            masked |= j[None, :] > (i + shift)[:, None]
        return masked


class BlockDiagonalCausalMask(BlockDiagonalMask):
    offset = staticmethod(lambda seq_q, seq_k: 0)


class BlockDiagonalCausalFromBottomRightMask(BlockDiagonalMask):
    offset = staticmethod(lambda seq_q, seq_k: seq_k - seq_q)
