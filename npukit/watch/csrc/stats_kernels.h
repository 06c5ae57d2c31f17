/* The one-pass statistics kernels (max, min, sum, sum of squares of float32 / float16 / bfloat16
 * host memory, see stats.cpp's header) and the strided walk over a tensor's contiguous runs: shared
 * by _stats (addresses from Python) and _tensor_stats (a tensor's own fields, read in C++). */
#pragma once
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <utility>
#include <vector>

#define LANES 8
#define BLOCK 64 /* elements per lane summed in float before going to double */
#define UNROLL 4 /* vectors a kernel step */
/* bytes ahead a kernel step asks for: the hooks find most tensors in L3 or memory, where one core's
 * streams ran at 7-8 GB/s from memory without it, 10-12 with it (512 B ahead: 9-10; 4 kB: 10) */
#define PREFETCH 2048

typedef float v8f __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
/* the same vectors read from any address (memcpy into an array of vectors compiled to a byte loop) */
typedef float v8f_unaligned __attribute__((vector_size(32), aligned(1), may_alias));
typedef uint32_t v8u32_unaligned __attribute__((vector_size(32), aligned(1), may_alias));
typedef uint16_t v8u16_unaligned __attribute__((vector_size(16), aligned(1), may_alias));

typedef struct {
    double max, min, sum, sumsq;
} Stats;

static inline float lane_max(const v8f &v) {
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float lane_min(const v8f &v) {
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] < m ? v[i] : m;
    return m;
}

static inline double lane_sum(const v8f &v) {
    double s = 0;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* LOAD_STEP turns a step's LANES * UNROLL elements of the buffer's type into UNROLL float vectors
 * (in any order: a step's statistics do not depend on it), LOAD8 the 8 elements of the tail's
 * vectors; ATTRIBUTES: the targets it is compiled for. Each sum has
 * UNROLL accumulators (with one, each vector waits for the previous one's add). Max and min have
 * one accumulator each, fed the step's vectors reduced among themselves first, so a step waits for
 * one dependent max (4 cycles), not one per vector (the previous kernel's limit: two per 128 bytes,
 * ~35 GB/s on data in L2). Each lane of each sum adds BLOCK elements in float; the blocks' sums go
 * to double as vectors (a lane-by-lane chain of double adds per block cost as much as its loads).
 * The fp16 and bf16 loads convert as vectors (an unrolled per-lane conversion was not vectorised,
 * and one vector a step ran at ~9 GB/s). */
#define DEFINE_FLOAT_KERNEL(NAME, ATTRIBUTES, TYPE, LOAD_STEP, LOAD8, TO_FLOAT)                 \
    ATTRIBUTES static Stats NAME(const TYPE *data, Py_ssize_t n) {                             \
        Stats out;                                                                             \
        float first = TO_FLOAT(data[0]);                                                       \
        v8f vmax = {first, first, first, first, first, first, first, first}, vmin = vmax;      \
        v8d block_sums = {}, block_squares = {};                                               \
        double sum = 0, sumsq = 0;                                                             \
        const Py_ssize_t stride = (Py_ssize_t)LANES * UNROLL;                                  \
        Py_ssize_t i = 0;                                                                      \
        while (i + stride <= n) {                                                              \
            v8f vsum[UNROLL] = {}, vsq[UNROLL] = {};                                           \
            Py_ssize_t end = i + stride * BLOCK;                                               \
            if (end > n) end = n - (n - i) % stride;                                           \
            for (; i < end; i += stride) {                                                     \
                v8f v[UNROLL];                                                                 \
                __builtin_prefetch((const char *)(data + i) + PREFETCH);                       \
                __builtin_prefetch((const char *)(data + i) + PREFETCH + 64);                  \
                LOAD_STEP(v, data + i);                                                        \
                v8f hi = v[0], lo = v[0];                                                      \
                for (int u = 1; u < UNROLL; u++) {                                             \
                    hi = v[u] > hi ? v[u] : hi;                                                \
                    lo = v[u] < lo ? v[u] : lo;                                                \
                }                                                                              \
                vmax = hi > vmax ? hi : vmax;                                                  \
                vmin = lo < vmin ? lo : vmin;                                                  \
                for (int u = 0; u < UNROLL; u++) vsum[u] += v[u], vsq[u] += v[u] * v[u];       \
            }                                                                                  \
            for (int u = 0; u < UNROLL; u++) {                                                 \
                block_sums += __builtin_convertvector(vsum[u], v8d);                           \
                block_squares += __builtin_convertvector(vsq[u], v8d);                         \
            }                                                                                  \
        }                                                                                      \
        for (int lane = 0; lane < LANES; lane++) sum += block_sums[lane], sumsq += block_squares[lane]; \
        for (; i + LANES <= n; i += LANES) { /* fewer than UNROLL vectors left */              \
            v8f v;                                                                             \
            LOAD8(v, data + i, TO_FLOAT);                                                      \
            vmax = v > vmax ? v : vmax;                                                        \
            vmin = v < vmin ? v : vmin;                                                        \
            sum += lane_sum(v), sumsq += lane_sum(v * v);                                      \
        }                                                                                      \
        float hi = lane_max(vmax), lo = lane_min(vmin);                                        \
        for (; i < n; i++) {                                                                   \
            float x = TO_FLOAT(data[i]);                                                       \
            hi = x > hi ? x : hi;                                                              \
            lo = x < lo ? x : lo;                                                              \
            sum += x;                                                                          \
            sumsq += (double)x * x;                                                            \
        }                                                                                      \
        out.max = hi;                                                                          \
        out.min = lo;                                                                          \
        out.sum = sum;                                                                         \
        out.sumsq = sumsq;                                                                     \
        return out;                                                                            \
    }

#define LOAD_F32(v, p, TO_FLOAT) ((v) = *(const v8f_unaligned *)(p))
#define F32_TO_FLOAT(x) (x)

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* IEEE half to float without F16C and without branches, so the lane loop vectorises: shift
 * exponent and mantissa into place and rescale by 2^112; subnormals come out exact, and inf/nan
 * (exponent all ones) get the float exponent all ones. */
static inline float f16_to_float(uint16_t bits) {
    uint32_t magnitude = (uint32_t)(bits & 0x7fff) << 13;
    float value;
    memcpy(&value, &magnitude, sizeof value);
    value *= 0x1.0p112f;
    uint32_t wide;
    memcpy(&wide, &value, sizeof wide);
    if (value >= 65536.0f) wide |= 255u << 23;
    wide |= (uint32_t)(bits & 0x8000) << 16;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* 8 bf16 elements as floats: their bits are a float's upper half. */
#define LOAD_BF16(v, p, TO_FLOAT)                                                              \
    do {                                                                                       \
        v8u16 half = *(const v8u16_unaligned *)(p);                                            \
        v8u32 wide = __builtin_convertvector(half, v8u32) << 16;                               \
        (v) = (v8f)wide;                                                                       \
    } while (0)

/* 8 fp16 elements as floats: f16_to_float on 8 lanes. */
#define LOAD_F16(v, p, TO_FLOAT)                                                               \
    do {                                                                                       \
        v8u16 half = *(const v8u16_unaligned *)(p);                                            \
        v8u32 bits = __builtin_convertvector(half, v8u32);                                     \
        F16_BITS_TO_FLOAT(v, bits);                                                            \
    } while (0)

/* A step's vectors, a vector a load. */
#define STEP_F32(v, p)                                                                         \
    for (int u = 0; u < UNROLL; u++) LOAD_F32((v)[u], (p) + u * LANES, F32_TO_FLOAT)

/* A step of 16-bit elements, two vectors a 32-byte load: each 32-bit lane holds two elements, the
 * low halves make one vector and the high halves another. Widening 8 elements into 32-bit lanes in
 * order took four shuffle-port instructions a vector, the 16-bit kernels' limit (~6 G elements/s
 * for bf16, ~3.4 with fp16's conversion, float32's kernel 11); these are a shift and a mask. */
#define STEP_BF16(v, p)                                                                        \
    for (int u = 0; u < UNROLL; u += 2) {                                                      \
        v8u32 pair = *(const v8u32_unaligned *)((p) + u * LANES);                              \
        (v)[u] = (v8f)(pair << 16);                                                            \
        (v)[u + 1] = (v8f)(pair & 0xffff0000u);                                                \
    }

/* IEEE half bits, zero-extended into 32-bit lanes, as floats: f16_to_float on 8 lanes. */
#define F16_BITS_TO_FLOAT(v, bits)                                                             \
    do {                                                                                       \
        v8u32 magnitude = ((bits) & 0x7fffu) << 13;                                            \
        v8f value = (v8f)magnitude * 0x1.0p112f;                                               \
        v8u32 wide = (v8u32)value;                                                             \
        const v8f top = {65536.0f, 65536.0f, 65536.0f, 65536.0f, 65536.0f, 65536.0f, 65536.0f, 65536.0f}; \
        wide |= (v8u32)(value >= top) & (255u << 23);                                          \
        wide |= ((bits) & 0x8000u) << 16;                                                      \
        (v) = (v8f)wide;                                                                       \
    } while (0)

#define STEP_F16(v, p)                                                                         \
    for (int u = 0; u < UNROLL; u += 2) {                                                      \
        v8u32 pair = *(const v8u32_unaligned *)((p) + u * LANES);                              \
        F16_BITS_TO_FLOAT((v)[u], pair & 0xffffu);                                             \
        F16_BITS_TO_FLOAT((v)[u + 1], pair >> 16);                                             \
    }

/* F16C converts 8 halves in one instruction (exactly, inf and nan included). */
#define STEP_F16C(v, p)                                                                        \
    for (int u = 0; u < UNROLL; u++)                                                           \
        (v)[u] = (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((p) + u * LANES)))

/* x86-64-v3 adds AVX2 and FMA (and F16C, which the compiler's own half conversion does not use well) */
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))

DEFINE_FLOAT_KERNEL(stats_f32, CLONES, float, STEP_F32, LOAD_F32, F32_TO_FLOAT)
DEFINE_FLOAT_KERNEL(stats_bf16, CLONES, uint16_t, STEP_BF16, LOAD_BF16, bf16_to_float)
DEFINE_FLOAT_KERNEL(stats_f16, CLONES, uint16_t, STEP_F16, LOAD_F16, f16_to_float)
DEFINE_FLOAT_KERNEL(stats_f16c, __attribute__((target("avx2,fma,f16c"))), uint16_t, STEP_F16C, LOAD_F16,
                    f16_to_float)

typedef Stats (*RunKernel)(const void *data, Py_ssize_t n);

static Stats run_f32(const void *data, Py_ssize_t n) { return stats_f32((const float *)data, n); }
static Stats run_bf16(const void *data, Py_ssize_t n) { return stats_bf16((const uint16_t *)data, n); }
static Stats run_f16(const void *data, Py_ssize_t n) {
    static const bool f16c =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    return f16c ? stats_f16c((const uint16_t *)data, n) : stats_f16((const uint16_t *)data, n);
}

/* Runs shorter than this cost more in per-run overhead than a contiguous copy does. */
#define MIN_RUN 16

/* Visits a strided tensor as runs of contiguous elements. Dimensions of size 1 are dropped,
 * the rest ordered by stride and merged where they are contiguous with each other; the layout
 * must then be non-overlapping with a unit innermost stride (a transpose, a slice, a chunk).
 * Returns false when it is not, so the caller copies the tensor to contiguous memory. */
static bool strided_stats(const char *base, Py_ssize_t item, RunKernel kernel, std::vector<Py_ssize_t> sizes,
                          std::vector<Py_ssize_t> strides, Stats *out) {
    std::vector<std::pair<Py_ssize_t, Py_ssize_t>> dims;  // (stride, size), outermost first
    for (size_t d = 0; d < sizes.size(); d++) {
        if (sizes[d] == 0) return false;
        if (sizes[d] != 1) dims.push_back({strides[d], sizes[d]});
    }
    std::sort(dims.begin(), dims.end(), [](auto &a, auto &b) { return a.first > b.first; });
    std::vector<std::pair<Py_ssize_t, Py_ssize_t>> merged;
    for (auto &dim : dims) {
        if (!merged.empty() && merged.back().first == dim.first * dim.second) {
            merged.back() = {dim.first, merged.back().second * dim.second};
        } else {
            merged.push_back(dim);
        }
    }
    if (merged.empty()) merged.push_back({1, 1});
    for (size_t d = 0; d + 1 < merged.size(); d++)
        if (merged[d].first < merged[d + 1].first * merged[d + 1].second) return false;  // overlapping
    Py_ssize_t run = merged.back().second;
    if (merged.back().first != 1 || (merged.size() > 1 && run < MIN_RUN)) return false;
    size_t outer = merged.size() - 1;
    std::vector<Py_ssize_t> index(outer, 0);
    Py_ssize_t offset = 0;
    bool first = true;
    for (;;) {
        Stats part = kernel(base + offset * item, run);
        if (first) {
            *out = part;
            first = false;
        } else {
            out->max = part.max > out->max ? part.max : out->max;
            out->min = part.min < out->min ? part.min : out->min;
            out->sum += part.sum;
            out->sumsq += part.sumsq;
        }
        size_t d = outer;
        while (d > 0) {  // odometer over the outer dimensions
            d--;
            offset += merged[d].first;
            if (++index[d] < merged[d].second) break;
            offset -= merged[d].first * merged[d].second;
            index[d] = 0;
            if (d == 0) return true;
        }
        if (outer == 0) return true;
    }
}

/* Adam's state in one read: statistics of exp_avg (m) and exp_avg_sq (v), and the sum of squares
 * of m / (sqrt(v) + eps) (the monitor's update ratio), for contiguous float32 m and v. torch needs
 * two statistics passes and four more for the ratio (sqrt, add, div, norm, two of them writing a
 * tensor the size of the state). Sums as in DEFINE_FLOAT_KERNEL: float per block, then double. */
/* sqrt of 8 lanes: one instruction under AVX (a per-lane sqrtf call otherwise: libm's errno
 * keeps the compiler from vectorising it). */
#define sqrt8_avx2(root, y) ((root) = (v8f)_mm256_sqrt_ps((__m256)(y)))

#define sqrt8_default(root, y)                                                \
    do {                                                                      \
        for (int lane = 0; lane < LANES; lane++) (root)[lane] = sqrtf((y)[lane]); \
    } while (0)

#define DEFINE_ADAM_KERNEL(NAME, ATTRIBUTES, SQRT8)                                                              \
    ATTRIBUTES static void NAME(const float *m, const float *v, Py_ssize_t n, float eps, Stats *m_out, Stats *v_out, \
                                double *update_sumsq) {                                                                                       \
    v8f m_max = {m[0], m[0], m[0], m[0], m[0], m[0], m[0], m[0]}, m_min = m_max;                                      \
    v8f v_max = {v[0], v[0], v[0], v[0], v[0], v[0], v[0], v[0]}, v_min = v_max;                                      \
    v8f eps8 = {eps, eps, eps, eps, eps, eps, eps, eps};                                                              \
    double m_sum = 0, m_sq = 0, v_sum = 0, v_sq = 0, u_sq = 0;                                                        \
    Py_ssize_t i = 0;                                                                                                 \
    while (i + LANES <= n) {                                                                                          \
        v8f ms = {0}, mq = {0}, vs = {0}, vq = {0}, uq = {0};                                                         \
        Py_ssize_t end = i + (Py_ssize_t)LANES * BLOCK;                                                               \
        if (end > n) end = n - (n - i) % LANES;                                                                       \
        for (; i < end; i += LANES) {                                                                                 \
            v8f x, y, root;                                                                                           \
            memcpy(&x, m + i, sizeof x);                                                                              \
            memcpy(&y, v + i, sizeof y);                                                                              \
            m_max = x > m_max ? x : m_max;                                                                            \
            m_min = x < m_min ? x : m_min;                                                                            \
            v_max = y > v_max ? y : v_max;                                                                            \
            v_min = y < v_min ? y : v_min;                                                                            \
            ms += x, mq += x * x, vs += y, vq += y * y;                                                               \
            SQRT8(root, y);                                                                                           \
            v8f u = x / (root + eps8);                                                                                \
            uq += u * u;                                                                                              \
        }                                                                                                             \
        m_sum += lane_sum(ms), m_sq += lane_sum(mq), v_sum += lane_sum(vs), v_sq += lane_sum(vq);                     \
        u_sq += lane_sum(uq);                                                                                         \
    }                                                                                                                 \
    float m_hi = lane_max(m_max), m_lo = lane_min(m_min), v_hi = lane_max(v_max), v_lo = lane_min(v_min);             \
    for (; i < n; i++) {                                                                                              \
        float x = m[i], y = v[i];                                                                                     \
        m_hi = x > m_hi ? x : m_hi, m_lo = x < m_lo ? x : m_lo, v_hi = y > v_hi ? y : v_hi, v_lo = y < v_lo ? y : v_lo;\
        m_sum += x, m_sq += (double)x * x, v_sum += y, v_sq += (double)y * y;                                         \
        float u = x / (sqrtf(y) + eps);                                                                               \
        u_sq += (double)u * u;                                                                                        \
    }                                                                                                                 \
    *m_out = {m_hi, m_lo, m_sum, m_sq};                                                                               \
    *v_out = {v_hi, v_lo, v_sum, v_sq};                                                                               \
    *update_sumsq = u_sq;                                                                                             \
}

DEFINE_ADAM_KERNEL(adam_kernel_avx2, __attribute__((target("avx2"))), sqrt8_avx2)
DEFINE_ADAM_KERNEL(adam_kernel_default, , sqrt8_default)

static inline void adam_kernel(const float *m, const float *v, Py_ssize_t n, float eps, Stats *m_out, Stats *v_out,
                        double *update_sumsq) {
    static const bool avx2 = __builtin_cpu_supports("avx2");
    (avx2 ? adam_kernel_avx2 : adam_kernel_default)(m, v, n, eps, m_out, v_out, update_sumsq);
}
