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

/* load8 turns 8 elements of the buffer's type into floats. */
#define DEFINE_FLOAT_KERNEL(NAME, TYPE, LOAD8, TO_FLOAT)                                        \
    __attribute__((target_clones("avx2", "default"))) static Stats NAME(const TYPE *data,     \
                                                                        Py_ssize_t n) {       \
        Stats out;                                                                             \
        float first = TO_FLOAT(data[0]);                                                       \
        v8f vmax = {first, first, first, first, first, first, first, first};                   \
        v8f vmin = vmax;                                                                       \
        double sum = 0, sumsq = 0;                                                             \
        Py_ssize_t i = 0;                                                                      \
        while (i + LANES <= n) {                                                               \
            v8f vsum = {0}, vsq = {0};                                                         \
            Py_ssize_t end = i + (Py_ssize_t)LANES * BLOCK;                                    \
            if (end > n) end = n - (n - i) % LANES;                                            \
            for (; i < end; i += LANES) {                                                      \
                v8f v;                                                                         \
                LOAD8(v, data + i, TO_FLOAT);                                                  \
                vmax = v > vmax ? v : vmax;                                                    \
                vmin = v < vmin ? v : vmin;                                                    \
                vsum += v;                                                                     \
                vsq += v * v;                                                                  \
            }                                                                                  \
            sum += lane_sum(vsum);                                                             \
            sumsq += lane_sum(vsq);                                                            \
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

DEFINE_FLOAT_KERNEL(stats_f32, float, LOAD_F32, F32_TO_FLOAT)
DEFINE_FLOAT_KERNEL(stats_bf16, uint16_t, LOAD_CONVERTED, bf16_to_float)
DEFINE_FLOAT_KERNEL(stats_f16, uint16_t, LOAD_CONVERTED, f16_to_float)

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

static void adam_kernel(const float *m, const float *v, Py_ssize_t n, float eps, Stats *m_out, Stats *v_out,
                        double *update_sumsq) {
    static const bool avx2 = __builtin_cpu_supports("avx2");
    (avx2 ? adam_kernel_avx2 : adam_kernel_default)(m, v, n, eps, m_out, v_out, update_sumsq);
}

/* adam_stats(m_address, v_address, n, eps) -> (m's max, min, sum, sumsq, v's max, min, sum, sumsq,
 * sum of (m / (sqrt(v) + eps))^2, finite): m and v contiguous float32 host tensors of n > 0 elements.
 * finite is false when a sum is not (nan/inf in the state): the caller takes torch's path then. */
static PyObject *py_adam_stats(PyObject *self, PyObject *args) {
    unsigned long long m_address, v_address;
    Py_ssize_t n;
    float eps;
    if (!PyArg_ParseTuple(args, "KKnf", &m_address, &v_address, &n, &eps)) return NULL;
    if (n <= 0 || m_address == 0 || v_address == 0) {
        PyErr_SetString(PyExc_ValueError, "adam_stats: no data");
        return NULL;
    }
    Stats m_stats, v_stats;
    double update_sumsq;
    Py_BEGIN_ALLOW_THREADS adam_kernel((const float *)(uintptr_t)m_address, (const float *)(uintptr_t)v_address, n,
                                       eps, &m_stats, &v_stats, &update_sumsq);
    Py_END_ALLOW_THREADS
    int finite = isfinite(m_stats.sum) && isfinite(m_stats.sumsq) && isfinite(v_stats.sum) &&
                 isfinite(v_stats.sumsq) && isfinite(update_sumsq);
    return Py_BuildValue("dddddddddO", m_stats.max, m_stats.min, m_stats.sum, m_stats.sumsq, v_stats.max, v_stats.min,
                         v_stats.sum, v_stats.sumsq, update_sumsq, finite ? Py_True : Py_False);
}

/* crc32c(data) -> int: CRC-32C (Castagnoli), as TFRecord files checksum their records (the
 * monitor's TensorBoard events). Byte-wise from a table: ~1 GB/s, a step's event in microseconds. */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    static uint32_t table[256];
    static bool ready = false;
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
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < data.len; i++) crc = table[(crc ^ bytes[i]) & 0xFF] ^ (crc >> 8);
    Py_END_ALLOW_THREADS PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc ^ 0xFFFFFFFFu);
}

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "CRC-32C (Castagnoli) of a bytes-like object."},
    {"stats", py_stats, METH_VARARGS, "One-pass (max, min, sum, sumsq, finite) of a strided host tensor, or None."},
    {"adam_stats", py_adam_stats, METH_VARARGS, "One-pass statistics of Adam's m and v and the update's sum of squares."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stats", NULL, -1, methods};

extern "C" PyMODINIT_FUNC PyInit__stats(void) { return PyModule_Create(&module); }
