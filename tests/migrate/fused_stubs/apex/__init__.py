"""NVIDIA apex's fused norms and FusedAdam as plain torch (the reference for the --fused tests)."""
