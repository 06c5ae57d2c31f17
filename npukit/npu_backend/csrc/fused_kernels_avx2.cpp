// The fused kernels compiled for ATen's CPU capability AVX2 (flags: setup.py).
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "fused_kernels_impl.h"
