"""flash_attn.layers (the rotary embedding only)."""
