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
#include <math.h>
#include <stdint.h>
#include <string.h>

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
                LOAD8(v, data + i);                                                            \
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

#define LOAD_F32(v, p) memcpy(&(v), (p), sizeof(v8f))
#define F32_TO_FLOAT(x) (x)

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

#define LOAD_BF16(v, p)                                                                        \
    do {                                                                                       \
        for (int lane = 0; lane < LANES; lane++) (v)[lane] = bf16_to_float((p)[lane]);         \
    } while (0)

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

#define LOAD_F16(v, p)                                                                         \
    do {                                                                                       \
        for (int lane = 0; lane < LANES; lane++) (v)[lane] = f16_to_float((p)[lane]);          \
    } while (0)

DEFINE_FLOAT_KERNEL(stats_f32, float, LOAD_F32, F32_TO_FLOAT)
DEFINE_FLOAT_KERNEL(stats_bf16, uint16_t, LOAD_BF16, bf16_to_float)
DEFINE_FLOAT_KERNEL(stats_f16, uint16_t, LOAD_F16, f16_to_float)

/* stats(address, numel, kind) -> (max, min, sum, sumsq, finite)
 * kind: "f32", "f16" or "bf16". address: data_ptr() of a live, contiguous host tensor. */
static PyObject *py_stats(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t n;
    const char *kind;
    if (!PyArg_ParseTuple(args, "Kns", &address, &n, &kind)) return NULL;
    if (n <= 0 || address == 0) {
        PyErr_SetString(PyExc_ValueError, "stats: empty buffer");
        return NULL;
    }
    Stats result = {0, 0, 0, 0};
    const void *data = (const void *)(uintptr_t)address;
    if (strcmp(kind, "f32") == 0) {
        Py_BEGIN_ALLOW_THREADS result = stats_f32((const float *)data, n);
        Py_END_ALLOW_THREADS
    } else if (strcmp(kind, "bf16") == 0) {
        Py_BEGIN_ALLOW_THREADS result = stats_bf16((const uint16_t *)data, n);
        Py_END_ALLOW_THREADS
    } else if (strcmp(kind, "f16") == 0) {
        Py_BEGIN_ALLOW_THREADS result = stats_f16((const uint16_t *)data, n);
        Py_END_ALLOW_THREADS
    } else {
        PyErr_Format(PyExc_ValueError, "stats: unknown element kind %s", kind);
        return NULL;
    }
    int finite = isfinite(result.sum) && isfinite(result.sumsq);
    return Py_BuildValue("ddddO", result.max, result.min, result.sum, result.sumsq,
                         finite ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"stats", py_stats, METH_VARARGS, "One-pass (max, min, sum, sumsq, finite) of a host buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stats", NULL, -1, methods};

extern "C" PyMODINIT_FUNC PyInit__stats(void) { return PyModule_Create(&module); }
