"""flash_attn.losses (stubs)."""
