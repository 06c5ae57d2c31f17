// The fused kernels compiled for ATen's CPU capability DEFAULT (flags: setup.py).
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "fused_kernels_impl.h"
