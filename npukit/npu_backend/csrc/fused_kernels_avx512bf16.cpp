// The batched matmuls of npu_fusion_attention (fused/attention.py) on AVX512-BF16 (flags: setup.py), and its
// forward and backward as one kernel each on AMX (bf16, and fp16 with fp32 matmuls; see attention_forward).
//
// vdpbf16ps multiplies bf16 pairs exactly and sums them in fp32: the Ascend cube unit's numerics. The
// CPU's own bf16 GEMM (oneDNN) rounds its result to bf16 and torch has no CPU kernel for the out_dtype
// matmuls, so without this an fp32 result (the scores, dP) costs an fp32 matmul on upcast copies.
// The sums run over K in order, two products at a time, with vdpbf16ps's denormal flushing (DAZ/FTZ).
// On a CPU with AMX (cpublas::could_pack(bf16)) the tiles' products run instead on its tiles through
// oneDNN's brgemm (at::native::cpublas::brgemm, as ATen's CPU flash attention calls it): tdpbf16ps
// multiplies exactly and sums in fp32 too (DAZ/FTZ), in its own order; packing and epilogue are shared.
//
// Like the flash kernel, the matmul does not compute what masking makes known: a tile of the result
// whose bias is the masked score throughout (or, for dS, whose probabilities are 0 throughout), and the
// leading and trailing zeros of a block of a's rows (the probabilities and dS past the causal band). For finite operands the result is the
// same; an inf or nan of b there does not reach it. fused_kernels.cpp calls it only where the CPU has
// AVX512-BF16.
#include "fused_kernels.h"

#include <immintrin.h>
#include <sleef.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

namespace npukit::fused::AVX512BF16 {
namespace {

constexpr int64_t kRows = 8;              // rows of the result per register tile
constexpr int64_t kColumns = 32;          // its columns: two zmm of 16 fp32
constexpr int64_t kMaxColumnBlock = 512;  // columns of b packed at once (kept in L2 with the rows of a)
constexpr float kExpFloor = -87.0f;       // the probabilities' floor, exp(-87) (see _backward)

using Bf16 = uint16_t;

// fp32 -> bf16 as c10::BFloat16 rounds (to nearest even, a nan to the quiet nan 0x7FC0), in the
// upper 16 bits of each lane.
inline __m512i round_to_bf16_high(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(_mm512_andnot_si512(_mm512_set1_epi32(0xFFFF), rounded), nan,
                               _mm512_set1_epi32(0x7FC00000));
}

inline Bf16 round_to_bf16(float x) {  // one value, the same rounding
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (x != x) return 0x7FC0;
  return static_cast<Bf16>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// One pair along K as vdpbf16ps reads it: the even k in the low half.
inline uint32_t pair(Bf16 even, Bf16 odd) { return uint32_t(even) | (uint32_t(odd) << 16); }

template <typename T>
inline Bf16 to_bf16(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return round_to_bf16(x);
  } else {
    return x;
  }
}

// A [M, K] operand (bf16 or fp32, rounded to bf16 as it is packed) at given strides.
template <typename T>
struct Matrix {
  const T* data;
  int64_t stride_m, stride_k;
};

// kRows rows of a as [pairs][kRows] pairs (rows past `rows` and the odd k past K zeros; 0 * 0 adds
// nothing). Returns the range of pairs [first, last) outside which every packed pair is zero.
template <typename T>
std::pair<int64_t, int64_t> pack_rows(Matrix<T> a, int64_t rows, int64_t K, uint32_t* out) {
  const int64_t pairs = (K + 1) / 2, whole = K / 2;
  std::fill(out, out + pairs * kRows, 0u);
  if constexpr (std::is_same_v<T, float>) {
    if (a.stride_m == 1 && rows == kRows) {  // a transposed: 8 rows' values of one k are adjacent
      for (int64_t p = 0; p < whole; ++p) {
        const __m512 even = _mm512_castps256_ps512(_mm256_loadu_ps(a.data + 2 * p * a.stride_k));
        const __m512 odd = _mm512_castps256_ps512(_mm256_loadu_ps(a.data + (2 * p + 1) * a.stride_k));
        const __m512i packed = _mm512_or_si512(_mm512_srli_epi32(round_to_bf16_high(even), 16),
                                               round_to_bf16_high(odd));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + p * kRows), _mm512_castsi512_si256(packed));
      }
      if (K % 2) {
        for (int64_t r = 0; r < kRows; ++r) out[whole * kRows + r] = pair(round_to_bf16(a.data[(K - 1) * a.stride_k + r]), 0);
      }
    } else if (a.stride_k == 1) {  // rows contiguous in K: 8 pairs of a row at a time
      const __m512i even_lanes = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
      const __m512i odd_lanes = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 15, 13, 11, 9, 7, 5, 3, 1);
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = a.data + r * a.stride_m;
        int64_t p = 0;
        for (; p + 8 <= whole; p += 8) {
          const __m512i rounded = round_to_bf16_high(_mm512_loadu_ps(row + 2 * p));
          const __m512i packed = _mm512_or_si512(
              _mm512_srli_epi32(_mm512_permutexvar_epi32(even_lanes, rounded), 16),
              _mm512_permutexvar_epi32(odd_lanes, rounded));
          alignas(64) uint32_t lanes[16];
          _mm512_store_si512(lanes, packed);
          for (int64_t i = 0; i < 8; ++i) out[(p + i) * kRows + r] = lanes[i];
        }
        for (; p < whole; ++p) out[p * kRows + r] = pair(round_to_bf16(row[2 * p]), round_to_bf16(row[2 * p + 1]));
        if (K % 2) out[whole * kRows + r] = pair(round_to_bf16(row[K - 1]), 0);
      }
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = a.data + r * a.stride_m;
        for (int64_t p = 0; p < whole; ++p) {
          out[p * kRows + r] = pair(round_to_bf16(row[2 * p * a.stride_k]), round_to_bf16(row[(2 * p + 1) * a.stride_k]));
        }
        if (K % 2) out[whole * kRows + r] = pair(round_to_bf16(row[(K - 1) * a.stride_k]), 0);
      }
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      const Bf16* row = a.data + r * a.stride_m;
      if (a.stride_k == 1) {
        for (int64_t p = 0; p < whole; ++p) std::memcpy(out + p * kRows + r, row + 2 * p, sizeof(uint32_t));
      } else {
        for (int64_t p = 0; p < whole; ++p) out[p * kRows + r] = pair(row[2 * p * a.stride_k], row[(2 * p + 1) * a.stride_k]);
      }
      if (K % 2) out[whole * kRows + r] = pair(row[(K - 1) * a.stride_k], 0);
    }
  }
  // the zero pairs at both ends (+0 and -0 alike): 8 rows' pairs are one 256-bit vector
  auto nonzero = [&](int64_t p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + p * kRows));
    return !_mm256_testz_si256(v, _mm256_set1_epi32(0x7FFF7FFF));
  };
  int64_t first = 0, last = pairs;
  while (first < last && !nonzero(first)) ++first;
  while (last > first && !nonzero(last - 1)) --last;
  return {first, last};
}

// kColumns columns of b [K, N] (bf16) as [pairs][kColumns] pairs (zeros past `columns` and K).
void pack_columns(const Bf16* b, int64_t stride_k, int64_t stride_n, int64_t columns, int64_t K, uint32_t* out) {
  const int64_t pairs = (K + 1) / 2, whole = K / 2;
  if (stride_n == 1) {  // rows of b contiguous: interleave two rows' 32 values
    const __mmask32 valid = columns >= 32 ? ~__mmask32(0) : (__mmask32(1) << columns) - 1;
    alignas(64) static const uint16_t low_index[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i low = _mm512_load_si512(low_index);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512i even = _mm512_maskz_loadu_epi16(valid, b + 2 * p * stride_k);
      const __m512i odd = 2 * p + 1 < K ? _mm512_maskz_loadu_epi16(valid, b + (2 * p + 1) * stride_k)
                                        : _mm512_setzero_si512();
      _mm512_storeu_si512(out + p * kColumns, _mm512_permutex2var_epi16(even, low, odd));
      _mm512_storeu_si512(out + p * kColumns + 16, _mm512_permutex2var_epi16(even, high, odd));
    }
    return;
  }
  for (int64_t j = 0; j < kColumns; ++j) {
    uint32_t* dst = out + j;
    if (j >= columns) {
      for (int64_t p = 0; p < pairs; ++p) dst[p * kColumns] = 0;
      continue;
    }
    const Bf16* column = b + j * stride_n;
    if (stride_k == 1) {
      for (int64_t p = 0; p < whole; ++p) std::memcpy(dst + p * kColumns, column + 2 * p, sizeof(uint32_t));
    } else {
      for (int64_t p = 0; p < whole; ++p) dst[p * kColumns] = pair(column[2 * p * stride_k], column[(2 * p + 1) * stride_k]);
    }
    if (K % 2) dst[whole * kColumns] = pair(column[(K - 1) * stride_k], 0);
  }
}

// What is done with alpha * a @ b in a tile before it is stored.
struct Epilogue {
  float alpha;
  const float* bias;          // [rows, columns] at bias_stride, or null
  int64_t bias_stride;
  const float* masked;        // where the bias is *masked: the result is *masked (or 0 with exp), or null
  const float* row_offset;    // exp(clamp(x - row_offset[r], -87, 0)) of the result x, or null
  const float* probabilities;  // with row_offset: probabilities[r, j] * (x - row_offset[r]) instead (dS)
  int64_t probabilities_stride;
};

template <typename Out>
inline void store(Out* row, __mmask16 valid, __m512 v) {
  if constexpr (std::is_same_v<Out, float>) {
    _mm512_mask_storeu_ps(row, valid, v);
  } else {
    const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16_high(v), 16));
    _mm256_mask_storeu_epi16(row, valid, half);
  }
}

inline __mmask16 column_mask(int64_t columns, int64_t half) {
  const int64_t valid = std::clamp<int64_t>(columns - 16 * half, 0, 16);
  return valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
}

// A tile of the result that the epilogue makes known without the matmul, stored: the probabilities 0
// throughout (past the causal band: dS is 0), or the bias the masked score throughout. Returns whether
// it was.
template <typename Out>
bool store_known_tile(const Epilogue& e, Out* out, int64_t out_stride, int64_t rows, int64_t columns) {
  const __mmask16 mask0 = column_mask(columns, 0), mask1 = column_mask(columns, 1);
  const __m512 masked_value = _mm512_set1_ps(e.masked ? *e.masked : 0.0f);
  const __m512 zero = _mm512_setzero_ps();
  bool known = false;
  __m512 value = zero;
  if (e.probabilities) {
    known = true;
    for (int64_t r = 0; r < rows && known; ++r) {
      const float* p_row = e.probabilities + r * e.probabilities_stride;
      known = _mm512_mask_cmpneq_ps_mask(mask0, _mm512_maskz_loadu_ps(mask0, p_row), zero) == 0 &&
              _mm512_mask_cmpneq_ps_mask(mask1, _mm512_maskz_loadu_ps(mask1, p_row + 16), zero) == 0;
    }
  }
  if (!known && e.masked) {
    known = true;
    for (int64_t r = 0; r < rows && known; ++r) {
      const float* bias_row = e.bias + r * e.bias_stride;
      known = _mm512_mask_cmpneq_ps_mask(mask0, _mm512_maskz_loadu_ps(mask0, bias_row), masked_value) == 0 &&
              _mm512_mask_cmpneq_ps_mask(mask1, _mm512_maskz_loadu_ps(mask1, bias_row + 16), masked_value) == 0;
    }
    value = e.row_offset ? zero : masked_value;
  }
  if (known) {
    for (int64_t r = 0; r < rows; ++r) {
      store(out + r * out_stride, mask0, value);
      store(out + r * out_stride + 16, mask1, value);
    }
  }
  return known;
}

// Row r of a tile, its 16 columns from 16 * half: the sum of products scaled, then the epilogue, stored.
template <typename Out>
inline void store_sums(const Epilogue& e, int64_t r, int64_t half, __m512 sum, __mmask16 valid, Out* out_row) {
  const __m512 masked_value = _mm512_set1_ps(e.masked ? *e.masked : 0.0f);
  __m512 v = _mm512_mul_ps(sum, _mm512_set1_ps(e.alpha));
  __mmask16 masked = 0;
  if (e.bias) {
    const __m512 bias = _mm512_maskz_loadu_ps(valid, e.bias + r * e.bias_stride + 16 * half);
    v = _mm512_add_ps(v, bias);
    if (e.masked) masked = _mm512_cmpeq_ps_mask(bias, masked_value);
  }
  if (e.probabilities) {
    v = _mm512_sub_ps(v, _mm512_set1_ps(e.row_offset[r]));
    v = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, e.probabilities + r * e.probabilities_stride + 16 * half), v);
  } else if (e.row_offset) {
    v = _mm512_sub_ps(v, _mm512_set1_ps(e.row_offset[r]));
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(kExpFloor)), _mm512_setzero_ps());
    v = Sleef_expf16_u10(v);
  }
  const __m512 masked_result = e.row_offset ? _mm512_setzero_ps() : masked_value;
  store(out_row + 16 * half, valid, _mm512_mask_mov_ps(v, masked, masked_result));
}

// One tile of the result: alpha * a @ b over pairs [first, last) for its valid rows and columns, then the
// epilogue.
template <typename Out>
void tile(const uint32_t* a, const uint32_t* b, int64_t first, int64_t last, const Epilogue& e, Out* out,
          int64_t out_stride, int64_t rows, int64_t columns) {
  if (store_known_tile(e, out, out_stride, rows, columns)) return;
  __m512 acc[kRows][2];
  for (int64_t r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = first; p < last; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * kColumns);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * kColumns + 16);
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[p * kRows + r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t half = 0; half < 2; ++half) {
      store_sums(e, r, half, acc[r][half], column_mask(columns, half), out + r * out_stride);
    }
  }
}

template <typename In, typename Out>
void run(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, std::optional<double> masked,
         const at::Tensor& row_offset, const at::Tensor& probabilities, const at::Tensor& out, double alpha) {
  const int64_t batches = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  if (batches == 0 || M == 0 || N == 0) return;
  const int64_t pairs = (K + 1) / 2;
  const In* a_data = reinterpret_cast<const In*>(a.const_data_ptr());
  const Bf16* b_data = reinterpret_cast<const Bf16*>(b.const_data_ptr());
  Out* out_data = reinterpret_cast<Out*>(out.mutable_data_ptr());
  const float* bias_data = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  // bias: [1 or batches, M, N], contiguous in N; row_offset: [batches, M] contiguous
  const int64_t bias_batch_stride = bias.defined() && bias.size(0) > 1 ? bias.stride(0) : 0;
  const int64_t bias_row_stride = bias.defined() ? bias.stride(1) : 0;
  const float* offset_data = row_offset.defined() ? row_offset.const_data_ptr<float>() : nullptr;
  // probabilities: [batches, M, N], contiguous
  const float* probabilities_data = probabilities.defined() ? probabilities.const_data_ptr<float>() : nullptr;
  const float masked_value = masked ? static_cast<float>(*masked) : 0.0f;

  // Tasks: (batch, block of columns, block of rows); rows split further only when batches and column
  // blocks leave a thread idle (each task packs its columns of b once).
  const int64_t column_block = std::min(kMaxColumnBlock, (N + kColumns - 1) / kColumns * kColumns);
  const int64_t column_blocks = (N + column_block - 1) / column_block;
  const int64_t row_tiles = (M + kRows - 1) / kRows;
  const int64_t outer = batches * column_blocks;
  const int64_t row_blocks = std::min(row_tiles, std::max<int64_t>(1, (2 * at::get_num_threads() + outer - 1) / outer));
  const int64_t tiles_per_row_block = (row_tiles + row_blocks - 1) / row_blocks;

  at::parallel_for(0, outer * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> b_packed(static_cast<size_t>(column_block * pairs));
    std::vector<uint32_t> a_packed(static_cast<size_t>(kRows * pairs));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t batch = task / (column_blocks * row_blocks);
      const int64_t column_index = task / row_blocks % column_blocks, row_index = task % row_blocks;
      const int64_t n_begin = column_index * column_block, n_end = std::min(N, n_begin + column_block);
      const int64_t m_begin = row_index * tiles_per_row_block * kRows;
      const int64_t m_end = std::min(M, m_begin + tiles_per_row_block * kRows);
      if (m_begin >= m_end) continue;
      const In* a_batch = a_data + batch * a.stride(0);
      const Bf16* b_batch = b_data + batch * b.stride(0);
      for (int64_t n0 = n_begin; n0 < n_end; n0 += kColumns) {
        pack_columns(b_batch + n0 * b.stride(2), b.stride(1), b.stride(2), std::min(kColumns, n_end - n0), K,
                     b_packed.data() + (n0 - n_begin) * pairs);
      }
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kRows) {
        const int64_t rows = std::min(kRows, m_end - m0);
        const auto [first, last] = pack_rows(Matrix<In>{a_batch + m0 * a.stride(1), a.stride(1), a.stride(2)}, rows,
                                             K, a_packed.data());
        for (int64_t n0 = n_begin; n0 < n_end; n0 += kColumns) {
          const float* bias_tile = bias_data ? bias_data + batch * bias_batch_stride + m0 * bias_row_stride + n0
                                             : nullptr;
          const Epilogue epilogue{static_cast<float>(alpha), bias_tile, bias_row_stride,
                                  bias_data && masked ? &masked_value : nullptr,
                                  offset_data ? offset_data + batch * M + m0 : nullptr,
                                  probabilities_data ? probabilities_data + (batch * M + m0) * N + n0 : nullptr, N};
          tile(a_packed.data(), b_packed.data() + (n0 - n_begin) * pairs, first, last, epilogue,
               out_data + (batch * M + m0) * N + n0, N, rows, std::min(kColumns, n_end - n0));
        }
      }
    }
  });
}

// ---- on AMX: the tiles' products by oneDNN's brgemm (at::native::cpublas), the epilogue as above ----

constexpr int64_t kAmxRows = 32;  // rows of the result per brgemm call (two AMX tiles of 16 rows)

// rows of a as bf16 [rows][ld] (ld = K rounded up to even, the odd k past K zero). Returns the range of
// pairs [first, last) outside which every row's pairs are zero. nonzero: scratch of (K + 1) / 2 values.
template <typename T>
std::pair<int64_t, int64_t> pack_rows_plain(Matrix<T> a, int64_t rows, int64_t K, Bf16* out, int64_t ld,
                                            uint32_t* nonzero) {
  if constexpr (std::is_same_v<T, float>) {
    if (a.stride_m == 1 && a.stride_k != 1) {  // a transposed: the rows' values of one k are adjacent
      // 16 rows x 16 k at a time: the 8 pairs (k, k + 1) of 16 rows, transposed in registers to 8 pairs per
      // row and stored 4 pairs (16 bytes) at a time (a scatter per pair cost 2x a row-major a's packing)
      const int64_t row_pairs = ld / 2;
      alignas(64) uint32_t pairs_by_row[8][16];
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t block_rows = std::min<int64_t>(16, rows - r0);
        const __mmask16 valid = block_rows == 16 ? __mmask16(0xFFFF) : __mmask16((1u << block_rows) - 1);
        auto* rows_out = reinterpret_cast<uint32_t*>(out + r0 * ld);
        for (int64_t k0 = 0; k0 < K; k0 += 16) {
          __m512i both[8];
          for (int64_t i = 0; i < 8; ++i) {
            const int64_t k = k0 + 2 * i;
            const __m512i even = k < K ? round_to_bf16_high(_mm512_maskz_loadu_ps(valid, a.data + k * a.stride_k + r0))
                                       : _mm512_setzero_si512();
            const __m512i odd = k + 1 < K ? round_to_bf16_high(_mm512_maskz_loadu_ps(valid, a.data + (k + 1) * a.stride_k + r0))
                                          : _mm512_setzero_si512();
            both[i] = _mm512_or_si512(_mm512_srli_epi32(even, 16), odd);  // lane r: row r0 + r's pair k / 2
          }
          // per 128-bit lane L (rows 4L..4L+3): t = pairs (0,1), (2,3) ... interleaved, then u[m] (u[4 + m]) holds
          // row 4L + m's pairs 0-3 (4-7) in lane L
          __m512i t[8], u[8];
          for (int64_t i = 0; i < 4; ++i) {
            t[2 * i] = _mm512_unpacklo_epi32(both[2 * i], both[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(both[2 * i], both[2 * i + 1]);
          }
          for (int64_t half = 0; half < 2; ++half) {
            const __m512i* th = t + 4 * half;
            u[4 * half + 0] = _mm512_unpacklo_epi64(th[0], th[2]);
            u[4 * half + 1] = _mm512_unpackhi_epi64(th[0], th[2]);
            u[4 * half + 2] = _mm512_unpacklo_epi64(th[1], th[3]);
            u[4 * half + 3] = _mm512_unpackhi_epi64(th[1], th[3]);
          }
          for (int64_t i = 0; i < 8; ++i) _mm512_store_si512(pairs_by_row[i], u[i]);
          const int64_t first_pair = k0 / 2, pairs = std::min<int64_t>(8, row_pairs - first_pair);
          for (int64_t r = 0; r < block_rows; ++r) {
            const int64_t lane = r / 4, m = r % 4;
            uint32_t* row_out = rows_out + r * row_pairs + first_pair;
            if (pairs == 8) {  // fixed sizes: two 16-byte moves, not memcpy calls
              _mm_storeu_si128(reinterpret_cast<__m128i*>(row_out),
                               _mm_load_si128(reinterpret_cast<const __m128i*>(&pairs_by_row[m][4 * lane])));
              _mm_storeu_si128(reinterpret_cast<__m128i*>(row_out + 4),
                               _mm_load_si128(reinterpret_cast<const __m128i*>(&pairs_by_row[4 + m][4 * lane])));
              continue;
            }
            std::memcpy(row_out, &pairs_by_row[m][4 * lane], sizeof(uint32_t) * std::min<int64_t>(4, pairs));
            if (pairs > 4) std::memcpy(row_out + 4, &pairs_by_row[4 + m][4 * lane], sizeof(uint32_t) * (pairs - 4));
          }
        }
      }
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = a.data + r * a.stride_m;
        Bf16* row_out = out + r * ld;
        if (a.stride_k == 1) {
          for (int64_t k = 0; k < K; k += 16) {
            const __mmask16 valid = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
            const __m512 v = _mm512_maskz_loadu_ps(valid, row + k);
            _mm256_mask_storeu_epi16(row_out + k, valid,
                                     _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16_high(v), 16)));
          }
        } else {
          for (int64_t k = 0; k < K; ++k) row_out[k] = round_to_bf16(row[k * a.stride_k]);
        }
      }
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      const Bf16* row = a.data + r * a.stride_m;
      Bf16* row_out = out + r * ld;
      if (a.stride_k == 1) {
        std::memcpy(row_out, row, K * sizeof(Bf16));
      } else {
        for (int64_t k = 0; k < K; ++k) row_out[k] = row[k * a.stride_k];
      }
    }
  }
  const int64_t pairs = ld / 2;
  std::fill(nonzero, nonzero + pairs, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    if (K % 2) out[r * ld + K] = 0;
    const Bf16* row_out = out + r * ld;
    for (int64_t p = 0; p < pairs; ++p) {
      uint32_t both;
      std::memcpy(&both, row_out + 2 * p, sizeof both);
      nonzero[p] |= both & 0x7FFF7FFFu;  // +0 and -0 alike
    }
  }
  int64_t first = 0, last = pairs;
  while (first < last && !nonzero[first]) ++first;
  while (last > first && !nonzero[last - 1]) --last;
  return {first, last};
}

template <typename In, typename Out>
void run_on_amx(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, std::optional<double> masked,
                const at::Tensor& row_offset, const at::Tensor& probabilities, const at::Tensor& out, double alpha) {
  const int64_t batches = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  if (batches == 0 || M == 0 || N == 0) return;
  const int64_t pairs = (K + 1) / 2, ld = 2 * pairs;
  const In* a_data = reinterpret_cast<const In*>(a.const_data_ptr());
  const Bf16* b_data = reinterpret_cast<const Bf16*>(b.const_data_ptr());
  Out* out_data = reinterpret_cast<Out*>(out.mutable_data_ptr());
  const float* bias_data = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  const int64_t bias_batch_stride = bias.defined() && bias.size(0) > 1 ? bias.stride(0) : 0;
  const int64_t bias_row_stride = bias.defined() ? bias.stride(1) : 0;
  const float* offset_data = row_offset.defined() ? row_offset.const_data_ptr<float>() : nullptr;
  const float* probabilities_data = probabilities.defined() ? probabilities.const_data_ptr<float>() : nullptr;
  const float masked_value = masked ? static_cast<float>(*masked) : 0.0f;

  // The tasks as in run, with kAmxRows rows per tile
  const int64_t column_block = std::min(kMaxColumnBlock, (N + kColumns - 1) / kColumns * kColumns);
  const int64_t column_blocks = (N + column_block - 1) / column_block;
  const int64_t row_tiles = (M + kAmxRows - 1) / kAmxRows;
  const int64_t outer = batches * column_blocks;
  const int64_t row_blocks = std::min(row_tiles, std::max<int64_t>(1, (2 * at::get_num_threads() + outer - 1) / outer));
  const int64_t tiles_per_row_block = (row_tiles + row_blocks - 1) / row_blocks;

  at::parallel_for(0, outer * row_blocks, 1, [&](int64_t begin, int64_t end) {
    // b's columns as pack_columns lays them out: [pairs][kColumns] pairs, brgemm's VNNI layout (ld_b kColumns)
    std::vector<uint32_t> b_packed(static_cast<size_t>(column_block * pairs));
    std::vector<Bf16> a_rows(static_cast<size_t>(kAmxRows * ld));
    std::vector<uint32_t> nonzero(static_cast<size_t>(pairs));
    alignas(64) float sums[kAmxRows * kColumns];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t batch = task / (column_blocks * row_blocks);
      const int64_t column_index = task / row_blocks % column_blocks, row_index = task % row_blocks;
      const int64_t n_begin = column_index * column_block, n_end = std::min(N, n_begin + column_block);
      const int64_t m_begin = row_index * tiles_per_row_block * kAmxRows;
      const int64_t m_end = std::min(M, m_begin + tiles_per_row_block * kAmxRows);
      if (m_begin >= m_end) continue;
      const In* a_batch = a_data + batch * a.stride(0);
      const Bf16* b_batch = b_data + batch * b.stride(0);
      for (int64_t n0 = n_begin; n0 < n_end; n0 += kColumns) {
        pack_columns(b_batch + n0 * b.stride(2), b.stride(1), b.stride(2), std::min(kColumns, n_end - n0), K,
                     b_packed.data() + (n0 - n_begin) * pairs);
      }
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kAmxRows) {
        const int64_t rows = std::min(kAmxRows, m_end - m0);
        const auto [first, last] = pack_rows_plain(Matrix<In>{a_batch + m0 * a.stride(1), a.stride(1), a.stride(2)},
                                                   rows, K, a_rows.data(), ld, nonzero.data());
        for (int64_t n0 = n_begin; n0 < n_end; n0 += kColumns) {
          const int64_t columns = std::min(kColumns, n_end - n0);
          const float* bias_tile = bias_data ? bias_data + batch * bias_batch_stride + m0 * bias_row_stride + n0
                                             : nullptr;
          const Epilogue epilogue{static_cast<float>(alpha), bias_tile, bias_row_stride,
                                  bias_data && masked ? &masked_value : nullptr,
                                  offset_data ? offset_data + batch * M + m0 : nullptr,
                                  probabilities_data ? probabilities_data + (batch * M + m0) * N + n0 : nullptr, N};
          Out* out_tile = out_data + (batch * M + m0) * N + n0;
          if (store_known_tile(epilogue, out_tile, N, rows, columns)) continue;
          if (first < last) {
            // the pairs [first, last) only: a's zeros past the causal band are not multiplied
            at::native::cpublas::brgemm(rows, kColumns, 2 * (last - first), ld, kColumns, kColumns, false,
                                        reinterpret_cast<const c10::BFloat16*>(a_rows.data() + 2 * first),
                                        reinterpret_cast<const c10::BFloat16*>(
                                            b_packed.data() + (n0 - n_begin) * pairs + first * kColumns),
                                        sums, true);
          } else {
            std::fill(sums, sums + rows * kColumns, 0.0f);
          }
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t half = 0; half < 2; ++half) {
              store_sums(epilogue, r, half, _mm512_load_ps(sums + r * kColumns + 16 * half),
                         column_mask(columns, half), out_tile + r * N);
            }
          }
        }
      }
    }
    // brgemm keeps its AMX tile configuration per thread: released, as other oneDNN kernels set their own
    at::native::cpublas::brgemm_release(true);
  });
}

// ---- npu_fusion_attention's bf16 forward and backward, one kernel each, on AMX ----
//
// Per batch and block of kAmxRows query rows, the block's scores over the keys it sees (the 32-key tiles
// between its first and last unmasked one) are computed by brgemm into a local fp32 buffer, and the softmax,
// its rounding and the following matmuls work on that buffer: no [M, N] tensor of scores, probabilities or
// dS is written (bf16_matmul's calls write and read each several times, ~4 MB a head batch, and their
// per-32-column brgemm calls cost more than their products). The numerics are bf16_matmul's: exact products
// summed in fp32; the epilogues, the floor at exp(-87) and the roundings to bf16 are the same expressions.
// dK and dV sum over the query blocks in fp32 (another order of the same sums), rounded once at the end.

constexpr int64_t kKeyTile = 32;  // keys per tile of the visible range (as bf16_matmul's column tiles)

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

inline const c10::BFloat16* as_bf16(const void* p) { return reinterpret_cast<const c10::BFloat16*>(p); }

inline __mmask16 lanes_below(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(count, 0)) - 1);
}

// rows of b [N, K] (bf16, K even, contiguous in K) as brgemm's VNNI operand of x @ b^T: [K / 2][ld] pairs,
// pair (p, n) = (b[n][2p], b[n][2p + 1]); columns past N zero
void pack_transposed(const Bf16* b, int64_t row_stride, int64_t N, int64_t K, int64_t ld, uint32_t* out) {
  const int64_t pairs = K / 2;
  std::fill(out, out + pairs * ld, 0u);
  for (int64_t n = 0; n < N; ++n) {
    const Bf16* row = b + n * row_stride;
    for (int64_t p = 0; p < pairs; ++p) std::memcpy(out + p * ld + n, row + 2 * p, sizeof(uint32_t));
  }
}

// b [N, X] (bf16, contiguous in X) as brgemm's VNNI operand of y @ b: [pairs][ld] pairs,
// pair (p, x) = (b[2p][x], b[2p + 1][x]); rows past N and columns past X zero
void pack_row_pairs(const Bf16* b, int64_t row_stride, int64_t N, int64_t X, int64_t ld, int64_t pairs,
                    uint32_t* out) {
  std::fill(out, out + pairs * ld, 0u);
  for (int64_t p = 0; 2 * p < N; ++p) {
    const Bf16* even = b + 2 * p * row_stride;
    const Bf16* odd = 2 * p + 1 < N ? even + row_stride : nullptr;
    for (int64_t x = 0; x < X; ++x) out[p * ld + x] = pair(even[x], odd ? odd[x] : Bf16(0));
  }
}

// The keys [first, last) a block of rows sees: from the first to the last 32-key tile whose bias is not the
// masked score throughout (as store_known_tile skips them), everything without a masking bias. A block that
// sees nothing is computed over every key (its rows' softmax is the masked scores', as unblocked).
std::pair<int64_t, int64_t> visible_keys(const float* bias, int64_t bias_stride, const float* masked, int64_t rows,
                                         int64_t N) {
  if (!bias || !masked) return {0, N};
  const __m512 masked_value = _mm512_set1_ps(*masked);
  int64_t first = N, last = 0;
  for (int64_t n0 = 0; n0 < N; n0 += kKeyTile) {
    bool seen = false;
    for (int64_t r = 0; r < rows && !seen; ++r) {
      for (int64_t j = n0; j < std::min(N, n0 + kKeyTile) && !seen; j += 16) {
        const __mmask16 valid = lanes_below(N - j);
        seen = _mm512_mask_cmpneq_ps_mask(valid, _mm512_maskz_loadu_ps(valid, bias + r * bias_stride + j),
                                          masked_value) != 0;
      }
    }
    if (seen) {
      first = std::min(first, n0);
      last = std::min(N, n0 + kKeyTile);
    }
  }
  return first < last ? std::make_pair(first, last) : std::make_pair(int64_t(0), N);
}

// Row r of a block's scores [first, last): alpha * sums + bias, the masked score where the bias is it (as
// store_sums), in place
inline void score_row(float* s, const float* bias_row, const float* masked, float alpha, int64_t first,
                      int64_t last) {
  const __m512 masked_value = _mm512_set1_ps(masked ? *masked : 0.0f);
  for (int64_t j = first; j < last; j += 16) {
    const __mmask16 valid = lanes_below(last - j);
    __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, s + j), _mm512_set1_ps(alpha));
    if (bias_row) {
      const __m512 b = _mm512_maskz_loadu_ps(valid, bias_row + j);
      x = _mm512_add_ps(x, b);
      if (masked) x = _mm512_mask_mov_ps(x, _mm512_cmpeq_ps_mask(b, masked_value), masked_value);
    }
    _mm512_mask_storeu_ps(s + j, valid, x);
  }
}

// rows [rows, X] of bf16 values (row stride row_stride) as [X][kAmxRows], the rows past `rows` zero
void transpose_rows(const Bf16* x, int64_t row_stride, int64_t rows, int64_t X, Bf16* out) {
  std::fill(out, out + X * kAmxRows, Bf16(0));
  for (int64_t r = 0; r < rows; ++r) {
    const Bf16* row = x + r * row_stride;
    for (int64_t j = 0; j < X; ++j) out[j * kAmxRows + r] = row[j];
  }
}

// Row r's softmax over the keys [first, last) of its scores s (those outside it: the masked score, there
// exp(S - max) is 0): the max, exp(s - max) with 0 below exp(-87), and its sum, as exp_rows computes them (16
// keys at a time from key 0, the last N % 16 one by one, the lanes summed as ATen's AVX512 vec_reduce_all:
// halves, quarters ...); each exp(s - max) is handed to store_vector(j, 16 values) or store_one(j, value).
template <typename StoreVector, typename StoreOne>
std::pair<float, float> softmax_row(const float* s, int64_t first, int64_t last, int64_t N, float masked_value,
                                    StoreVector store_vector, StoreOne store_one) {
  __m512 largest = _mm512_set1_ps(first > 0 || last < N ? masked_value : -INFINITY);
  for (int64_t j = first; j < last; j += 16) {
    const __mmask16 valid = lanes_below(last - j);
    largest = _mm512_mask_max_ps(largest, valid, largest, _mm512_maskz_loadu_ps(valid, s + j));
  }
  const float row_largest = _mm512_reduce_max_ps(largest);
  const __m512 largest_vec = _mm512_set1_ps(row_largest), floor = _mm512_set1_ps(kExpFloor);
  __m512 total = _mm512_setzero_ps();
  const int64_t vector_end = last == N ? first + (last - first) / 16 * 16 : last;
  for (int64_t j = first; j < vector_end; j += 16) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + j), largest_vec);
    __m512 e = Sleef_expf16_u10(_mm512_max_ps(x, floor));
    e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ), _mm512_setzero_ps());
    total = _mm512_add_ps(total, e);
    store_vector(j, e);
  }
  float row_total = _mm512_reduce_add_ps(total);
  for (int64_t j = vector_end; j < last; ++j) {
    const float x = s[j] - row_largest;
    const float e = x < kExpFloor ? 0.0f : std::exp(x);
    row_total += e;
    store_one(j, e);
  }
  return {row_largest, row_total};
}

inline __m512i bf16_pairs(__m512 even, __m512 odd) {  // lane i: (even[i], odd[i]) rounded to bf16
  return _mm512_or_si512(_mm512_srli_epi32(round_to_bf16_high(even), 16), round_to_bf16_high(odd));
}

template <typename T>
inline const T* row_pointer(const at::Tensor& t, int64_t batch, int64_t row) {
  return reinterpret_cast<const T*>(t.const_data_ptr()) + batch * t.stride(0) + row * t.stride(1);
}

}  // namespace

void attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                       std::optional<double> masked, double scale, const at::Tensor& out, const at::Tensor& row_max,
                       const at::Tensor& row_sum) {
  const int64_t batches = q.size(0), M = q.size(1), D = q.size(2), N = k.size(1), Dv = v.size(2);
  if (batches == 0 || M == 0) return;
  const int64_t ld_keys = round_up(std::max<int64_t>(N, 1), kKeyTile), ld_v = round_up(Dv, 32);
  const float* bias_data = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  const int64_t bias_batch_stride = bias.defined() && bias.size(0) > 1 ? bias.stride(0) : 0;
  const int64_t bias_row_stride = bias.defined() ? bias.stride(1) : 0;
  const float masked_value = masked ? static_cast<float>(*masked) : 0.0f;
  const float* masked_ptr = bias_data && masked ? &masked_value : nullptr;
  float* out_data = out.mutable_data_ptr<float>();
  float* max_data = row_max.mutable_data_ptr<float>();
  float* sum_data = row_sum.mutable_data_ptr<float>();

  at::parallel_for(0, batches, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> k_pairs(static_cast<size_t>(D / 2 * ld_keys));
    std::vector<uint32_t> v_pairs(static_cast<size_t>(ld_keys / 2 * ld_v));
    std::vector<float> scores(static_cast<size_t>(kAmxRows * ld_keys));
    std::vector<Bf16> p(static_cast<size_t>(kAmxRows * ld_keys));
    std::vector<float> sums(static_cast<size_t>(kAmxRows * ld_v));
    for (int64_t batch = begin; batch < end; ++batch) {
      pack_transposed(row_pointer<Bf16>(k, batch, 0), k.stride(1), N, D, ld_keys, k_pairs.data());
      pack_row_pairs(row_pointer<Bf16>(v, batch, 0), v.stride(1), N, Dv, ld_v, ld_keys / 2, v_pairs.data());
      for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
        const int64_t rows = std::min(kAmxRows, M - m0);
        const float* bias_block = bias_data ? bias_data + batch * bias_batch_stride + m0 * bias_row_stride : nullptr;
        const auto [first, last] = visible_keys(bias_block, bias_row_stride, masked_ptr, rows, N);
        const int64_t last_even = std::min(round_up(last, 2), ld_keys);
        at::native::cpublas::brgemm(rows, last - first, D, q.stride(1), ld_keys, ld_keys, false,
                                    as_bf16(row_pointer<Bf16>(q, batch, m0)), as_bf16(k_pairs.data() + first),
                                    scores.data() + first, true);
        for (int64_t r = 0; r < rows; ++r) {
          float* s = scores.data() + r * ld_keys;
          score_row(s, bias_block ? bias_block + r * bias_row_stride : nullptr, masked_ptr, static_cast<float>(scale),
                    first, last);
          Bf16* p_row = p.data() + r * ld_keys;  // exp(S - max) rounded to bf16 for P @ V
          const auto [row_largest, row_total] = softmax_row(
              s, first, last, N, masked_value,
              [&](int64_t j, __m512 e) {
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_row + j),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16_high(e), 16)));
              },
              [&](int64_t j, float e) { p_row[j] = round_to_bf16(e); });
          if (last_even > last) p_row[last] = 0;
          max_data[batch * M + m0 + r] = row_largest;
          sum_data[batch * M + m0 + r] = row_total;
        }
        at::native::cpublas::brgemm(rows, ld_v, last_even - first, ld_keys, ld_v, ld_v, false, as_bf16(p.data() + first),
                                    as_bf16(v_pairs.data() + first / 2 * ld_v), sums.data(), true);
        for (int64_t r = 0; r < rows; ++r) {  // the fp32 sums of exp(S - max) @ V divided by the row's sum
          const __m512 total = _mm512_set1_ps(sum_data[batch * M + m0 + r]);
          float* out_row = out_data + (batch * M + m0 + r) * Dv;
          for (int64_t j = 0; j < Dv; j += 16) {
            const __mmask16 valid = lanes_below(Dv - j);
            _mm512_mask_storeu_ps(out_row + j, valid, _mm512_div_ps(_mm512_loadu_ps(sums.data() + r * ld_v + j), total));
          }
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

void attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dy,
                        const at::Tensor& bias, std::optional<double> masked, const at::Tensor& log_sum_exp,
                        const at::Tensor& row_dot, double scale, const at::Tensor& dq, const at::Tensor& dk,
                        const at::Tensor& dv) {
  const int64_t batches = q.size(0), M = q.size(1), D = q.size(2), N = k.size(1), Dv = v.size(2);
  if (batches == 0 || N == 0) return;
  const int64_t ld_keys = round_up(N, kKeyTile), ld_d = round_up(D, 32);
  const int64_t pair_rows = kAmxRows / 2;
  const float* bias_data = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  const int64_t bias_batch_stride = bias.defined() && bias.size(0) > 1 ? bias.stride(0) : 0;
  const int64_t bias_row_stride = bias.defined() ? bias.stride(1) : 0;
  const float masked_value = masked ? static_cast<float>(*masked) : 0.0f;
  const float* masked_ptr = bias_data && masked ? &masked_value : nullptr;
  const float* lse_data = log_sum_exp.const_data_ptr<float>();
  const float* dot_data = row_dot.const_data_ptr<float>();
  Bf16* dq_data = reinterpret_cast<Bf16*>(dq.mutable_data_ptr());
  Bf16* dk_data = reinterpret_cast<Bf16*>(dk.mutable_data_ptr());
  Bf16* dv_data = reinterpret_cast<Bf16*>(dv.mutable_data_ptr());
  const __m512 floor = _mm512_set1_ps(kExpFloor), zero = _mm512_setzero_ps();
  const int64_t q_row_stride = q.stride(1), dy_row_stride = dy.stride(1);

  at::parallel_for(0, batches, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> k_t(static_cast<size_t>(D / 2 * ld_keys));   // S = Q K^T
    std::vector<uint32_t> v_t(static_cast<size_t>(Dv / 2 * ld_keys));  // dP = dY V^T
    std::vector<uint32_t> k_pairs(static_cast<size_t>(ld_keys / 2 * ld_d));  // dQ = dS K
    std::vector<float> p(static_cast<size_t>(kAmxRows * ld_keys)), ds(static_cast<size_t>(kAmxRows * ld_keys));
    std::vector<Bf16> ds_rows(static_cast<size_t>(kAmxRows * ld_keys));
    // P and dS with the block's rows paired (VNNI): dV^T += dY^T P, dK^T += Q^T dS
    std::vector<uint32_t> p_pairs(static_cast<size_t>(pair_rows * ld_keys)), ds_pairs(p_pairs.size());
    std::vector<Bf16> dy_t(static_cast<size_t>(Dv * kAmxRows)), q_t(static_cast<size_t>(D * kAmxRows));
    std::vector<float> dv_t(static_cast<size_t>(Dv * ld_keys)), dk_t(static_cast<size_t>(D * ld_keys));
    std::vector<float> dq_sums(static_cast<size_t>(kAmxRows * ld_d));
    for (int64_t batch = begin; batch < end; ++batch) {
      pack_transposed(row_pointer<Bf16>(k, batch, 0), k.stride(1), N, D, ld_keys, k_t.data());
      pack_transposed(row_pointer<Bf16>(v, batch, 0), v.stride(1), N, Dv, ld_keys, v_t.data());
      pack_row_pairs(row_pointer<Bf16>(k, batch, 0), k.stride(1), N, D, ld_d, ld_keys / 2, k_pairs.data());
      std::fill(dv_t.begin(), dv_t.end(), 0.0f);
      std::fill(dk_t.begin(), dk_t.end(), 0.0f);
      for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
        const int64_t rows = std::min(kAmxRows, M - m0);
        const float* bias_block = bias_data ? bias_data + batch * bias_batch_stride + m0 * bias_row_stride : nullptr;
        const auto [first, last] = visible_keys(bias_block, bias_row_stride, masked_ptr, rows, N);
        const int64_t last_even = std::min(round_up(last, 2), ld_keys);
        const Bf16* q_block = row_pointer<Bf16>(q, batch, m0);
        const Bf16* dy_block = row_pointer<Bf16>(dy, batch, m0);
        at::native::cpublas::brgemm(rows, last - first, D, q.stride(1), ld_keys, ld_keys, false, as_bf16(q_block),
                                    as_bf16(k_t.data() + first), p.data() + first, true);
        at::native::cpublas::brgemm(rows, last - first, Dv, dy.stride(1), ld_keys, ld_keys, false, as_bf16(dy_block),
                                    as_bf16(v_t.data() + first), ds.data() + first, true);
        for (int64_t r = 0; r < rows; ++r) {
          // P = exp(clamp(S - lse, -87, 0)), 0 where masked; dS = P * (dP - rowsum(dO * O)), as bf16_matmul's epilogues
          float* p_row = p.data() + r * ld_keys;
          float* ds_row = ds.data() + r * ld_keys;
          const float* bias_row = bias_block ? bias_block + r * bias_row_stride : nullptr;
          const __m512 lse = _mm512_set1_ps(lse_data[batch * M + m0 + r]);
          const __m512 dot = _mm512_set1_ps(dot_data[batch * M + m0 + r]);
          const __m512 masked_vec = _mm512_set1_ps(masked_value);
          Bf16* ds_out = ds_rows.data() + r * ld_keys;
          for (int64_t j = first; j < last; j += 16) {
            const __mmask16 valid = lanes_below(last - j);
            __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, p_row + j), _mm512_set1_ps(static_cast<float>(scale)));
            __mmask16 hidden = 0;
            if (bias_row) {
              const __m512 b = _mm512_maskz_loadu_ps(valid, bias_row + j);
              x = _mm512_add_ps(x, b);
              if (masked_ptr) hidden = _mm512_cmpeq_ps_mask(b, masked_vec);
            }
            x = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(x, lse), floor), zero);
            const __m512 prob = _mm512_maskz_mov_ps(valid & ~hidden, Sleef_expf16_u10(x));
            const __m512 d = _mm512_mul_ps(prob, _mm512_sub_ps(_mm512_maskz_loadu_ps(valid, ds_row + j), dot));
            _mm512_mask_storeu_ps(p_row + j, valid, prob);
            _mm512_mask_storeu_ps(ds_row + j, valid, d);
            _mm256_mask_storeu_epi16(ds_out + j, valid, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16_high(d), 16)));
          }
          if (last_even > last) ds_out[last] = 0;
        }
        // the rows paired for dV and dK (rows past the block zero), dY and Q transposed
        for (int64_t i = 0; i < pair_rows; ++i) {
          const int64_t even = 2 * i, odd = 2 * i + 1;
          for (int64_t j = first; j < last; j += 16) {
            const __mmask16 valid = lanes_below(last - j);
            auto row = [&](const std::vector<float>& x, int64_t r) {
              return r < rows ? _mm512_maskz_loadu_ps(valid, x.data() + r * ld_keys + j) : zero;
            };
            _mm512_mask_storeu_epi32(p_pairs.data() + i * ld_keys + j, valid, bf16_pairs(row(p, even), row(p, odd)));
            _mm512_mask_storeu_epi32(ds_pairs.data() + i * ld_keys + j, valid, bf16_pairs(row(ds, even), row(ds, odd)));
          }
        }
        transpose_rows(dy_block, dy_row_stride, rows, Dv, dy_t.data());
        transpose_rows(q_block, q_row_stride, rows, D, q_t.data());
        // dQ = scale * dS @ K, rounded once
        at::native::cpublas::brgemm(rows, D, last_even - first, ld_keys, ld_d, ld_d, false, as_bf16(ds_rows.data() + first),
                                    as_bf16(k_pairs.data() + first / 2 * ld_d), dq_sums.data(), true);
        for (int64_t r = 0; r < rows; ++r) {
          Bf16* dq_row = dq_data + (batch * M + m0 + r) * D;
          for (int64_t j = 0; j < D; j += 16) {
            const __mmask16 valid = lanes_below(D - j);
            store(dq_row + j, valid, _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, dq_sums.data() + r * ld_d + j),
                                                   _mm512_set1_ps(static_cast<float>(scale))));
          }
        }
        at::native::cpublas::brgemm(Dv, last - first, kAmxRows, kAmxRows, ld_keys, ld_keys, true, as_bf16(dy_t.data()),
                                    as_bf16(p_pairs.data() + first), dv_t.data() + first, true);
        at::native::cpublas::brgemm(D, last - first, kAmxRows, kAmxRows, ld_keys, ld_keys, true, as_bf16(q_t.data()),
                                    as_bf16(ds_pairs.data() + first), dk_t.data() + first, true);
      }
      // dV = sum over blocks of P^T dY, dK = scale * sum of dS^T Q: rounded once
      for (int64_t n = 0; n < N; ++n) {
        Bf16* dv_row = dv_data + (batch * N + n) * Dv;
        Bf16* dk_row = dk_data + (batch * N + n) * D;
        for (int64_t x = 0; x < Dv; ++x) dv_row[x] = round_to_bf16(dv_t[x * ld_keys + n]);
        for (int64_t x = 0; x < D; ++x) dk_row[x] = round_to_bf16(static_cast<float>(scale) * dk_t[x * ld_keys + n]);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

// ---- the same two kernels for fp16: fp32 matmuls (brgemm) of the fp16 values, P and dS rounded to fp16 ----
//
// The fp16/fp32 path of fused/attention.py (_attend, _blocked_gradients) in one kernel each: fp16 products are
// exact in fp32, summed in fp32 (fp32 brgemm on fp32 copies, as the fp32 bmm of upcast copies there); the
// scores scale * q k^T + bias, exp(S - max) as exp_rows, P rounded to fp16 for P @ V and dV, the backward's P
// exp(clamp(S - lse, -87, 0)) with what is at most exp(-87) made 0 (its threshold), dS rounded to fp16 for
// dQ and dK (a value that rounds to inf or nan: saturated when `saturate`, reported), dQ, dK, dV in fp32.

namespace {

using Half = uint16_t;

inline __m512 load_half(const Half* x, __mmask16 valid) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, x));
}

inline __m512 round_to_half(__m512 x) {  // fp32 -> fp16 (to nearest even) -> fp32, as round_to_half
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// rows [rows, X] of fp16 values (row stride row_stride) as fp32 [rows][ld]
void widen_rows(const Half* x, int64_t row_stride, int64_t rows, int64_t X, int64_t ld, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < X; j += 16) {
      const __mmask16 valid = lanes_below(X - j);
      _mm512_mask_storeu_ps(out + r * ld + j, valid, load_half(x + r * row_stride + j, valid));
    }
  }
}

// rows [rows, X] of fp16 values as fp32 [X][ld] (transposed), columns past `rows` up to `columns` zero
void widen_transposed(const Half* x, int64_t row_stride, int64_t rows, int64_t X, int64_t ld, int64_t columns,
                      float* out) {
  for (int64_t j = 0; j < X; ++j) std::fill(out + j * ld + rows, out + j * ld + columns, 0.0f);
  alignas(64) float row[16];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < X; j += 16) {
      const __mmask16 valid = lanes_below(X - j);
      _mm512_store_ps(row, load_half(x + r * row_stride + j, valid));
      for (int64_t i = 0; i < std::min<int64_t>(16, X - j); ++i) out[(j + i) * ld + r] = row[i];
    }
  }
}

}  // namespace

void half_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                            std::optional<double> masked, double scale, const at::Tensor& out,
                            const at::Tensor& row_max, const at::Tensor& row_sum) {
  const int64_t batches = q.size(0), M = q.size(1), D = q.size(2), N = k.size(1), Dv = v.size(2);
  if (batches == 0 || M == 0) return;
  const int64_t ld_keys = round_up(std::max<int64_t>(N, 1), kKeyTile);
  const float* bias_data = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  const int64_t bias_batch_stride = bias.defined() && bias.size(0) > 1 ? bias.stride(0) : 0;
  const int64_t bias_row_stride = bias.defined() ? bias.stride(1) : 0;
  const float masked_value = masked ? static_cast<float>(*masked) : 0.0f;
  const float* masked_ptr = bias_data && masked ? &masked_value : nullptr;
  float* out_data = out.mutable_data_ptr<float>();
  float* max_data = row_max.mutable_data_ptr<float>();
  float* sum_data = row_sum.mutable_data_ptr<float>();
  const int64_t q_row_stride = q.stride(1), k_row_stride = k.stride(1), v_row_stride = v.stride(1);

  at::parallel_for(0, batches, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> k_t(static_cast<size_t>(D * ld_keys)), v_rows(static_cast<size_t>(std::max<int64_t>(N, 1) * Dv));
    std::vector<float> q_rows(static_cast<size_t>(kAmxRows * D)), scores(static_cast<size_t>(kAmxRows * ld_keys));
    std::vector<float> sums(static_cast<size_t>(kAmxRows * Dv));
    for (int64_t batch = begin; batch < end; ++batch) {
      widen_transposed(row_pointer<Half>(k, batch, 0), k_row_stride, N, D, ld_keys, ld_keys, k_t.data());
      widen_rows(row_pointer<Half>(v, batch, 0), v_row_stride, N, Dv, Dv, v_rows.data());
      for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
        const int64_t rows = std::min(kAmxRows, M - m0);
        const float* bias_block = bias_data ? bias_data + batch * bias_batch_stride + m0 * bias_row_stride : nullptr;
        const auto [first, last] = visible_keys(bias_block, bias_row_stride, masked_ptr, rows, N);
        widen_rows(row_pointer<Half>(q, batch, m0), q_row_stride, rows, D, D, q_rows.data());
        at::native::cpublas::brgemm(rows, last - first, D, D, ld_keys, ld_keys, false, q_rows.data(),
                                    k_t.data() + first, scores.data() + first, false);
        for (int64_t r = 0; r < rows; ++r) {
          float* s = scores.data() + r * ld_keys;
          score_row(s, bias_block ? bias_block + r * bias_row_stride : nullptr, masked_ptr, static_cast<float>(scale),
                    first, last);
          // exp(S - max) rounded to fp16 in place for P @ V
          const auto [row_largest, row_total] = softmax_row(
              s, first, last, N, masked_value, [&](int64_t j, __m512 e) { _mm512_storeu_ps(s + j, round_to_half(e)); },
              [&](int64_t j, float e) { s[j] = _cvtsh_ss(_cvtss_sh(e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); });
          max_data[batch * M + m0 + r] = row_largest;
          sum_data[batch * M + m0 + r] = row_total;
        }
        at::native::cpublas::brgemm(rows, Dv, last - first, ld_keys, Dv, Dv, false, scores.data() + first,
                                    v_rows.data() + first * Dv, sums.data(), false);
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 total = _mm512_set1_ps(sum_data[batch * M + m0 + r]);
          float* out_row = out_data + (batch * M + m0 + r) * Dv;
          for (int64_t j = 0; j < Dv; j += 16) {
            const __mmask16 valid = lanes_below(Dv - j);
            _mm512_mask_storeu_ps(out_row + j, valid, _mm512_div_ps(_mm512_maskz_loadu_ps(valid, sums.data() + r * Dv + j), total));
          }
        }
      }
    }
    at::native::cpublas::brgemm_release(false);
  });
}

bool half_attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dy,
                             const at::Tensor& bias, std::optional<double> masked, const at::Tensor& log_sum_exp,
                             const at::Tensor& row_dot, double scale, bool saturate, const at::Tensor& dq,
                             const at::Tensor& dk, const at::Tensor& dv) {
  const int64_t batches = q.size(0), M = q.size(1), D = q.size(2), N = k.size(1), Dv = v.size(2);
  if (batches == 0 || N == 0) return false;
  const int64_t ld_keys = round_up(N, kKeyTile);
  const float* bias_data = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  const int64_t bias_batch_stride = bias.defined() && bias.size(0) > 1 ? bias.stride(0) : 0;
  const int64_t bias_row_stride = bias.defined() ? bias.stride(1) : 0;
  const float masked_value = masked ? static_cast<float>(*masked) : 0.0f;
  const float* masked_ptr = bias_data && masked ? &masked_value : nullptr;
  const float* lse_data = log_sum_exp.const_data_ptr<float>();
  const float* dot_data = row_dot.const_data_ptr<float>();
  float* dq_data = dq.mutable_data_ptr<float>();
  float* dk_data = dk.mutable_data_ptr<float>();
  float* dv_data = dv.mutable_data_ptr<float>();
  const __m512 floor = _mm512_set1_ps(kExpFloor), zero = _mm512_setzero_ps();
  const __m512 exp_floor = _mm512_set1_ps(1.7e-38f);  // _EXP_FLOOR: the backward's probabilities at most this are 0
  const __m512 half_max = _mm512_set1_ps(65504.0f);
  const int64_t q_row_stride = q.stride(1), k_row_stride = k.stride(1), v_row_stride = v.stride(1);
  const int64_t dy_row_stride = dy.stride(1);
  std::atomic<bool> not_finite{false};

  at::parallel_for(0, batches, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> k_t(static_cast<size_t>(D * ld_keys)), v_t(static_cast<size_t>(Dv * ld_keys));
    std::vector<float> k_rows(static_cast<size_t>(N * D));
    std::vector<float> q_rows(static_cast<size_t>(kAmxRows * D)), dy_rows(static_cast<size_t>(kAmxRows * Dv));
    std::vector<float> q_t(static_cast<size_t>(D * kAmxRows)), dy_t(static_cast<size_t>(Dv * kAmxRows));
    std::vector<float> p(static_cast<size_t>(kAmxRows * ld_keys)), ds(static_cast<size_t>(kAmxRows * ld_keys));
    std::vector<float> dv_t(static_cast<size_t>(Dv * ld_keys)), dk_t(static_cast<size_t>(D * ld_keys));
    std::vector<float> dq_sums(static_cast<size_t>(kAmxRows * D));
    bool local_not_finite = false;
    for (int64_t batch = begin; batch < end; ++batch) {
      widen_transposed(row_pointer<Half>(k, batch, 0), k_row_stride, N, D, ld_keys, ld_keys, k_t.data());
      widen_transposed(row_pointer<Half>(v, batch, 0), v_row_stride, N, Dv, ld_keys, ld_keys, v_t.data());
      widen_rows(row_pointer<Half>(k, batch, 0), k_row_stride, N, D, D, k_rows.data());
      std::fill(dv_t.begin(), dv_t.end(), 0.0f);
      std::fill(dk_t.begin(), dk_t.end(), 0.0f);
      for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
        const int64_t rows = std::min(kAmxRows, M - m0);
        const float* bias_block = bias_data ? bias_data + batch * bias_batch_stride + m0 * bias_row_stride : nullptr;
        const auto [first, last] = visible_keys(bias_block, bias_row_stride, masked_ptr, rows, N);
        const Half* q_block = row_pointer<Half>(q, batch, m0);
        const Half* dy_block = row_pointer<Half>(dy, batch, m0);
        widen_rows(q_block, q_row_stride, rows, D, D, q_rows.data());
        widen_rows(dy_block, dy_row_stride, rows, Dv, Dv, dy_rows.data());
        widen_transposed(q_block, q_row_stride, rows, D, kAmxRows, kAmxRows, q_t.data());
        widen_transposed(dy_block, dy_row_stride, rows, Dv, kAmxRows, kAmxRows, dy_t.data());
        at::native::cpublas::brgemm(rows, last - first, D, D, ld_keys, ld_keys, false, q_rows.data(),
                                    k_t.data() + first, p.data() + first, false);
        at::native::cpublas::brgemm(rows, last - first, Dv, Dv, ld_keys, ld_keys, false, dy_rows.data(),
                                    v_t.data() + first, ds.data() + first, false);
        for (int64_t r = 0; r < rows; ++r) {
          float* p_row = p.data() + r * ld_keys;
          float* ds_row = ds.data() + r * ld_keys;
          score_row(p_row, bias_block ? bias_block + r * bias_row_stride : nullptr, masked_ptr,
                    static_cast<float>(scale), first, last);
          const __m512 lse = _mm512_set1_ps(lse_data[batch * M + m0 + r]);
          const __m512 dot = _mm512_set1_ps(dot_data[batch * M + m0 + r]);
          __m512 spread = zero;  // nan once a rounded dS is inf or nan (as round_to_half's)
          for (int64_t j = first; j < last; j += 16) {
            const __mmask16 valid = lanes_below(last - j);
            const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, p_row + j), lse), floor), zero);
            __m512 prob = Sleef_expf16_u10(x);
            prob = _mm512_mask_mov_ps(prob, _mm512_cmp_ps_mask(prob, exp_floor, _CMP_LE_OQ), zero);
            __m512 d = round_to_half(_mm512_mul_ps(prob, _mm512_sub_ps(_mm512_maskz_loadu_ps(valid, ds_row + j), dot)));
            spread = _mm512_add_ps(spread, _mm512_maskz_sub_ps(valid, d, d));
            if (saturate) {  // the device's saturation mode: nan 0, +-inf +-65504 (round_to_half's nan_to_num)
              d = _mm512_mask_mov_ps(d, _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q), zero);
              d = _mm512_min_ps(_mm512_max_ps(d, _mm512_sub_ps(zero, half_max)), half_max);
            }
            _mm512_mask_storeu_ps(p_row + j, valid, round_to_half(prob));
            _mm512_mask_storeu_ps(ds_row + j, valid, d);
          }
          if (_mm512_reduce_add_ps(spread) != _mm512_reduce_add_ps(spread)) local_not_finite = true;
        }
        // dQ = (dS @ K) * scale; dV^T += dY^T P, dK^T += Q^T dS (summed over the blocks)
        at::native::cpublas::brgemm(rows, D, last - first, ld_keys, D, D, false, ds.data() + first,
                                    k_rows.data() + first * D, dq_sums.data(), false);
        for (int64_t r = 0; r < rows; ++r) {
          float* dq_row = dq_data + (batch * M + m0 + r) * D;
          for (int64_t j = 0; j < D; j += 16) {
            const __mmask16 valid = lanes_below(D - j);
            _mm512_mask_storeu_ps(dq_row + j, valid, _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, dq_sums.data() + r * D + j),
                                                                   _mm512_set1_ps(static_cast<float>(scale))));
          }
        }
        at::native::cpublas::brgemm(Dv, last - first, rows, kAmxRows, ld_keys, ld_keys, true, dy_t.data(),
                                    p.data() + first, dv_t.data() + first, false);
        at::native::cpublas::brgemm(D, last - first, rows, kAmxRows, ld_keys, ld_keys, true, q_t.data(),
                                    ds.data() + first, dk_t.data() + first, false);
      }
      for (int64_t n = 0; n < N; ++n) {
        float* dv_row = dv_data + (batch * N + n) * Dv;
        float* dk_row = dk_data + (batch * N + n) * D;
        for (int64_t x = 0; x < Dv; ++x) dv_row[x] = dv_t[x * ld_keys + n];
        for (int64_t x = 0; x < D; ++x) dk_row[x] = dk_t[x * ld_keys + n] * static_cast<float>(scale);
      }
    }
    if (local_not_finite) not_finite = true;
    at::native::cpublas::brgemm_release(false);
  });
  return not_finite;
}

void bf16_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, std::optional<double> masked,
                 const at::Tensor& row_offset, const at::Tensor& probabilities, const at::Tensor& out, double alpha,
                 bool on_amx) {
  const bool fp32_a = a.scalar_type() == at::kFloat, fp32_out = out.scalar_type() == at::kFloat;
  if (on_amx) {
    if (fp32_a && fp32_out) return run_on_amx<float, float>(a, b, bias, masked, row_offset, probabilities, out, alpha);
    if (fp32_a) return run_on_amx<float, Bf16>(a, b, bias, masked, row_offset, probabilities, out, alpha);
    if (fp32_out) return run_on_amx<Bf16, float>(a, b, bias, masked, row_offset, probabilities, out, alpha);
    return run_on_amx<Bf16, Bf16>(a, b, bias, masked, row_offset, probabilities, out, alpha);
  }
  if (fp32_a && fp32_out) return run<float, float>(a, b, bias, masked, row_offset, probabilities, out, alpha);
  if (fp32_a) return run<float, Bf16>(a, b, bias, masked, row_offset, probabilities, out, alpha);
  if (fp32_out) return run<Bf16, float>(a, b, bias, masked, row_offset, probabilities, out, alpha);
  run<Bf16, Bf16>(a, b, bias, masked, row_offset, probabilities, out, alpha);
}

}  // namespace npukit::fused::AVX512BF16
