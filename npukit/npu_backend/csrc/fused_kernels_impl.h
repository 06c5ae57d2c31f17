// The fused kernels for one CPU capability, included by fused_kernels_<capability>.cpp after it
// defines CPU_CAPABILITY (the namespace ATen's vec headers put Vectorized in) and its flags.
//
// Bit for bit with the composition they replace: each expression below is the one ATen's kernel
// evaluates for that op (silu, silu_backward, mul, addcmul), vectorized the same way, and where
// ATen's vectorized loop leaves the last elements of a chunk to its scalar op (whose exp is libm's,
// not the vectorized one), so does the kernel (`for_each_aten_chunk`).
#include "fused_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

namespace npukit::fused::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

template <typename scalar_t>
using acc_t = at::opmath_type<scalar_t>;  // fp32 for fp16/bf16/fp32, fp64 for fp64

// n <= Vec::size() values, converted to the compute type
template <typename scalar_t>
inline Vectorized<acc_t<scalar_t>> load(const scalar_t* p, int64_t n) {
  using Vec = Vectorized<acc_t<scalar_t>>;
  if constexpr (std::is_same_v<scalar_t, acc_t<scalar_t>>) {
    return n >= Vec::size() ? Vec::loadu(p) : Vec::loadu(p, n);
  } else {
    Vec out;
    if (n >= Vec::size()) {
      at::vec::load_to_float(p, out);
    } else {
      scalar_t buffer[Vec::size()] = {};
      std::copy(p, p + n, buffer);
      at::vec::load_to_float(buffer, out);
    }
    return out;
  }
}

// n <= Vec::size() values, rounded once to scalar_t
template <typename scalar_t>
inline void store(scalar_t* p, const Vectorized<acc_t<scalar_t>>& v, int64_t n) {
  using Vec = Vectorized<acc_t<scalar_t>>;
  if constexpr (std::is_same_v<scalar_t, acc_t<scalar_t>>) {
    if (n >= Vec::size()) v.store(p);
    else v.store(p, n);
  } else {
    at::vec::convert_from_float<scalar_t>(v, v).store(p, std::min<int64_t>(n, Vec::size()));
  }
}

// a * b + c as ATen's scalar ops compute it: its AVX2/AVX512 kernels are built with FMA and
// contraction on, so their `self + value * t1 * t2` (addcmul) is one fused multiply-add.
template <typename acc>
inline acc scalar_fmadd(acc a, acc b, acc c) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// fn(begin, vector_end, end) for each chunk of a 1-D elementwise loop over n elements as ATen's
// TensorIterator::for_each splits it (at::parallel_for with GRAIN_SIZE); ATen's vectorized loop
// computes [begin, vector_end) with its vector op and the rest, fewer than two vectors, with its
// scalar op.
template <typename acc, typename F>
inline void for_each_aten_chunk(int64_t n, const F& fn) {
  auto chunk = [&](int64_t begin, int64_t end) {
    constexpr int64_t step = 2 * Vectorized<acc>::size();
    fn(begin, begin + (end - begin) / step * step, end);
  };
  if (n < at::internal::GRAIN_SIZE || at::get_num_threads() == 1) {
    chunk(0, n);
  } else {
    at::parallel_for(0, n, at::internal::GRAIN_SIZE, chunk);
  }
}

// fn(row, c0, c1) for each row's part of the flat range [begin, end) of a [rows, width] array
template <typename F>
inline void for_each_row_part(int64_t begin, int64_t end, int64_t width, const F& fn) {
  while (begin < end) {
    const int64_t row = begin / width;
    const int64_t c0 = begin - row * width;
    const int64_t c1 = std::min(width, c0 + (end - begin));
    fn(row, c0, c1);
    begin += c1 - c0;
  }
}

// ---- SwiGLU: the composition is silu_(a.float()).mul_(b.float()) rounded once; the backward
// silu_backward(b * dy, a) and silu_(a) * dy, each rounded once (on [outer, inner] working copies)

template <typename scalar_t>
void swiglu_forward_typed(const scalar_t* x, scalar_t* out, int64_t outer, int64_t inner) {
  using acc = acc_t<scalar_t>;
  using Vec = Vectorized<acc>;
  const Vec one(acc(1));
  auto rows = [&](int64_t from, int64_t to, bool vectorized) {
    for_each_row_part(from, to, inner, [&](int64_t o, int64_t c0, int64_t c1) {
      const scalar_t* a = x + o * 2 * inner;
      const scalar_t* b = a + inner;
      scalar_t* y = out + o * inner;
      if (vectorized) {
        for (int64_t c = c0; c < c1; c += Vec::size()) {
          const int64_t n = std::min<int64_t>(Vec::size(), c1 - c);
          const Vec av = load(a + c, n);
          const Vec silu = av / (one + av.neg().exp());
          store(y + c, silu * load(b + c, n), n);
        }
        return;
      }
      for (int64_t c = c0; c < c1; ++c) {
        const acc av = acc(a[c]);
        const acc silu = av / (acc(1) + std::exp(-av));
        y[c] = scalar_t(silu * acc(b[c]));
      }
    });
  };
  for_each_aten_chunk<acc>(outer * inner, [&](int64_t begin, int64_t vector_end, int64_t end) {
    rows(begin, vector_end, true);
    rows(vector_end, end, false);
  });
}

template <typename scalar_t>
void swiglu_backward_typed(const scalar_t* dy, const scalar_t* x, scalar_t* dx, int64_t outer, int64_t inner) {
  using acc = acc_t<scalar_t>;
  using Vec = Vectorized<acc>;
  const Vec one(acc(1));
  auto rows = [&](int64_t from, int64_t to, bool vectorized) {
    for_each_row_part(from, to, inner, [&](int64_t o, int64_t c0, int64_t c1) {
      const scalar_t* a = x + o * 2 * inner;
      const scalar_t* b = a + inner;
      const scalar_t* g = dy + o * inner;
      scalar_t* da = dx + o * 2 * inner;
      scalar_t* db = da + inner;
      if (vectorized) {
        for (int64_t c = c0; c < c1; c += Vec::size()) {
          const int64_t n = std::min<int64_t>(Vec::size(), c1 - c);
          const Vec av = load(a + c, n);
          const Vec gv = load(g + c, n);
          const Vec gate = load(b + c, n) * gv;
          const Vec sigmoid = one / (one + av.neg().exp());
          store(da + c, gate * sigmoid * (one + av * (one - sigmoid)), n);
          const Vec silu = av / (one + av.neg().exp());
          store(db + c, silu * gv, n);
        }
        return;
      }
      for (int64_t c = c0; c < c1; ++c) {
        const acc av = acc(a[c]);
        const acc gv = acc(g[c]);
        const acc gate = acc(b[c]) * gv;
        const acc sigmoid = acc(1) / (acc(1) + std::exp(-av));
        da[c] = scalar_t(gate * sigmoid * (acc(1) + av * (acc(1) - sigmoid)));
        const acc silu = av / (acc(1) + std::exp(-av));
        db[c] = scalar_t(silu * gv);
      }
    });
  };
  for_each_aten_chunk<acc>(outer * inner, [&](int64_t begin, int64_t vector_end, int64_t end) {
    rows(begin, vector_end, true);
    rows(vector_end, end, false);
  });
}

// ---- rotary: per pair (x1, x2), (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2), as mul then addcmul
// (value -1, then 1) compute it: addcmul's product is fused into its addition (scalar_fmadd)

template <typename scalar_t>
void rotary_typed(const at::Tensor& x_t, const at::Tensor& cos_t, const at::Tensor& sin_t, const at::Tensor& out_t,
                  bool interleave) {
  using acc = acc_t<scalar_t>;
  using Vec = Vectorized<acc>;
  const scalar_t* x = x_t.const_data_ptr<scalar_t>();
  scalar_t* out = out_t.mutable_data_ptr<scalar_t>();
  const acc* cos = cos_t.const_data_ptr<acc>();
  const acc* sin = sin_t.const_data_ptr<acc>();
  const int64_t n1 = x_t.size(1), n2 = x_t.size(2), d = x_t.size(3), half = d / 2;
  const int64_t rows = x_t.numel() / std::max<int64_t>(d, 1);
  const int64_t cs0 = cos_t.stride(0), cs1 = cos_t.stride(1), cs2 = cos_t.stride(2);
  const int64_t ss0 = sin_t.stride(0), ss1 = sin_t.stride(1), ss2 = sin_t.stride(2);
  const Vec minus_one(acc(-1));
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(d, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i0 = row / (n1 * n2), i1 = (row / n2) % n1, i2 = row % n2;
      const acc* c = cos + i0 * cs0 + i1 * cs1 + i2 * cs2;
      const acc* s = sin + i0 * ss0 + i1 * ss1 + i2 * ss2;
      const scalar_t* xr = x + row * d;
      scalar_t* yr = out + row * d;
      if (interleave) {  // ATen's strided (every other element) loops are its scalar ops
        for (int64_t j = 0; j < d; j += 2) {
          const acc x1 = acc(xr[j]), x2 = acc(xr[j + 1]);
          yr[j] = scalar_t(scalar_fmadd(-x2, s[j], x1 * c[j]));
          yr[j + 1] = scalar_t(scalar_fmadd(x1, s[j + 1], x2 * c[j + 1]));
        }
        continue;
      }
      for (int64_t j = 0; j < half; j += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), half - j);
        const Vec x1 = load(xr + j, n), x2 = load(xr + half + j, n);
        const Vec c1 = load(c + j, n), c2 = load(c + half + j, n);
        const Vec s1 = load(s + j, n), s2 = load(s + half + j, n);
        store(yr + j, at::vec::fmadd(minus_one * x2, s1, x1 * c1), n);
        store(yr + half + j, at::vec::fmadd(x1, s2, x2 * c2), n);
      }
    }
  });
}

// ---- RmsNorm backward, per row: x_hat = x * rstd, dxhat = dy * gamma, dx = (dxhat - x_hat *
// mean(dxhat * x_hat)) * rstd; dgamma = the sum over rows of dy * x_hat. fp32 sums (fp64 for fp64),
// per row and per thread, in the kernel's own order (the reductions are not ATen's, so the last fp32
// bit of a sum may differ from the op-by-op composition's)

template <typename scalar_t>
void rms_norm_backward_typed(const scalar_t* dy, const scalar_t* x, const acc_t<scalar_t>* gamma,
                             const acc_t<scalar_t>* rstd, scalar_t* dx, acc_t<scalar_t>* dgamma, int64_t rows,
                             int64_t width) {
  using acc = acc_t<scalar_t>;
  using Vec = Vectorized<acc>;
  const int64_t threads = at::get_num_threads();
  std::vector<acc> partial(static_cast<size_t>(threads * width), acc(0));
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(width, 1)),
                   [&](int64_t begin, int64_t end) {
    acc* dg = partial.data() + at::get_thread_num() * width;
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* xr = x + row * width;
      const scalar_t* gr = dy + row * width;
      const Vec rs(rstd[row]);
      Vec projection_sum(acc(0));
      for (int64_t c = 0; c < width; c += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), width - c);
        const Vec x_hat = load(xr + c, n) * rs;
        const Vec g = load(gr + c, n);
        projection_sum = projection_sum + g * load(gamma + c, n) * x_hat;
        (Vec::loadu(dg + c, n) + g * x_hat).store(dg + c, n);
      }
      const Vec projection(at::vec::vec_reduce_all([](Vec& a, Vec& b) { return a + b; }, projection_sum) /
                           acc(width));
      for (int64_t c = 0; c < width; c += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), width - c);
        const Vec x_hat = load(xr + c, n) * rs;
        const Vec dxhat = load(gr + c, n) * load(gamma + c, n);
        store(dx + row * width + c, (dxhat - x_hat * projection) * rs, n);
      }
    }
  });
  std::fill(dgamma, dgamma + width, acc(0));
  for (int64_t t = 0; t < threads; ++t)
    for (int64_t c = 0; c < width; ++c) dgamma[c] += partial[t * width + c];
}

// ---- ScaledMaskedSoftmax, per row of the last dim: the logits x * scale (the fp16 kernel's rounded
// to fp16, and with saturation on, a non-finite one saturated as the device's fp16 mul saturates it),
// -10000 where the mask is set, then ATen's last-dim softmax (vec::reduce_all's max, exp, its sum, one
// reciprocal, the product) on the row's fp32 working copy in a buffer that stays in L1, rounded once.
// The backward: ATen's softmax backward ((dy - sum(dy * y)) * y, summed in vec::map2_reduce_all's
// order) on fp32 copies of the row, times scale, 0 where masked, rounded once.

constexpr float kMaskedLogit = -10000.0f;  // what the kernel writes at masked positions (Megatron's value)
constexpr float kHalfMax = 65504.0f;

// The mask (bool, expanded to x's 4-dim shape, contiguous in the last dim) row by row of x.
struct MaskRows {
  const bool* data;
  int64_t s0, s1, s2, n1, n2;
  explicit MaskRows(const at::Tensor& mask)
      : data(mask.const_data_ptr<bool>()), s0(mask.stride(0)), s1(mask.stride(1)), s2(mask.stride(2)),
        n1(mask.size(1)), n2(mask.size(2)) {}
  const bool* row(int64_t r) const { return data + r / (n1 * n2) * s0 + (r / n2) % n1 * s1 + r % n2 * s2; }
};

template <typename acc>
inline void fill_masked(acc* values, const bool* mask, int64_t width, acc masked) {
  for (int64_t c = 0; c < width; ++c) values[c] = mask[c] ? masked : values[c];
}

template <typename scalar_t>
bool scaled_masked_softmax_forward_typed(const at::Tensor& x_t, const at::Tensor& mask_t, const at::Tensor& out_t,
                                         double scale, bool half_logits, bool saturate) {
  using acc = acc_t<scalar_t>;
  using Vec = Vectorized<acc>;
  const scalar_t* x = x_t.const_data_ptr<scalar_t>();
  scalar_t* out = out_t.mutable_data_ptr<scalar_t>();
  const MaskRows mask(mask_t);
  const int64_t width = x_t.size(3), rows = width ? x_t.numel() / width : 0;
  const Vec scale_v(static_cast<acc>(scale));
  std::atomic<bool> saturated{false};
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / (16 * std::max<int64_t>(width, 1))),
                   [&](int64_t begin, int64_t end) {
    std::vector<acc> buffer(width);
    acc* logits = buffer.data();
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* xr = x + row * width;
      for (int64_t c = 0; c < width; c += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), width - c);
        Vec v = load(xr + c, n) * scale_v;
        if constexpr (std::is_same_v<scalar_t, at::Half>) {
          if (half_logits) {  // the fp16 product, as the device's fp16 mul rounds it
            at::Half rounded[Vec::size()];
            store(rounded, v, n);
            v = load(rounded, n);
          }
        }
        v.store(logits + c, n);
      }
      if (saturate) {
        for (int64_t c = 0; c < width; ++c) {
          if (!std::isfinite(logits[c])) {
            logits[c] = std::isnan(logits[c]) ? acc(0) : std::copysign(acc(kHalfMax), logits[c]);
            saturated.store(true, std::memory_order_relaxed);
          }
        }
      }
      fill_masked(logits, mask.row(row), width, acc(kMaskedLogit));
      const acc max = at::vec::reduce_all<acc>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, logits, width);
      at::vec::map([max](Vec v) { return (v - Vec(max)).exp(); }, logits, logits, width);
      acc sum = at::vec::reduce_all<acc>([](Vec& a, Vec& b) { return a + b; }, logits, width);
      sum = 1 / sum;
      scalar_t* yr = out + row * width;
      for (int64_t c = 0; c < width; c += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), width - c);
        store(yr + c, Vec::loadu(logits + c, n) * Vec(sum), n);
      }
    }
  });
  return saturated.load();
}

template <typename scalar_t>
void scaled_masked_softmax_backward_typed(const at::Tensor& dy_t, const at::Tensor& y_t, const at::Tensor& mask_t,
                                          const at::Tensor& dx_t, double scale) {
  using acc = acc_t<scalar_t>;
  using Vec = Vectorized<acc>;
  const scalar_t* dy = dy_t.const_data_ptr<scalar_t>();
  const scalar_t* y = y_t.const_data_ptr<scalar_t>();
  scalar_t* dx = dx_t.mutable_data_ptr<scalar_t>();
  const MaskRows mask(mask_t);
  const int64_t width = y_t.size(3), rows = width ? y_t.numel() / width : 0;
  const Vec scale_v(static_cast<acc>(scale));
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / (16 * std::max<int64_t>(width, 1))),
                   [&](int64_t begin, int64_t end) {
    std::vector<acc> buffer(3 * width);
    acc* grad = buffer.data();
    acc* prob = grad + width;
    acc* products = prob + width;
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t c = 0; c < width; c += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), width - c);
        const Vec g = load(dy + row * width + c, n), p = load(y + row * width + c, n);
        g.store(grad + c, n);
        p.store(prob + c, n);
        (g * p).store(products + c, n);
      }
      // ATen's sum of the rounded products (its vec::map2_reduce_all, whose product and sum its build
      // does not fuse into an FMA; summed in a loop of their own here, the compiler cannot fuse them)
      const acc sum = at::vec::reduce_all<acc>([](Vec& a, Vec& b) { return a + b; }, products, width);
      for (int64_t c = 0; c < width; c += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), width - c);
        const Vec softmax_grad = (Vec::loadu(grad + c, n) - Vec(sum)) * Vec::loadu(prob + c, n);
        (softmax_grad * scale_v).store(grad + c, n);
      }
      fill_masked(grad, mask.row(row), width, acc(0));
      for (int64_t c = 0; c < width; c += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), width - c);
        store(dx + row * width + c, Vec::loadu(grad + c, n), n);
      }
    }
  });
}

#define NPUKIT_FLOAT_DISPATCH(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, __VA_ARGS__)

void swiglu_forward(const at::Tensor& x, const at::Tensor& out, int64_t outer, int64_t inner) {
  NPUKIT_FLOAT_DISPATCH(x.scalar_type(), "npu_swiglu", [&] {
    swiglu_forward_typed(x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), outer, inner);
  });
}

void swiglu_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dx, int64_t outer, int64_t inner) {
  NPUKIT_FLOAT_DISPATCH(x.scalar_type(), "npu_swiglu_backward", [&] {
    swiglu_backward_typed(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                          dx.mutable_data_ptr<scalar_t>(), outer, inner);
  });
}

void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& out,
            bool interleave) {
  NPUKIT_FLOAT_DISPATCH(x.scalar_type(), "npu_rotary_mul", [&] { rotary_typed<scalar_t>(x, cos, sin, out, interleave); });
}

void rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& rstd,
                       const at::Tensor& dx, const at::Tensor& dgamma, int64_t rows, int64_t width) {
  NPUKIT_FLOAT_DISPATCH(x.scalar_type(), "npu_rms_norm_backward", [&] {
    using acc = acc_t<scalar_t>;
    rms_norm_backward_typed(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), gamma.const_data_ptr<acc>(),
                            rstd.const_data_ptr<acc>(), dx.mutable_data_ptr<scalar_t>(),
                            dgamma.mutable_data_ptr<acc>(), rows, width);
  });
}

bool scaled_masked_softmax_forward(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& out, double scale,
                                   bool half_logits, bool saturate) {
  bool saturated = false;
  NPUKIT_FLOAT_DISPATCH(x.scalar_type(), "npu_scaled_masked_softmax", [&] {
    saturated = scaled_masked_softmax_forward_typed<scalar_t>(x, mask, out, scale, half_logits, saturate);
  });
  return saturated;
}

void scaled_masked_softmax_backward(const at::Tensor& dy, const at::Tensor& y, const at::Tensor& mask,
                                    const at::Tensor& dx, double scale) {
  NPUKIT_FLOAT_DISPATCH(y.scalar_type(), "npu_scaled_masked_softmax_backward",
                        [&] { scaled_masked_softmax_backward_typed<scalar_t>(dy, y, mask, dx, scale); });
}

}  // namespace

// x (fp32, contiguous) rounded to fp16 (to nearest even, as .to(torch.float16)) and back to fp32 into out
// (x itself allowed), in one pass. Returns whether a rounded value is not finite.
bool round_to_half(const at::Tensor& x, const at::Tensor& out) {
  const float* in = x.const_data_ptr<float>();
  float* result = out.mutable_data_ptr<float>();
  std::atomic<bool> not_finite{false};
  at::parallel_for(0, x.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
    using Vec = Vectorized<float>;
    constexpr int64_t kStep = 2 * Vec::size();
    Vec spread(0.0f);  // sum of (y - y): nan once a y is inf or nan
    int64_t i = begin;
    for (; i + kStep <= end; i += kStep) {
      const auto half = at::vec::convert_from_float<at::Half>(Vec::loadu(in + i), Vec::loadu(in + i + Vec::size()));
      const auto [low, high] = at::vec::convert_to_float<at::Half>(half);
      low.store(result + i);
      high.store(result + i + Vec::size());
      spread = spread + (low - low) + (high - high);
    }
    float spread_tail = 0.0f;
    for (; i < end; ++i) {
      result[i] = static_cast<float>(static_cast<at::Half>(in[i]));
      spread_tail += result[i] - result[i];
    }
    float lanes[Vec::size()];
    spread.store(lanes);
    for (float lane : lanes) spread_tail += lane;
    if (spread_tail != spread_tail) not_finite = true;
  });
  return not_finite;
}

// Each row of s [rows, width] (fp32, contiguous) becomes exp(s - its max) in place, 0 where s - max < -87
// (the masked scores, -1e30, whose exp leaves the vectorised exp's fast path); the row's max and the sum
// of its exps go to row_max / row_sum [rows]. Rows of one task stay in cache between the two passes.
void exp_rows(const at::Tensor& s, const at::Tensor& row_max, const at::Tensor& row_sum) {
  using Vec = Vectorized<float>;
  const int64_t width = s.size(-1), rows = width ? s.numel() / width : 0;
  float* data = s.mutable_data_ptr<float>();
  float* maxes = row_max.mutable_data_ptr<float>();
  float* sums = row_sum.mutable_data_ptr<float>();
  constexpr float kFloor = -87.0f;
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, width)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = data + r * width;
      const float largest = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); },
                                                       row, width);
      const Vec largest_vec(largest), floor(kFloor), zero(0.0f);
      Vec sum_vec(0.0f);
      int64_t j = 0;
      for (; j + Vec::size() <= width; j += Vec::size()) {
        const Vec x = Vec::loadu(row + j) - largest_vec;
        const Vec e = Vec::blendv(at::vec::maximum(x, floor).exp(), zero, x < floor);
        e.store(row + j);
        sum_vec = sum_vec + e;
      }
      float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum_vec);
      for (; j < width; ++j) {
        const float x = row[j] - largest;
        row[j] = x < kFloor ? 0.0f : std::exp(x);
        sum += row[j];
      }
      maxes[r] = largest;
      sums[r] = sum;
    }
  });
}

Kernels kernels() {
  return Kernels{&swiglu_forward, &swiglu_backward, &rotary, &rms_norm_backward, &scaled_masked_softmax_forward,
                 &scaled_masked_softmax_backward, &round_to_half, &exp_rows};
}

}  // namespace npukit::fused::CPU_CAPABILITY
