from npukit.npu_backend.torch_npu_shim import install_torch_npu
from tests.npu_backend.conftest import restore_numerics  # noqa: F401  (every test starts from the defaults)

# The fused-op tests call the ops as users do, through `import torch_npu` (npu-run installs it).
install_torch_npu()
