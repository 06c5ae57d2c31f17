"""xformers.ops.fmha: the block-diagonal bias kinds, as xformers re-exports them."""

from xformers.ops.fmha.attn_bias import (
    BlockDiagonalCausalFromBottomRightMask,
    BlockDiagonalCausalMask,
    BlockDiagonalMask,
)

__all__ = ["BlockDiagonalCausalFromBottomRightMask", "BlockDiagonalCausalMask", "BlockDiagonalMask"]
