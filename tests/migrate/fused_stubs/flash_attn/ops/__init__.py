"""flash_attn.ops: the fused layers (stubs)."""
