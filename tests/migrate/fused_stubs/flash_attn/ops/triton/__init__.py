"""flash_attn.ops.triton (stubs)."""
