/* One-pass tensor statistics for the dump session: max, min, sum and sum of squares of a
 * contiguous float32 / float16 / bfloat16 buffer in host memory, in one read of the data.
 *
 * torch needs four passes for the same figures (amax, amin, mean, vector_norm), and a dump at mix
 * level measures hundreds of activations per training step, so the passes are most of its cost.
 *
 * Sums are taken in float over blocks of 64 elements per lane and added up in double, which
 * keeps the error far below what the statistics are read for. Max and min here skip NaN, and a
 * float sum of squares can overflow on finite data: the caller checks `finite` and falls back to
 * torch's exact reductions when it is false, so nan/inf counts and NaN propagation stay torch's.
 *
 * Also here: npu-compare's metrics of a tensor pair in one pass (pair_partial), zlib's CRC-32 with
 * carry-less multiplies for the dump's .pt files (crc32), and CRC-32C for the monitor (its Adam state
 * statistics are tensor_stats.cpp's adam_host_stats).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "stats_kernels.h"

static bool read_sizes(PyObject *tuple, std::vector<Py_ssize_t> &values) {
    PyObject *items = PySequence_Fast(tuple, "stats: shape and strides must be sequences");
    if (items == NULL) return false;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t value = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(items, i));
        if (value == -1 && PyErr_Occurred()) {
            Py_DECREF(items);
            return false;
        }
        values.push_back(value);
    }
    Py_DECREF(items);
    return true;
}

/* stats(address, kind, shape, strides) -> (max, min, sum, sumsq, finite), or None when the
 * layout is not one it can walk (copy the tensor to contiguous memory and ask again).
 * address: data_ptr() of a live host tensor; kind: "f32", "f16" or "bf16"; strides in elements. */
static PyObject *py_stats(PyObject *self, PyObject *args) {
    unsigned long long address;
    const char *kind;
    PyObject *shape_arg, *strides_arg;
    if (!PyArg_ParseTuple(args, "KsOO", &address, &kind, &shape_arg, &strides_arg)) return NULL;
    RunKernel kernel;
    Py_ssize_t item;
    if (strcmp(kind, "f32") == 0) {
        kernel = run_f32, item = 4;
    } else if (strcmp(kind, "bf16") == 0) {
        kernel = run_bf16, item = 2;
    } else if (strcmp(kind, "f16") == 0) {
        kernel = run_f16, item = 2;
    } else {
        PyErr_Format(PyExc_ValueError, "stats: unknown element kind %s", kind);
        return NULL;
    }
    std::vector<Py_ssize_t> shape, strides;
    if (!read_sizes(shape_arg, shape) || !read_sizes(strides_arg, strides)) return NULL;
    if (shape.size() != strides.size() || address == 0) {
        PyErr_SetString(PyExc_ValueError, "stats: shape and strides differ in length, or no data");
        return NULL;
    }
    Stats result = {0, 0, 0, 0};
    bool walked;
    Py_BEGIN_ALLOW_THREADS walked = strided_stats((const char *)(uintptr_t)address, item, kernel, shape, strides,
                                                  &result);
    Py_END_ALLOW_THREADS
    if (!walked) Py_RETURN_NONE;
    int finite = isfinite(result.sum) && isfinite(result.sumsq);
    return Py_BuildValue("ddddO", result.max, result.min, result.sum, result.sumsq,
                         finite ? Py_True : Py_False);
}

/* CRC-32C of a buffer with SSE 4.2's crc32 instruction (the same polynomial, reflected), 8 bytes a
 * step: a monitored step's event (~14 kB for 74 records) in ~2 us, ~15 us from the byte table. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const unsigned char *bytes,
                                                               Py_ssize_t length) {
    uint64_t wide = crc;
    Py_ssize_t i = 0;
    for (; i + 8 <= length; i += 8) {
        uint64_t word;
        memcpy(&word, bytes + i, 8);
        wide = _mm_crc32_u64(wide, word);
    }
    crc = (uint32_t)wide;
    for (; i < length; i++) crc = _mm_crc32_u8(crc, bytes[i]);
    return crc;
}

/* crc32c(data) -> int: CRC-32C (Castagnoli), as TFRecord files checksum their records (the
 * monitor's TensorBoard events). With SSE 4.2's instruction where the CPU has it, else byte-wise
 * from a table (~1 GB/s). */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    static uint32_t table[256];
    static bool ready = false;
    static const bool sse42 = __builtin_cpu_supports("sse4.2");
    if (!ready) {
        for (uint32_t byte = 0; byte < 256; byte++) {
            uint32_t crc = byte;
            for (int bit = 0; bit < 8; bit++) crc = crc & 1 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
            table[byte] = crc;
        }
        ready = true;
    }
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    const unsigned char *bytes = (const unsigned char *)data.buf;
    uint32_t crc = 0xFFFFFFFFu;
    Py_BEGIN_ALLOW_THREADS if (sse42) crc = crc32c_sse42(crc, bytes, data.len);
    else for (Py_ssize_t i = 0; i < data.len; i++) crc = table[(crc ^ bytes[i]) & 0xFF] ^ (crc >> 8);
    Py_END_ALLOW_THREADS PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc ^ 0xFFFFFFFFu);
}

/* fill_float32(template, holes, values) -> bytes: template with values[i], rounded to float32
 * (beyond its range: inf, as numpy's astype gives) little-endian, written at byte offset holes[i]
 * (holes: int64 buffer). The monitor's TensorBoard Summary of a step, one call for its thousands
 * of values instead of numpy's conversion, copy and fancy-indexed assignment. */
static PyObject *py_fill_float32(PyObject *self, PyObject *args) {
    Py_buffer layout, holes;
    PyObject *values;
    if (!PyArg_ParseTuple(args, "y*y*O!", &layout, &holes, &PyList_Type, &values)) return NULL;
    Py_ssize_t count = holes.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *out = NULL;
    if (PyList_GET_SIZE(values) != count) {
        PyErr_Format(PyExc_ValueError, "fill_float32: %zd values for %zd holes", PyList_GET_SIZE(values), count);
    } else if ((out = PyBytes_FromStringAndSize((const char *)layout.buf, layout.len)) != NULL) {
        char *target = PyBytes_AS_STRING(out);
        const int64_t *offsets = (const int64_t *)holes.buf;
        for (Py_ssize_t i = 0; i < count; i++) {
            double number = PyFloat_AsDouble(PyList_GET_ITEM(values, i));
            if (number == -1.0 && PyErr_Occurred()) {
                Py_CLEAR(out);
                break;
            }
            if (offsets[i] < 0 || offsets[i] + 4 > layout.len) {
                PyErr_Format(PyExc_ValueError, "fill_float32: hole %zd at byte %lld is outside the template", i,
                             (long long)offsets[i]);
                Py_CLEAR(out);
                break;
            }
            float narrow = (float)number;  // round to nearest; out of range: +-inf (x86's conversion)
            memcpy(target + offsets[i], &narrow, 4);
        }
    }
    PyBuffer_Release(&layout);
    PyBuffer_Release(&holes);
    return out;
}

/* A golden and a target chunk compared in one read (npu-compare's metrics): the partial sums and
 * extrema of metrics.py's _PARTIAL layout, as its numpy chunk_partial computes them in float64,
 * for float64 / float32 / float16 / bfloat16 data. numpy needs a dozen passes over fp64 copies of
 * both chunks for the same figures. Blocks of finite values go four lanes at a time; a block
 * holding nan/inf (or a ULP spacing outside the normal doubles) is redone element by element. */
enum {
    P_N, P_S_GT, P_S_GG, P_S_TT, P_S_DD, P_MAX_ABS, P_MAX_REL, P_N_REL_1E3, P_N_REL_5E3, P_NAN_MISMATCH,
    P_INF_MISMATCH, P_MAX_ULP, P_G_NONFINITE, P_T_NONFINITE, P_G_MAX, P_G_MIN, P_G_SUM, P_T_MAX, P_T_MIN, P_T_SUM,
    P_SIZE
};

struct LoadF64 {
    typedef double item;
    static double at(const double *p, Py_ssize_t i) { return p[i]; }
};
struct LoadF32 {
    typedef float item;
    static double at(const float *p, Py_ssize_t i) { return p[i]; }
};
struct LoadF16 {
    typedef uint16_t item;
    static double at(const uint16_t *p, Py_ssize_t i) { return f16_to_float(p[i]); }
};
struct LoadBF16 {
    typedef uint16_t item;
    static double at(const uint16_t *p, Py_ssize_t i) { return bf16_to_float(p[i]); }
};

struct PairOptions {
    double target_scale, zero_eps, ulp_floor;
    int ulp_bits, ulp_min_exponent;  // ulp_bits 0: no ULPs
};

/* Sums run over blocks of this many elements, each block's sum then added to the total (numpy
 * sums a chunk of 65,536 at a time: rounding stays as small). A multiple of 4. */
#define PAIR_BLOCK 2048

typedef double v4d __attribute__((vector_size(32)));
typedef long long v4l __attribute__((vector_size(32)));
typedef unsigned long long v4u __attribute__((vector_size(32)));  // AVX2 shifts 64-bit lanes only logically

/* Elements [start, end) one at a time into the partial `out`, every case included. */
template <class G, class T>
static inline __attribute__((always_inline)) void pair_scalar(const typename G::item *golden,
                                                              const typename T::item *target, Py_ssize_t start,
                                                              Py_ssize_t end, const PairOptions &options, double *out) {
    double s_gt = 0, s_gg = 0, s_tt = 0, s_dd = 0, g_sum = 0, t_sum = 0;
    for (Py_ssize_t i = start; i < end; i++) {
        double g = G::at(golden, i), t = T::at(target, i) * options.target_scale;
        if (!(isfinite(g) && isfinite(t))) {
            bool g_nan = isnan(g), t_nan = isnan(t);
            out[P_NAN_MISMATCH] += g_nan != t_nan;
            out[P_INF_MISMATCH] += !g_nan && !t_nan && g != t;
            out[P_G_NONFINITE] += !isfinite(g);
            out[P_T_NONFINITE] += !isfinite(t);
            bool agree = g == t || (g_nan && t_nan);  // equal non-finite values agree
            out[P_N_REL_1E3] += agree, out[P_N_REL_5E3] += agree;
            continue;
        }
        s_gt += g * t, s_gg += g * g, s_tt += t * t, g_sum += g, t_sum += t;
        out[P_G_MAX] = g > out[P_G_MAX] ? g : out[P_G_MAX], out[P_G_MIN] = g < out[P_G_MIN] ? g : out[P_G_MIN];
        out[P_T_MAX] = t > out[P_T_MAX] ? t : out[P_T_MAX], out[P_T_MIN] = t < out[P_T_MIN] ? t : out[P_T_MIN];
        double diff = t - g, abs_diff = fabs(diff), magnitude = fabs(g);
        s_dd += diff * diff;
        out[P_MAX_ABS] = abs_diff > out[P_MAX_ABS] ? abs_diff : out[P_MAX_ABS];
        double rel = abs_diff / (magnitude == 0 ? options.zero_eps : magnitude);
        out[P_MAX_REL] = rel > out[P_MAX_REL] ? rel : out[P_MAX_REL];
        out[P_N_REL_1E3] += rel < 1e-3, out[P_N_REL_5E3] += rel < 5e-3;
        if (options.ulp_bits) {  // the target dtype's spacing at max(|golden|, floor), as numpy's frexp/ldexp
            int exponent;
            frexp(magnitude > options.ulp_floor ? magnitude : options.ulp_floor, &exponent);
            exponent -= options.ulp_bits;
            if (exponent < options.ulp_min_exponent) exponent = options.ulp_min_exponent;
            double ulps = abs_diff / ldexp(1.0, exponent);
            out[P_MAX_ULP] = ulps > out[P_MAX_ULP] ? ulps : out[P_MAX_ULP];
        }
    }
    out[P_S_GT] += s_gt, out[P_S_GG] += s_gg, out[P_S_TT] += s_tt, out[P_S_DD] += s_dd;
    out[P_G_SUM] += g_sum, out[P_T_SUM] += t_sum;
}

template <class L>
static inline __attribute__((always_inline)) void load4(const typename L::item *p, Py_ssize_t i, v4d &v) {
    v = (v4d){L::at(p, i), L::at(p, i + 1), L::at(p, i + 2), L::at(p, i + 3)};
}

// by reference: a vector argument's ABI differs with and without AVX
static inline double sum4(const v4d &v) { return (v[0] + v[1]) + (v[2] + v[3]); }
static inline double max4(const v4d &v) { return std::max(std::max(v[0], v[1]), std::max(v[2], v[3])); }
static inline double min4(const v4d &v) { return std::min(std::min(v[0], v[1]), std::min(v[2], v[3])); }

/* Elements [start, end) (a multiple of 4 of them) four lanes at a time, merged into `out`; false
 * (out untouched) when a lane met a value the scalar loop must handle. */
template <class G, class T>
static inline __attribute__((always_inline)) bool pair_lanes(const typename G::item *golden,
                                                             const typename T::item *target, Py_ssize_t start,
                                                             Py_ssize_t end, const PairOptions &options, double *out) {
    const v4d zero = {0, 0, 0, 0}, scale = zero + options.target_scale, zero_eps = zero + options.zero_eps;
    const v4d floor = zero + options.ulp_floor, tight = zero + 1e-3, loose = zero + 5e-3;
    const v4l sign = {0, 0, 0, 0}, magnitude_bits = ~(sign + (1LL << 63));
    const long long ulp_shift = 1022 + options.ulp_bits;  // frexp's exponent is the biased one less 1022
    const long long min_exponent = options.ulp_min_exponent;
    v4d s_gt = zero, s_gg = zero, s_tt = zero, s_dd = zero, g_sum = zero, t_sum = zero;
    v4d g_max = zero - INFINITY, t_max = g_max, max_abs = g_max, max_rel = g_max, max_ulp = g_max;
    v4d g_min = zero + INFINITY, t_min = g_min;
    v4l close_1e3 = sign, close_5e3 = sign, odd = sign;
    for (Py_ssize_t i = start; i < end; i += 4) {
        v4d g, t;
        load4<G>(golden, i, g), load4<T>(target, i, t);
        t *= scale;
        odd |= (g - g != zero) | (t - t != zero);  // nan or inf
        s_gt += g * t, s_gg += g * g, s_tt += t * t, g_sum += g, t_sum += t;
        g_max = g > g_max ? g : g_max, g_min = g < g_min ? g : g_min;
        t_max = t > t_max ? t : t_max, t_min = t < t_min ? t : t_min;
        v4d diff = t - g;
        s_dd += diff * diff;
        v4d abs_diff = (v4d)((v4l)diff & magnitude_bits), magnitude = (v4d)((v4l)g & magnitude_bits);
        max_abs = abs_diff > max_abs ? abs_diff : max_abs;
        v4d rel = abs_diff / (magnitude == zero ? zero_eps : magnitude);
        max_rel = rel > max_rel ? rel : max_rel;
        close_1e3 -= rel < tight, close_5e3 -= rel < loose;  // a true comparison is -1
        if (options.ulp_bits) {
            v4d reference = magnitude > floor ? magnitude : floor;
            v4l biased = (v4l)((v4u)reference >> 52);
            v4l exponent = biased - ulp_shift;  // the spacing's: 2**exponent
            exponent = exponent < min_exponent ? sign + min_exponent : exponent;
            // zero or subnormal references and spacings outside the normal doubles: the scalar loop
            odd |= (biased == sign) | (exponent < -1022) | (exponent > 1022);
            v4d ulps = abs_diff * (v4d)((v4u)(1023 - exponent) << 52);  // / 2**exponent, exactly
            max_ulp = ulps > max_ulp ? ulps : max_ulp;
        }
    }
    if (odd[0] | odd[1] | odd[2] | odd[3]) return false;
    out[P_S_GT] += sum4(s_gt), out[P_S_GG] += sum4(s_gg), out[P_S_TT] += sum4(s_tt), out[P_S_DD] += sum4(s_dd);
    out[P_G_SUM] += sum4(g_sum), out[P_T_SUM] += sum4(t_sum);
    out[P_G_MAX] = std::max(out[P_G_MAX], max4(g_max)), out[P_G_MIN] = std::min(out[P_G_MIN], min4(g_min));
    out[P_T_MAX] = std::max(out[P_T_MAX], max4(t_max)), out[P_T_MIN] = std::min(out[P_T_MIN], min4(t_min));
    out[P_MAX_ABS] = std::max(out[P_MAX_ABS], max4(max_abs)), out[P_MAX_REL] = std::max(out[P_MAX_REL], max4(max_rel));
    if (options.ulp_bits) out[P_MAX_ULP] = std::max(out[P_MAX_ULP], max4(max_ulp));
    out[P_N_REL_1E3] += (double)(close_1e3[0] + close_1e3[1] + close_1e3[2] + close_1e3[3]);
    out[P_N_REL_5E3] += (double)(close_5e3[0] + close_5e3[1] + close_5e3[2] + close_5e3[3]);
    return true;
}

template <class G, class T>
static inline __attribute__((always_inline)) void pair_blocks(const void *golden_data, const void *target_data,
                                                              Py_ssize_t n, const PairOptions &options, double *out) {
    const typename G::item *golden = (const typename G::item *)golden_data;
    const typename T::item *target = (const typename T::item *)target_data;
    for (Py_ssize_t start = 0; start < n; start += PAIR_BLOCK) {
        Py_ssize_t end = start + PAIR_BLOCK < n ? start + PAIR_BLOCK : n;
        Py_ssize_t lanes_end = start + (end - start) / 4 * 4;
        if (!pair_lanes<G, T>(golden, target, start, lanes_end, options, out))
            lanes_end = start;
        pair_scalar<G, T>(golden, target, lanes_end, end, options, out);
    }
    out[P_N] += n;
}

typedef void (*PairKernel)(const void *, const void *, Py_ssize_t, const PairOptions &, double *);

template <class G, class T>
__attribute__((target("avx2"))) static void pair_avx2(const void *golden, const void *target, Py_ssize_t n,
                                                      const PairOptions &options, double *out) {
    pair_blocks<G, T>(golden, target, n, options, out);
}

template <class G, class T>
static void pair_default(const void *golden, const void *target, Py_ssize_t n, const PairOptions &options,
                         double *out) {
    pair_blocks<G, T>(golden, target, n, options, out);
}

template <class G, class T>
static PairKernel pair_kernel_for() {
    static const bool avx2 = __builtin_cpu_supports("avx2");
    return avx2 ? pair_avx2<G, T> : pair_default<G, T>;
}

template <class G>
static PairKernel pair_kernel_with_target(int target_kind) {
    switch (target_kind) {
        case 0: return pair_kernel_for<G, LoadF64>();
        case 1: return pair_kernel_for<G, LoadF32>();
        case 2: return pair_kernel_for<G, LoadF16>();
        default: return pair_kernel_for<G, LoadBF16>();
    }
}

/* 0 f64, 1 f32, 2 f16, 3 bf16 (its element size in *item); -1 for any other kind name. */
static int pair_kind(const char *kind, Py_ssize_t *item) {
    static const char *names[] = {"f64", "f32", "f16", "bf16"};
    static const Py_ssize_t sizes[] = {8, 4, 2, 2};
    for (int k = 0; k < 4; k++)
        if (strcmp(kind, names[k]) == 0) return *item = sizes[k], k;
    return -1;
}

/* pair_partial(out, golden, golden_kind, target, target_kind, target_scale, zero_eps, ulp_bits,
 * ulp_min_exponent, ulp_floor): merges the partial of a golden and a target chunk (contiguous
 * buffers of the same element count; kinds "f64", "f32", "f16", "bf16") into `out`, a writable
 * buffer of 20 float64 in metrics.py's _PARTIAL layout. ulp_bits 0: no ULPs. */
static PyObject *py_pair_partial(PyObject *self, PyObject *args) {
    Py_buffer out, golden, target;
    const char *golden_name, *target_name;
    PairOptions options;
    if (!PyArg_ParseTuple(args, "w*y*sy*sddiid", &out, &golden, &golden_name, &target, &target_name,
                          &options.target_scale, &options.zero_eps, &options.ulp_bits, &options.ulp_min_exponent,
                          &options.ulp_floor))
        return NULL;
    Py_ssize_t golden_item = 0, target_item = 0;
    int golden_kind = pair_kind(golden_name, &golden_item), target_kind = pair_kind(target_name, &target_item);
    const char *problem = NULL;
    if (golden_kind < 0 || target_kind < 0)
        problem = "pair_partial: element kinds are f64, f32, f16 or bf16";
    else if (out.len != P_SIZE * (Py_ssize_t)sizeof(double))
        problem = "pair_partial: out holds 20 float64";
    else if (golden.len % golden_item || target.len % target_item || golden.len / golden_item != target.len / target_item)
        problem = "pair_partial: golden and target hold different element counts";
    if (problem == NULL) {
        PairKernel kernel;
        switch (golden_kind) {
            case 0: kernel = pair_kernel_with_target<LoadF64>(target_kind); break;
            case 1: kernel = pair_kernel_with_target<LoadF32>(target_kind); break;
            case 2: kernel = pair_kernel_with_target<LoadF16>(target_kind); break;
            default: kernel = pair_kernel_with_target<LoadBF16>(target_kind); break;
        }
        Py_ssize_t n = golden.len / golden_item;
        Py_BEGIN_ALLOW_THREADS kernel(golden.buf, target.buf, n, options, (double *)out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&golden);
    PyBuffer_Release(&target);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* crc32(data, value=0) -> int: zlib.crc32's CRC-32 (the zip checksum of a dump's .pt files), folded
 * 64 bytes at a time with carry-less multiplies (Intel's PCLMULQDQ folding for the reflected
 * polynomial 0x04C11DB7; constants k = reflect32(x^e mod P) << 1): 10x zlib 1.2's tables, which
 * took a full second core of the dump's writer thread. The 16 folded bytes and the tail are run
 * through the byte table; so is everything on a CPU without PCLMULQDQ. */
static uint32_t crc32_table[256];

static void crc32_table_init(void) {
    for (uint32_t byte = 0; byte < 256; byte++) {
        uint32_t crc = byte;
        for (int bit = 0; bit < 8; bit++) crc = crc & 1 ? (crc >> 1) ^ 0xEDB88320u : crc >> 1;
        crc32_table[byte] = crc;
    }
}

/* The CRC register (no pre/post inversion) after `n` more bytes. */
static uint32_t crc32_bytes(uint32_t crc, const unsigned char *data, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) crc = crc32_table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
    return crc;
}

__attribute__((target("pclmul,sse4.1"))) static inline __m128i crc32_fold(__m128i x, __m128i constants,
                                                                          __m128i next) {
    __m128i low = _mm_clmulepi64_si128(x, constants, 0x00), high = _mm_clmulepi64_si128(x, constants, 0x11);
    return _mm_xor_si128(_mm_xor_si128(low, high), next);
}

/* The register after `n` >= 64 bytes starting from register `crc`. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc32_folded(uint32_t crc, const unsigned char *data,
                                                                      Py_ssize_t n) {
    const __m128i by_four = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);  // x^480, x^544
    const __m128i by_one = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);   // x^96, x^160
    __m128i x0 = _mm_loadu_si128((const __m128i *)data), x1 = _mm_loadu_si128((const __m128i *)(data + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(data + 32)), x3 = _mm_loadu_si128((const __m128i *)(data + 48));
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)crc));  // the register goes into the first bytes
    Py_ssize_t at = 64;
    for (; at + 64 <= n; at += 64) {
        x0 = crc32_fold(x0, by_four, _mm_loadu_si128((const __m128i *)(data + at)));
        x1 = crc32_fold(x1, by_four, _mm_loadu_si128((const __m128i *)(data + at + 16)));
        x2 = crc32_fold(x2, by_four, _mm_loadu_si128((const __m128i *)(data + at + 32)));
        x3 = crc32_fold(x3, by_four, _mm_loadu_si128((const __m128i *)(data + at + 48)));
    }
    __m128i x = crc32_fold(crc32_fold(crc32_fold(x0, by_one, x1), by_one, x2), by_one, x3);
    for (; at + 16 <= n; at += 16) x = crc32_fold(x, by_one, _mm_loadu_si128((const __m128i *)(data + at)));
    unsigned char folded[16];
    _mm_storeu_si128((__m128i *)folded, x);
    return crc32_bytes(crc32_bytes(0, folded, 16), data + at, n - at);  // same remainder as all bytes so far
}

static PyObject *py_crc32(PyObject *self, PyObject *args) {
    static bool ready = false;
    if (!ready) crc32_table_init(), ready = true;
    static const bool pclmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    Py_buffer data;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &data, &value)) return NULL;
    const unsigned char *bytes = (const unsigned char *)data.buf;
    uint32_t crc = ~(uint32_t)value;
    Py_BEGIN_ALLOW_THREADS crc = pclmul && data.len >= 64 ? crc32_folded(crc, bytes, data.len)
                                                          : crc32_bytes(crc, bytes, data.len);
    Py_END_ALLOW_THREADS PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(~crc);
}

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "CRC-32C (Castagnoli) of a bytes-like object."},
    {"fill_float32", py_fill_float32, METH_VARARGS, "A template's bytes with float32 values written at the holes."},
    {"crc32", py_crc32, METH_VARARGS, "zlib.crc32(data, value=0), folded with PCLMULQDQ."},
    {"stats", py_stats, METH_VARARGS, "One-pass (max, min, sum, sumsq, finite) of a strided host tensor, or None."},
    {"pair_partial", py_pair_partial, METH_VARARGS, "Merge the metrics partial of a golden and a target chunk into out, in one pass."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stats", NULL, -1, methods};

extern "C" PyMODINIT_FUNC PyInit__stats(void) { return PyModule_Create(&module); }
