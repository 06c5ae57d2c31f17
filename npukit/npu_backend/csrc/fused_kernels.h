// One-pass CPU kernels of torch_npu's fused elementwise ops (fused/*.py calls them through _C).
//
// Each kernel reads fp16/bf16/fp32 (or, on the CPU, fp64) values, computes in fp32 (fp64) in
// registers and rounds its result once, as the Ascend kernel does. The arithmetic is ATen's own, op
// for op (the same at::vec expressions, with the scalar tails where ATen's elementwise loops put
// them), so the results are bit for bit those of the op-by-op composition on fp32 working copies
// that it replaces, at a single pass over memory. RmsNorm's backward sums in its own order (fp32).
//
// The kernels are compiled once per CPU capability (fused_kernels_<capability>.cpp, flags from
// setup.py) and the one matching ATen's own dispatch (at::native::get_cpu_capability()) runs.
#pragma once

#include <ATen/ATen.h>

namespace npukit::fused {

// The kernels work on contiguous CPU tensors (the npu tensors' CPU aliases) of one dtype.
struct Kernels {
  // x viewed as [outer, 2, inner]: out[o, i] = silu(x[o, 0, i]) * x[o, 1, i]
  void (*swiglu_forward)(const at::Tensor& x, const at::Tensor& out, int64_t outer, int64_t inner);
  // dx[o, 0, i] = silu'(a) * b * dy, dx[o, 1, i] = silu(a) * dy (dy of x's dtype)
  void (*swiglu_backward)(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dx, int64_t outer,
                          int64_t inner);
  // out = x * cos + rotate(x) * sin over the last dim of a 4-dim x; cos/sin are fp32 (fp64 for an fp64
  // x) tables expanded to x's shape (stride 0 where they broadcast), contiguous in the last dim.
  void (*rotary)(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& out,
                 bool interleave);
  // RmsNorm's input and gamma gradients over [rows, width] (gamma and rstd in the compute dtype, dgamma
  // written in it)
  void (*rms_norm_backward)(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& gamma,
                            const at::Tensor& rstd, const at::Tensor& dx, const at::Tensor& dgamma, int64_t rows,
                            int64_t width);
  // ScaledMaskedSoftmax over the last dim of a 4-dim x: softmax of x * scale (rounded to fp16 first when
  // half_logits; a non-finite fp16 logit saturated when saturate) with -10000 where mask (bool, expanded
  // to x's shape, contiguous in the last dim) is set. Returns whether a logit was saturated.
  bool (*scaled_masked_softmax_forward)(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& out,
                                        double scale, bool half_logits, bool saturate);
  // Its input gradient: ((dy - sum(dy * y)) * y) * scale, 0 where masked (dy of y's dtype)
  void (*scaled_masked_softmax_backward)(const at::Tensor& dy, const at::Tensor& y, const at::Tensor& mask,
                                         const at::Tensor& dx, double scale);
  // fp32 x (contiguous) rounded to fp16 and back into out (fp32, contiguous; x itself allowed): the
  // kernel's fp16 intermediates in one pass. Returns whether a value is not finite after the rounding.
  bool (*round_to_half)(const at::Tensor& x, const at::Tensor& out);
  // Each row of fp32 s (contiguous, last dim) becomes exp(s - its max) in place (0 below exp(-87)); the
  // rows' max and sum of exps into row_max / row_sum (fp32, one value a row).
  void (*exp_rows)(const at::Tensor& s, const at::Tensor& row_max, const at::Tensor& row_sum);
};

#define NPUKIT_DECLARE_KERNELS(capability) \
  namespace capability {                   \
  Kernels kernels();                       \
  }
NPUKIT_DECLARE_KERNELS(DEFAULT)
#if defined(__x86_64__)
NPUKIT_DECLARE_KERNELS(AVX2)
NPUKIT_DECLARE_KERNELS(AVX512)
#endif
#undef NPUKIT_DECLARE_KERNELS

#if defined(__x86_64__)
// out [batches, M, N] (fp32 or bf16, contiguous) = alpha * a @ b (+ bias), of a [batches, M, K] (bf16, or fp32
// rounded to bf16) and bf16 b [batches, K, N] (any strides), the products exact and summed in fp32
// (vdpbf16ps). bias: fp32 [1 or batches, M, N], contiguous in N; where it is `masked`, the result is
// `masked` (0 with row_offset). row_offset: fp32 [batches, M]; the result x becomes
// exp(clamp(x - row_offset, -87, 0)) (the attention backward's probabilities), or with probabilities (fp32
// [batches, M, N], contiguous) probabilities * (x - row_offset) (dS from dP). Compiled with AVX512-BF16
// (fused_kernels_avx512bf16.cpp): call it only where the CPU has it. on_amx: the products by oneDNN's
// brgemm on AMX tiles (the same numerics, the sums in another order), where cpublas::could_pack(bf16) says
// the CPU has AMX.
namespace AVX512BF16 {
void bf16_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, std::optional<double> masked,
                 const at::Tensor& row_offset, const at::Tensor& probabilities, const at::Tensor& out, double alpha,
                 bool on_amx);
// npu_fusion_attention's bf16 forward on AMX, the scores never leaving a block's buffer: q [batches, M, D],
// k [batches, N, D], v [batches, N, Dv] (bf16, contiguous in the last dim, D and Dv even), bias and masked
// as bf16_matmul's; out [batches, M, Dv] = exp(S - max) (rounded to bf16) @ v / sum, the rows' max and sum
// [batches, M] (fp32, contiguous). Call it only where the CPU has AMX (cpublas::could_pack(bf16)).
void attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                       std::optional<double> masked, double scale, const at::Tensor& out, const at::Tensor& row_max,
                       const at::Tensor& row_sum);
// Its gradients from dy [batches, M, Dv] (bf16) and the rows' log-sum-exp and rowsum(dO * O) [batches, M]
// (fp32): P recomputed per block, dq [batches, M, D], dk [batches, N, D], dv [batches, N, Dv] (bf16,
// contiguous), each rounded once.
void attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dy,
                        const at::Tensor& bias, std::optional<double> masked, const at::Tensor& log_sum_exp,
                        const at::Tensor& row_dot, double scale, const at::Tensor& dq, const at::Tensor& dk,
                        const at::Tensor& dv);
// The same for fp16 q, k, v, dy: fp32 matmuls (brgemm) of the fp16 values, exp(S - max) and dS rounded to fp16
// as the fp16 path of fused/attention.py rounds them, out, dq, dk, dv fp32 (not yet rounded). A dS that rounds
// to inf or nan is saturated (nan 0, inf +-65504) when `saturate`; returns whether one did.
void half_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                            std::optional<double> masked, double scale, const at::Tensor& out,
                            const at::Tensor& row_max, const at::Tensor& row_sum);
bool half_attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dy,
                             const at::Tensor& bias, std::optional<double> masked, const at::Tensor& log_sum_exp,
                             const at::Tensor& row_dot, double scale, bool saturate, const at::Tensor& dq,
                             const at::Tensor& dk, const at::Tensor& dv);
}
#endif

}  // namespace npukit::fused
