/* The one-pass statistics kernels (max, min, sum, sum of squares of float32 / float16 / bfloat16
 * host memory, see stats.cpp's header) and the strided walk over a tensor's contiguous runs: shared
 * by _stats (addresses from Python) and _tensor_stats (a tensor's own fields, read in C++). */
#pragma once
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <utility>
#include <vector>

#define LANES 8
#define BLOCK 64 /* elements per lane summed in float before going to double */

typedef float v8f __attribute__((vector_size(32)));

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

/* load8 turns 8 elements of the buffer's type into floats. UNROLL independent sums: with one, each
 * float32 vector waits for the previous one's add (latency-bound at ~34 GB/s; four: ~58 GB/s);
 * max and min (short latency) take EXTREMA, so that all accumulators stay in the 16 vector
 * registers. Converted loads (fp16, bf16) are bound by the conversion: one of each (unrolled, gcc
 * no longer vectorises their conversion). x86-64-v3 adds FMA to AVX2. Each lane of each sum still
 * adds BLOCK elements in float before going to double. */
#define DEFINE_FLOAT_KERNEL(NAME, TYPE, LOAD8, TO_FLOAT, UNROLL, EXTREMA)                       \
    __attribute__((target_clones("arch=x86-64-v3", "default"))) static Stats NAME(const TYPE *data, \
                                                                                  Py_ssize_t n) {     \
        Stats out;                                                                             \
        float first = TO_FLOAT(data[0]);                                                       \
        v8f vmax[EXTREMA], vmin[EXTREMA];                                                      \
        for (int u = 0; u < EXTREMA; u++)                                                      \
            vmax[u] = (v8f){first, first, first, first, first, first, first, first}, vmin[u] = vmax[u]; \
        double sum = 0, sumsq = 0;                                                             \
        const Py_ssize_t stride = (Py_ssize_t)LANES * UNROLL;                                  \
        Py_ssize_t i = 0;                                                                      \
        while (i + stride <= n) {                                                              \
            v8f vsum[UNROLL] = {}, vsq[UNROLL] = {};                                           \
            Py_ssize_t end = i + stride * BLOCK;                                               \
            if (end > n) end = n - (n - i) % stride;                                           \
            for (; i < end; i += stride) {                                                     \
                for (int u = 0; u < UNROLL; u++) {                                             \
                    v8f v;                                                                     \
                    LOAD8(v, data + i + u * LANES, TO_FLOAT);                                  \
                    vmax[u % EXTREMA] = v > vmax[u % EXTREMA] ? v : vmax[u % EXTREMA];         \
                    vmin[u % EXTREMA] = v < vmin[u % EXTREMA] ? v : vmin[u % EXTREMA];         \
                    vsum[u] += v;                                                              \
                    vsq[u] += v * v;                                                           \
                }                                                                              \
            }                                                                                  \
            for (int u = 0; u < UNROLL; u++) sum += lane_sum(vsum[u]), sumsq += lane_sum(vsq[u]); \
        }                                                                                      \
        for (; i + LANES <= n; i += LANES) { /* fewer than UNROLL vectors left */              \
            v8f v;                                                                             \
            LOAD8(v, data + i, TO_FLOAT);                                                      \
            vmax[0] = v > vmax[0] ? v : vmax[0];                                               \
            vmin[0] = v < vmin[0] ? v : vmin[0];                                               \
            sum += lane_sum(v), sumsq += lane_sum(v * v);                                      \
        }                                                                                      \
        for (int u = 1; u < EXTREMA; u++) {                                                    \
            vmax[0] = vmax[u] > vmax[0] ? vmax[u] : vmax[0];                                   \
            vmin[0] = vmin[u] < vmin[0] ? vmin[u] : vmin[0];                                   \
        }                                                                                      \
        float hi = lane_max(vmax[0]), lo = lane_min(vmin[0]);                                  \
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

#define LOAD_F32(v, p, TO_FLOAT) memcpy(&(v), (p), sizeof(v8f))
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

/* 8 converted elements: bf16 and fp16 data. */
#define LOAD_CONVERTED(v, p, TO_FLOAT)                                                         \
    do {                                                                                       \
        for (int lane = 0; lane < LANES; lane++) (v)[lane] = TO_FLOAT((p)[lane]);              \
    } while (0)

DEFINE_FLOAT_KERNEL(stats_f32, float, LOAD_F32, F32_TO_FLOAT, 4, 2)
DEFINE_FLOAT_KERNEL(stats_bf16, uint16_t, LOAD_CONVERTED, bf16_to_float, 1, 1)
DEFINE_FLOAT_KERNEL(stats_f16, uint16_t, LOAD_CONVERTED, f16_to_float, 1, 1)

typedef Stats (*RunKernel)(const void *data, Py_ssize_t n);

static Stats run_f32(const void *data, Py_ssize_t n) { return stats_f32((const float *)data, n); }
static Stats run_bf16(const void *data, Py_ssize_t n) { return stats_bf16((const uint16_t *)data, n); }
static Stats run_f16(const void *data, Py_ssize_t n) { return stats_f16((const uint16_t *)data, n); }

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

