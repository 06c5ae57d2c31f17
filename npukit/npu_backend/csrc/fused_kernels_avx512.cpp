// The fused kernels compiled for ATen's CPU capability AVX512 (flags: setup.py).
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "fused_kernels_impl.h"
