// The fused kernels' entry points for fused/*.py (bound as _C.<name>): they take the op's npu (or,
// for the golden reference, CPU) tensors, run the kernel of ATen's CPU capability on their CPU
// aliases and return a new tensor on the same device. The Python op checks the arguments first.
#include "fused_kernels.h"

#include <atomic>
#include <vector>

#include <ATen/OpMathType.h>
#include <ATen/Version.h>
#include <ATen/native/CPUBlas.h>
#include <torch/csrc/Dtype.h>
#include <torch/extension.h>

namespace npukit {
at::Tensor cpu_alias(const at::Tensor& t);  // device.cpp
void saturate_half(const at::Tensor& cpu);
extern std::atomic<bool> g_saturation;     // the fp16 saturation mode
extern std::atomic<bool> g_overflow_flag;  // the sticky overflow flag
}  // namespace npukit

namespace npukit::fused {
namespace {

const Kernels& kernels() {
  static const Kernels chosen = [] {
#if defined(__x86_64__)
    const std::string capability = at::get_cpu_capability();  // ATen's dispatch (ATEN_CPU_CAPABILITY too)
    if (capability == "AVX512") return AVX512::kernels();
    if (capability == "AVX2") return AVX2::kernels();
#endif
    return DEFAULT::kernels();
  }();
  return chosen;
}

// An fp16 result on the npu saturates as every fp16 result of the device does (saturation mode).
void finish(const at::Tensor& result_cpu, const at::Tensor& like) {
  if (like.is_privateuseone()) saturate_half(result_cpu);
}

int64_t product(at::IntArrayRef sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

at::Tensor swiglu_forward(const at::Tensor& x, int64_t dim) {
  auto sizes = x.sizes().vec();
  sizes[dim] /= 2;
  at::Tensor out = at::empty(sizes, x.options());
  const at::Tensor x_cpu = cpu_alias(x).contiguous(), out_cpu = cpu_alias(out);
  {
    pybind11::gil_scoped_release no_gil;
    kernels().swiglu_forward(x_cpu, out_cpu, product(x.sizes().slice(0, dim)),
                             product(at::IntArrayRef(sizes).slice(dim)));
  }
  finish(out_cpu, x);
  return out;
}

at::Tensor swiglu_backward(const at::Tensor& dy, const at::Tensor& x, int64_t dim) {
  if (dy.scalar_type() != x.scalar_type()) {  // computed in x's compute dtype, rounded once
    const auto compute = at::toOpMathType(x.scalar_type());
    return swiglu_backward(dy.to(compute), x.to(compute), dim).to(x.scalar_type());
  }
  at::Tensor dx = at::empty(x.sizes(), x.options());
  const at::Tensor x_cpu = cpu_alias(x).contiguous(), dy_cpu = cpu_alias(dy).contiguous(), dx_cpu = cpu_alias(dx);
  {
    pybind11::gil_scoped_release no_gil;
    kernels().swiglu_backward(dy_cpu, x_cpu, dx_cpu, product(x.sizes().slice(0, dim)), product(dy.sizes().slice(dim)));
  }
  finish(dx_cpu, x);
  return dx;
}

// x * cos + rotate(x) * sin of a 4-dim x, cos/sin broadcasting to it, rounded once to out_dtype.
at::Tensor rotary_mul(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave,
                      at::ScalarType out_dtype) {
  const auto compute = at::promote_types(at::toOpMathType(x.scalar_type()),
                                         at::promote_types(at::toOpMathType(cos.scalar_type()),
                                                           at::toOpMathType(sin.scalar_type())));
  if (at::toOpMathType(x.scalar_type()) != compute || x.scalar_type() != out_dtype) {
    return rotary_mul(x.to(compute), cos, sin, interleave, compute).to(out_dtype);
  }
  auto table = [&](const at::Tensor& t) {
    at::Tensor cpu = cpu_alias(t).to(compute);
    if (cpu.stride(-1) != 1) cpu = cpu.contiguous();
    return cpu.expand(x.sizes());
  };
  const at::Tensor cos_cpu = table(cos), sin_cpu = table(sin);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const at::Tensor x_cpu = cpu_alias(x).contiguous(), out_cpu = cpu_alias(out);
  {
    pybind11::gil_scoped_release no_gil;
    kernels().rotary(x_cpu, cos_cpu, sin_cpu, out_cpu, interleave);
  }
  finish(out_cpu, x);
  return out;
}

// RmsNorm's gradients: dx in x's dtype, dgamma in gamma's (both rounded once).
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& gamma,
                                                     const at::Tensor& rstd) {
  const auto compute = at::toOpMathType(x.scalar_type());
  if (dy.scalar_type() != x.scalar_type()) {
    auto [dx, dgamma] = rms_norm_backward(dy.to(compute), x.to(compute), gamma, rstd);
    return {dx.to(x.scalar_type()), dgamma};
  }
  const int64_t width = gamma.numel(), rows = width ? x.numel() / width : 0;
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dgamma = at::empty(gamma.sizes(), gamma.options().dtype(compute));
  const at::Tensor x_cpu = cpu_alias(x).contiguous(), dy_cpu = cpu_alias(dy).contiguous();
  const at::Tensor gamma_cpu = cpu_alias(gamma).to(compute).contiguous(), rstd_cpu = cpu_alias(rstd).to(compute).contiguous();
  const at::Tensor dx_cpu = cpu_alias(dx), dgamma_cpu = cpu_alias(dgamma);
  {
    pybind11::gil_scoped_release no_gil;
    kernels().rms_norm_backward(dy_cpu, x_cpu, gamma_cpu, rstd_cpu, dx_cpu, dgamma_cpu, rows, width);
  }
  finish(dx_cpu, x);
  return {dx, dgamma.to(gamma.scalar_type())};
}

// The mask's CPU alias expanded to x's 4-dim shape, contiguous in its last dim.
at::Tensor expanded_mask(const at::Tensor& mask, const at::Tensor& x) {
  at::Tensor cpu = cpu_alias(mask);
  if (cpu.stride(-1) != 1) cpu = cpu.contiguous();
  return cpu.expand(x.sizes());
}

// ScaledMaskedSoftmax of a 4-dim x (the Python op checks the shapes and builds the mask), in x's dtype.
// half_logits: the fp16 kernel's logits, x * scale rounded to fp16 (scale already an fp16 value).
at::Tensor scaled_masked_softmax_forward(const at::Tensor& x, const at::Tensor& mask, double scale, bool half_logits) {
  TORCH_CHECK(!half_logits || x.scalar_type() == at::kHalf, "scaled_masked_softmax_forward: half_logits needs fp16 x");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const at::Tensor x_cpu = cpu_alias(x).contiguous(), mask_cpu = expanded_mask(mask, x), out_cpu = cpu_alias(out);
  // the device's fp16 mul saturates its product (and raises the overflow flag) in saturation mode
  const bool saturate = half_logits && x.is_privateuseone() && g_saturation.load(std::memory_order_relaxed);
  bool saturated;
  {
    pybind11::gil_scoped_release no_gil;
    saturated = kernels().scaled_masked_softmax_forward(x_cpu, mask_cpu, out_cpu, scale, half_logits, saturate);
  }
  if (saturated) g_overflow_flag = true;
  finish(out_cpu, x);
  return out;
}

// Its input gradient in dy's dtype (computed in the compute dtype of dy and y, rounded once).
at::Tensor scaled_masked_softmax_backward(const at::Tensor& dy, const at::Tensor& y, const at::Tensor& mask,
                                          double scale) {
  if (dy.scalar_type() != y.scalar_type()) {
    const auto compute = at::promote_types(at::toOpMathType(dy.scalar_type()), at::toOpMathType(y.scalar_type()));
    return scaled_masked_softmax_backward(dy.to(compute), y.to(compute), mask, scale).to(dy.scalar_type());
  }
  at::Tensor dx = at::empty(y.sizes(), y.options());
  const at::Tensor dy_cpu = cpu_alias(dy).contiguous(), y_cpu = cpu_alias(y).contiguous();
  const at::Tensor mask_cpu = expanded_mask(mask, y), dx_cpu = cpu_alias(dx);
  {
    pybind11::gil_scoped_release no_gil;
    kernels().scaled_masked_softmax_backward(dy_cpu, y_cpu, mask_cpu, dx_cpu, scale);
  }
  finish(dx_cpu, y);
  return dx;
}

// An fp32 intermediate the kernel keeps in fp16 (fused.round_intermediate), rounded to fp16 and back in
// one pass, into out (x itself when not given); on the npu, a value the rounding makes non-finite
// saturates as the device's fp16 results do (saturation mode).
at::Tensor round_to_half(const at::Tensor& x, const std::optional<at::Tensor>& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "round_to_half: a contiguous fp32 tensor, got ",
              x.scalar_type());
  TORCH_CHECK(!out || (out->scalar_type() == at::kFloat && out->is_contiguous() && out->sizes() == x.sizes() &&
                       out->device() == x.device()),
              "round_to_half: out must be a contiguous fp32 tensor of x's shape on its device");
  const at::Tensor result = out ? *out : x;
  const at::Tensor x_cpu = cpu_alias(x), result_cpu = cpu_alias(result);
  bool not_finite;
  {
    pybind11::gil_scoped_release no_gil;
    not_finite = kernels().round_to_half(x_cpu, result_cpu);
  }
  if (not_finite && x.is_privateuseone() && g_saturation.load(std::memory_order_relaxed)) {
    g_overflow_flag = true;
    constexpr double kHalfMax = 65504.0;
    result_cpu.nan_to_num_(0.0, kHalfMax, -kHalfMax);
  }
  return result;
}

// The flash kernel's unnormalised softmax of the scores s (fp32, contiguous): each row becomes exp(s - its
// max) in place, 0 below exp(-87) (masked scores); returns the rows' max and sum of exps ([..., 1], fp32).
std::tuple<at::Tensor, at::Tensor> exp_rows(const at::Tensor& s) {
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() >= 1,
              "exp_rows: a contiguous fp32 tensor, got ", s.scalar_type());
  auto sizes = s.sizes().vec();
  sizes.back() = 1;
  at::Tensor row_max = at::empty(sizes, s.options()), row_sum = at::empty(sizes, s.options());
  const at::Tensor s_cpu = cpu_alias(s), max_cpu = cpu_alias(row_max), sum_cpu = cpu_alias(row_sum);
  {
    pybind11::gil_scoped_release no_gil;
    kernels().exp_rows(s_cpu, max_cpu, sum_cpu);
  }
  return {row_max, row_sum};
}

// MoE routing: the stable order of the flat expert ids (int32, each in [start, end)) by expert, as
// torch.argsort(ids, stable=True) gives it (equal ids keep their flat order), and each expert's count
// (int64), by a counting sort: one pass to count, one to place (argsort's comparison sort costs ~10x).
std::tuple<at::Tensor, at::Tensor> stable_expert_order(const at::Tensor& ids, int64_t start, int64_t end) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kInt && start < end,
              "stable_expert_order: 1-D int32 expert ids and a non-empty range [start, end)");
  const int64_t pairs = ids.numel();
  at::Tensor order = at::empty({pairs}, ids.options().dtype(at::kLong));
  at::Tensor counts = at::zeros({end - start}, ids.options().dtype(at::kLong));
  const at::Tensor ids_cpu = cpu_alias(ids).contiguous(), order_cpu = cpu_alias(order), counts_cpu = cpu_alias(counts);
  const int32_t* id = ids_cpu.const_data_ptr<int32_t>();
  int64_t* count = counts_cpu.mutable_data_ptr<int64_t>();
  int64_t* out = order_cpu.mutable_data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(id[i] >= start && id[i] < end, "stable_expert_order: expert id ", id[i], " at ", i,
                " is outside [", start, ", ", end, ")");
    ++count[id[i] - start];
  }
  std::vector<int64_t> next(static_cast<size_t>(end - start));
  for (int64_t e = 0, offset = 0; e < end - start; ++e) {
    next[e] = offset;
    offset += count[e];
  }
  for (int64_t i = 0; i < pairs; ++i) out[next[id[i] - start]++] = i;
  return {order, counts};
}

// Does the CPU multiply bf16 pairs into fp32 (AVX512-BF16, with the AVX-512 it extends)? Checked here,
// in code compiled without AVX-512, before any of it runs.
bool has_bf16_dot_product() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// Does the CPU have AMX for bf16 (oneDNN's brgemm runs on its tiles)? Off: bf16_matmul on vdpbf16ps.
bool has_amx_bf16() { return has_bf16_dot_product() && at::native::cpublas::could_pack(at::kBFloat16); }

// alpha * a @ b (+ bias) of a [batches, M, K] (bf16, or fp32 rounded to bf16) and bf16 b [batches, K, N]
// (any strides), the products exact and summed in fp32 as the cube unit computes, rounded once to
// out_dtype (fp32 or bf16); on the operands' device. Where the bias is `masked`, the result is `masked`.
// With row_offset ([batches, M]), the result x is exp(clamp(x - row_offset, -87, 0)) and 0 where masked;
// with probabilities too ([batches, M, N]), probabilities * (x - row_offset). on_amx (where the CPU has AMX,
// by default): the products on the AMX tiles (oneDNN's brgemm), else on vdpbf16ps.
at::Tensor bf16_matmul(const at::Tensor& a, const at::Tensor& b, double alpha, const std::optional<at::Tensor>& bias,
                       std::optional<double> masked, const std::optional<at::Tensor>& row_offset,
                       const std::optional<at::Tensor>& probabilities, at::ScalarType out_dtype,
                       std::optional<bool> on_amx) {
  TORCH_CHECK(has_bf16_dot_product(), "bf16_matmul: this CPU has no AVX512-BF16 (see has_bf16_dot_product)");
  TORCH_CHECK(!on_amx.value_or(false) || has_amx_bf16(), "bf16_matmul: on_amx on a CPU without AMX (see has_amx_bf16)");
  const bool amx = on_amx.value_or(has_amx_bf16());
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1),
              "bf16_matmul: a [batches, M, K] and b [batches, K, N], got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK((a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kFloat) && b.scalar_type() == at::kBFloat16,
              "bf16_matmul: a bf16 or fp32 and b bf16, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "bf16_matmul: out_dtype fp32 or bf16, got ",
              out_dtype);
  TORCH_CHECK(a.device() == b.device(), "bf16_matmul: operands on ", a.device(), " and ", b.device());
  const int64_t batches = a.size(0), M = a.size(1), N = b.size(2);
  at::Tensor bias_cpu, offset_cpu;
  if (bias) {
    TORCH_CHECK(bias->dim() == 3 && (bias->size(0) == 1 || bias->size(0) == batches) && bias->size(1) == M &&
                    bias->size(2) == N && bias->device() == a.device(),
                "bf16_matmul: the bias must be [1 or ", batches, ", ", M, ", ", N, "] on ", a.device(), ", got ",
                bias->sizes(), " on ", bias->device());
    bias_cpu = cpu_alias(*bias).to(at::kFloat);
    if (bias_cpu.stride(2) != 1) bias_cpu = bias_cpu.contiguous();
  }
  if (row_offset) {
    TORCH_CHECK(row_offset->numel() == batches * M && row_offset->device() == a.device(),
                "bf16_matmul: row_offset must hold [", batches, ", ", M, "] values on ", a.device(), ", got ",
                row_offset->sizes(), " on ", row_offset->device());
    offset_cpu = cpu_alias(*row_offset).to(at::kFloat).contiguous();
  }
  at::Tensor probabilities_cpu;
  if (probabilities) {
    TORCH_CHECK(row_offset && probabilities->sizes() == at::IntArrayRef({batches, M, N}) &&
                    probabilities->device() == a.device(),
                "bf16_matmul: probabilities must be [", batches, ", ", M, ", ", N, "] on ", a.device(),
                " with row_offset, got ", probabilities->sizes(), " on ", probabilities->device());
    probabilities_cpu = cpu_alias(*probabilities).to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({batches, M, N}, a.options().dtype(out_dtype));
  const at::Tensor a_cpu = cpu_alias(a), b_cpu = cpu_alias(b), out_cpu = cpu_alias(out);
#if defined(__x86_64__)
  {
    pybind11::gil_scoped_release no_gil;
    AVX512BF16::bf16_matmul(a_cpu, b_cpu, bias_cpu, masked, offset_cpu, probabilities_cpu, out_cpu, alpha, amx);
  }
#endif
  return out;
}

// The bf16 operands of the attention kernels as their CPU aliases, contiguous in the last dim (they read rows
// at the tensors' own batch and row strides).
at::Tensor attention_operand(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q,
                             int64_t batches) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == batches && t.scalar_type() == q.scalar_type() && t.device() == q.device(),
              op, ": ", name, " must be ", q.scalar_type(), " [", batches, ", rows, dim] on ", q.device(), ", got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
  TORCH_CHECK(t.scalar_type() != at::kBFloat16 || t.size(2) % 2 == 0, op, ": ", name,
              "'s last dim must be even (bf16 pairs), got ", t.size(2));
  at::Tensor cpu = cpu_alias(t);
  return cpu.stride(2) == 1 ? cpu : cpu.contiguous();
}

at::Tensor attention_bias(const char* op, const std::optional<at::Tensor>& bias, const at::Tensor& q, int64_t N) {
  if (!bias) return at::Tensor();
  const int64_t batches = q.size(0), M = q.size(1);
  TORCH_CHECK(bias->dim() == 3 && (bias->size(0) == 1 || bias->size(0) == batches) && bias->size(1) == M &&
                  bias->size(2) == N && bias->device() == q.device(),
              op, ": the bias must be [1 or ", batches, ", ", M, ", ", N, "] on ", q.device(), ", got ", bias->sizes(),
              " on ", bias->device());
  at::Tensor cpu = cpu_alias(*bias).to(at::kFloat);
  return cpu.stride(2) == 1 ? cpu : cpu.contiguous();
}

at::Tensor row_values(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK(t.numel() == q.size(0) * q.size(1) && t.device() == q.device(), op, ": ", name, " must hold [",
              q.size(0), ", ", q.size(1), "] values on ", q.device(), ", got ", t.sizes(), " on ", t.device());
  return cpu_alias(t).to(at::kFloat).contiguous();
}

// npu_fusion_attention's bf16 or fp16 forward in one kernel (AVX512BF16::attention_forward, half_attention_forward):
// q [batches, M, D], k [batches, N, D], v [batches, N, Dv] (bf16 with D and Dv even, or fp16), the bias and masked
// score as bf16_matmul's. Returns the output [batches, M, Dv] (fp32, not yet rounded) and the rows' max and sum
// [batches, M, 1].
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& bias,
    std::optional<double> masked, double scale) {
  constexpr const char* op = "attention_forward";
  TORCH_CHECK(has_amx_bf16(), op, ": this CPU has no AMX for bf16 (see has_amx_bf16)");
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf), op,
              ": q must be bf16 or fp16 [batches, M, D], got ", q.scalar_type(), " ", q.sizes());
  const int64_t batches = q.size(0), M = q.size(1);
  const at::Tensor q_cpu = attention_operand(op, "q", q, q, batches), k_cpu = attention_operand(op, "k", k, q, batches);
  const at::Tensor v_cpu = attention_operand(op, "v", v, q, batches);
  TORCH_CHECK(k.size(2) == q.size(2) && v.size(1) == k.size(1), op, ": k [batches, N, ", q.size(2),
              "] and v [batches, N, Dv], got ", k.sizes(), " and ", v.sizes());
  const at::Tensor bias_cpu = attention_bias(op, bias, q, k.size(1));
  at::Tensor out = at::empty({batches, M, v.size(2)}, q.options().dtype(at::kFloat));
  at::Tensor row_max = at::empty({batches, M, 1}, out.options()), row_sum = at::empty({batches, M, 1}, out.options());
#if defined(__x86_64__)
  {
    pybind11::gil_scoped_release no_gil;
    const auto kernel = q.scalar_type() == at::kHalf ? &AVX512BF16::half_attention_forward : &AVX512BF16::attention_forward;
    kernel(q_cpu, k_cpu, v_cpu, bias_cpu, masked, scale, cpu_alias(out), cpu_alias(row_max), cpu_alias(row_sum));
  }
#endif
  return {out, row_max, row_sum};
}

// Its gradients (AVX512BF16::attention_backward, half_attention_backward) from dy [batches, M, Dv] (q's dtype), the
// rows' log-sum-exp of the forward's softmax and rowsum(dy * out) ([batches, M] values): dq, dk, dv (bf16: rounded
// once; fp16: fp32, dS rounded to fp16 between, saturated in the device's saturation mode as round_to_half does).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dy,
    const std::optional<at::Tensor>& bias, std::optional<double> masked, const at::Tensor& log_sum_exp,
    const at::Tensor& row_dot, double scale) {
  constexpr const char* op = "attention_backward";
  TORCH_CHECK(has_amx_bf16(), op, ": this CPU has no AMX for bf16 (see has_amx_bf16)");
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf), op,
              ": q must be bf16 or fp16 [batches, M, D], got ", q.scalar_type(), " ", q.sizes());
  const int64_t batches = q.size(0);
  const at::Tensor q_cpu = attention_operand(op, "q", q, q, batches), k_cpu = attention_operand(op, "k", k, q, batches);
  const at::Tensor v_cpu = attention_operand(op, "v", v, q, batches);
  const at::Tensor dy_cpu = attention_operand(op, "dy", dy, q, batches);
  TORCH_CHECK(k.size(2) == q.size(2) && v.size(1) == k.size(1) && dy.size(1) == q.size(1) && dy.size(2) == v.size(2),
              op, ": k [batches, N, ", q.size(2), "], v [batches, N, Dv] and dy [batches, ", q.size(1),
              ", Dv], got ", k.sizes(), ", ", v.sizes(), " and ", dy.sizes());
  const at::Tensor bias_cpu = attention_bias(op, bias, q, k.size(1));
  const at::Tensor lse_cpu = row_values(op, "log_sum_exp", log_sum_exp, q);
  const at::Tensor dot_cpu = row_values(op, "row_dot", row_dot, q);
  const bool half = q.scalar_type() == at::kHalf;
  const auto options = q.options().dtype(half ? at::kFloat : at::kBFloat16);
  at::Tensor dq = at::empty(q.sizes(), options), dk = at::empty(k.sizes(), options), dv = at::empty(v.sizes(), options);
#if defined(__x86_64__)
  const bool saturate = q.is_privateuseone() && g_saturation.load(std::memory_order_relaxed);
  bool not_finite = false;
  {
    pybind11::gil_scoped_release no_gil;
    if (half) {
      not_finite = AVX512BF16::half_attention_backward(q_cpu, k_cpu, v_cpu, dy_cpu, bias_cpu, masked, lse_cpu, dot_cpu,
                                                       scale, saturate, cpu_alias(dq), cpu_alias(dk), cpu_alias(dv));
    } else {
      AVX512BF16::attention_backward(q_cpu, k_cpu, v_cpu, dy_cpu, bias_cpu, masked, lse_cpu, dot_cpu, scale,
                                     cpu_alias(dq), cpu_alias(dk), cpu_alias(dv));
    }
  }
  if (not_finite && saturate) g_overflow_flag = true;
#endif
  return {dq, dk, dv};
}

}  // namespace

void bind(pybind11::module& m) {
  m.def("swiglu_forward", &swiglu_forward, "npu_swiglu's kernel (fused/activations.py)");
  m.def("swiglu_backward", &swiglu_backward, "npu_swiglu_backward's kernel (fused/activations.py)");
  m.def("rms_norm_backward", &rms_norm_backward, "npu_rms_norm_backward's kernel (fused/norms.py)");
  m.def("stable_expert_order", &stable_expert_order,
        "the stable order of MoE expert ids and their counts (fused/moe.py)");
  m.def("scaled_masked_softmax_forward", &scaled_masked_softmax_forward,
        "npu_scaled_masked_softmax's kernel (fused/softmax.py)");
  m.def("scaled_masked_softmax_backward", &scaled_masked_softmax_backward,
        "npu_scaled_masked_softmax_backward's kernel (fused/softmax.py)");
  m.def("round_to_half", &round_to_half, pybind11::arg("x"), pybind11::arg("out") = pybind11::none(),
        "fp32 x rounded to fp16 and back in one pass, in place or into out (fused/attention.py)");
  m.def("exp_rows", &exp_rows, "exp(s - rows' max) in place, and the rows' max and sum (fused/attention.py)");
  m.def("has_bf16_dot_product", &has_bf16_dot_product,
        "whether the CPU has AVX512-BF16, which bf16_matmul needs");
  m.def("has_amx_bf16", &has_amx_bf16, "whether bf16_matmul runs on the CPU's AMX tiles (oneDNN's brgemm)");
  m.def("bf16_matmul", [](const at::Tensor& a, const at::Tensor& b, double alpha, const std::optional<at::Tensor>& bias,
                          std::optional<double> masked, const std::optional<at::Tensor>& row_offset,
                          const std::optional<at::Tensor>& probabilities, const pybind11::object& out_dtype,
                          std::optional<bool> on_amx) {
    TORCH_CHECK(out_dtype.is_none() || THPDtype_Check(out_dtype.ptr()), "bf16_matmul: out_dtype must be a torch.dtype");
    return bf16_matmul(a, b, alpha, bias, masked, row_offset, probabilities,
                       out_dtype.is_none() ? at::kFloat : reinterpret_cast<THPDtype*>(out_dtype.ptr())->scalar_type,
                       on_amx);
  }, pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("alpha") = 1.0, pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("masked") = pybind11::none(), pybind11::arg("row_offset") = pybind11::none(),
        pybind11::arg("probabilities") = pybind11::none(), pybind11::arg("out_dtype") = pybind11::none(),
        pybind11::arg("on_amx") = pybind11::none(),
        "alpha * a @ b (+ bias) of bf16 (or fp32) a and bf16 b, products exact and summed in fp32 (fused/attention.py)");
  m.def("attention_forward", &attention_forward, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("masked") = pybind11::none(), pybind11::arg("scale") = 1.0,
        "npu_fusion_attention's bf16/fp16 forward in one kernel: output, rows' max and sum (fused/attention.py)");
  m.def("attention_backward", &attention_backward, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("dy"), pybind11::arg("bias"), pybind11::arg("masked"), pybind11::arg("log_sum_exp"),
        pybind11::arg("row_dot"), pybind11::arg("scale") = 1.0,
        "npu_fusion_attention's bf16/fp16 gradients in one kernel (fused/attention.py)");
  m.def("rotary_mul", [](const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave,
                         const pybind11::object& out_dtype) {
    TORCH_CHECK(THPDtype_Check(out_dtype.ptr()), "rotary_mul: out_dtype must be a torch.dtype");
    return rotary_mul(x, cos, sin, interleave, reinterpret_cast<THPDtype*>(out_dtype.ptr())->scalar_type);
  }, "npu_rotary_mul's kernel and its input gradient's (fused/rotary.py)");
}

}  // namespace npukit::fused
