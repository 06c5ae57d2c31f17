"""xformers' memory_efficient_attention as plain torch (the reference for the --fused tests)."""
