"""npukit: move PyTorch models from CUDA GPUs to Ascend NPUs and prove the move was right."""

__version__ = "0.1.0"
