/* host_stats(tensor, npu_in_host_memory): the statistics of a plain float tensor in host memory in
 * one call, its dtype, layout, device, sizes and strides read from the tensor in C++.
 *
 * The monitor and the dump measure a tensor in a hook, which runs cache-cold after the op or the
 * backward before it: reading those fields from Python (dtype, layout, is_nested, device,
 * data_ptr, shape, stride, numel: each a different getter) cost ~30 us there, more than the
 * statistics of a small tensor. The kernels are stats.cpp's (stats_kernels.h).
 *
 * Also here: record_host_stats, the monitor's _add in one call; adam_host_stats, the monitor's statistics
 * of Adam's state; and csv_rows, its monitor.csv rows of a step with each float's Python repr.
 */
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <charconv>
#include <string>

#include "stats_kernels.h"

/* A defined, strided, not nested tensor whose data is in host memory: on the CPU, or on the emulated
 * NPU (PrivateUse1), which keeps its tensors there when npukit's backend made them. */
static bool strided_in_host_memory(const at::Tensor &tensor, int npu_in_host_memory) {
    if (!tensor.defined() || tensor.layout() != at::kStrided || tensor.is_nested()) return false;
    c10::DeviceType device = tensor.device().type();
    return device == c10::DeviceType::CPU || (npu_in_host_memory && device == c10::DeviceType::PrivateUse1);
}

/* [max, min, mean, norm, 0.0, 0.0] (tensor_stats' values), or None when the fast path does not
 * apply: a subclass, a sparse, nested or empty tensor, another device or dtype, a layout the
 * strided walk cannot take, or a nan/inf (whose counts torch's reductions give). */
static PyObject *host_stats_of(PyObject *object, int npu_in_host_memory) {
    if (!THPVariable_CheckExact(object)) Py_RETURN_NONE;  // torch.Tensor or Parameter, no subclass
    const at::Tensor &tensor = THPVariable_Unpack(object);
    if (!strided_in_host_memory(tensor, npu_in_host_memory)) Py_RETURN_NONE;
    RunKernel kernel;
    Py_ssize_t item;
    switch (tensor.scalar_type()) {
        case at::kFloat: kernel = run_f32, item = 4; break;
        case at::kBFloat16: kernel = run_bf16, item = 2; break;
        case at::kHalf: kernel = run_f16, item = 2; break;
        default: Py_RETURN_NONE;
    }
    int64_t count = tensor.numel();
    if (count == 0 || !tensor.has_storage() || tensor.data_ptr() == nullptr) Py_RETURN_NONE;
    std::vector<Py_ssize_t> sizes(tensor.sizes().begin(), tensor.sizes().end());
    std::vector<Py_ssize_t> strides(tensor.strides().begin(), tensor.strides().end());
    const char *data = (const char *)tensor.data_ptr();
    Stats result = {0, 0, 0, 0};
    bool walked;
    Py_BEGIN_ALLOW_THREADS walked = strided_stats(data, item, kernel, sizes, strides, &result);
    Py_END_ALLOW_THREADS
    if (!walked || !isfinite(result.sum) || !isfinite(result.sumsq)) Py_RETURN_NONE;
    return Py_BuildValue("[dddddd]", result.max, result.min, result.sum / (double)count, sqrt(result.sumsq), 0.0,
                         0.0);
}

static PyObject *py_host_stats(PyObject *self, PyObject *args) {
    PyObject *object;
    int npu_in_host_memory;
    if (!PyArg_ParseTuple(args, "Op", &object, &npu_in_host_memory)) return NULL;
    return host_stats_of(object, npu_in_host_memory);
}

/* record_host_stats(measured, slots, kind, name, tensor, npu_in_host_memory) -> True when the tensor's
 * statistics were appended to slots as (kind, name, dtype, statistics): the monitor's _add in one call
 * for a plain float host tensor, the fields it reads (version, dtype) read here. A tensor already in
 * measured ({id: (weak reference, version, statistics)}) as the same object at the same version takes
 * the statistics found there; one measured now (host_stats_of) is put there. False, nothing changed:
 * the caller's general path (another device or dtype, nan/inf, an inference tensor's missing version
 * counter, which that path reports). A hook runs cache-cold: each field read and call made from Python
 * there cost microseconds. */
static PyObject *py_record_host_stats(PyObject *self, PyObject *args) {
    PyObject *measured, *slots, *kind, *name, *object;
    int npu_in_host_memory;
    if (!PyArg_ParseTuple(args, "O!O!OOOp", &PyDict_Type, &measured, &PyList_Type, &slots, &kind, &name, &object,
                          &npu_in_host_memory))
        return NULL;
    if (!THPVariable_CheckExact(object)) Py_RETURN_FALSE;
    const at::Tensor &tensor = THPVariable_Unpack(object);
    int64_t version;
    try {
        version = tensor._version();
    } catch (const c10::Error &) {  // an inference tensor: no version counter
        Py_RETURN_FALSE;
    }
    PyObject *key = PyLong_FromVoidPtr(object);  // id(tensor)
    if (key == NULL) return NULL;
    PyObject *statistics = NULL;  // new reference
    PyObject *seen = PyDict_GetItemWithError(measured, key);  // borrowed
    if (seen == NULL && PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    if (seen != NULL && PyTuple_Check(seen) && PyTuple_GET_SIZE(seen) == 3 &&
        PyWeakref_GetObject(PyTuple_GET_ITEM(seen, 0)) == object &&
        PyLong_AsLongLong(PyTuple_GET_ITEM(seen, 1)) == version) {
        statistics = Py_NewRef(PyTuple_GET_ITEM(seen, 2));
    } else {
        if (PyErr_Occurred()) {  // a version that is no integer: not ours to judge
            Py_DECREF(key);
            return NULL;
        }
        statistics = host_stats_of(object, npu_in_host_memory);
        if (statistics == NULL || statistics == Py_None) {
            Py_DECREF(key);
            if (statistics == NULL) return NULL;
            Py_DECREF(statistics);
            Py_RETURN_FALSE;
        }
        PyObject *reference = PyWeakref_NewRef(object, NULL);
        PyObject *entry = reference == NULL ? NULL : Py_BuildValue("(NLO)", reference, (long long)version, statistics);
        if (entry == NULL || PyDict_SetItem(measured, key, entry) < 0) {
            Py_XDECREF(entry);
            Py_DECREF(statistics);
            Py_DECREF(key);
            return NULL;
        }
        Py_DECREF(entry);
    }
    Py_DECREF(key);
    PyObject *slot = Py_BuildValue("(OOON)", kind, name, (PyObject *)torch::getTHPDtype(tensor.scalar_type()),
                                   statistics);
    if (slot == NULL) return NULL;
    int appended = PyList_Append(slots, slot);
    Py_DECREF(slot);
    if (appended < 0) return NULL;
    Py_RETURN_TRUE;
}

/* A contiguous float32 tensor with data in host memory (no subclass), or nullptr. */
static const at::Tensor *contiguous_host_float32(PyObject *object, int npu_in_host_memory) {
    if (!THPVariable_CheckExact(object)) return nullptr;
    const at::Tensor &tensor = THPVariable_Unpack(object);
    if (!strided_in_host_memory(tensor, npu_in_host_memory) || tensor.scalar_type() != at::kFloat ||
        !tensor.is_contiguous() || tensor.numel() == 0 || !tensor.has_storage() || tensor.data_ptr() == nullptr)
        return nullptr;
    return &tensor;
}

/* adam_host_stats(m, v, eps, npu_in_host_memory) -> ([m's max, min, mean, norm, 0, 0], [v's], the norm
 * of m / (sqrt(v) + eps)) from one read of Adam's state (adam_kernel), or None where torch's ops
 * measure it: not contiguous float32 host tensors of one shape, or nan/inf in them. The monitor
 * calls it for each parameter after optimizer.step(): its checks made from Python (dtype, shape,
 * contiguity, device, data_ptr and numel of both) cost more than the kernel on small parameters. */
static PyObject *py_adam_host_stats(PyObject *self, PyObject *args) {
    PyObject *m_object, *v_object;
    float eps;
    int npu_in_host_memory;
    if (!PyArg_ParseTuple(args, "OOfp", &m_object, &v_object, &eps, &npu_in_host_memory)) return NULL;
    const at::Tensor *m = contiguous_host_float32(m_object, npu_in_host_memory);
    const at::Tensor *v = contiguous_host_float32(v_object, npu_in_host_memory);
    if (m == nullptr || v == nullptr || m->sizes() != v->sizes()) Py_RETURN_NONE;
    int64_t count = m->numel();
    const float *m_data = (const float *)m->data_ptr(), *v_data = (const float *)v->data_ptr();
    Stats m_stats, v_stats;
    double update_sumsq;
    Py_BEGIN_ALLOW_THREADS adam_kernel(m_data, v_data, count, eps, &m_stats, &v_stats, &update_sumsq);
    Py_END_ALLOW_THREADS
    if (!isfinite(m_stats.sum) || !isfinite(m_stats.sumsq) || !isfinite(v_stats.sum) || !isfinite(v_stats.sumsq) ||
        !isfinite(update_sumsq))
        Py_RETURN_NONE;
    return Py_BuildValue("([dddddd][dddddd]d)", m_stats.max, m_stats.min, m_stats.sum / (double)count,
                         sqrt(m_stats.sumsq), 0.0, 0.0, v_stats.max, v_stats.min, v_stats.sum / (double)count,
                         sqrt(v_stats.sumsq), 0.0, 0.0, sqrt(update_sumsq));
}

/* repr(value) of a finite double, as Python writes it (float_repr_style 'short'): the shortest
 * digits that read back to the value (std::to_chars gives those, as Python's dtoa mode 0 does),
 * laid out in positional notation with ".0" when the decimal point's place (decpt, the value being
 * 0.DIGITS x 10^decpt) is within -4 < decpt <= 16, otherwise as D[.DIGITS]e+XX. */
static void append_float_repr(std::string &out, double value) {
    char buffer[40];
    const char *end = std::to_chars(buffer, buffer + sizeof buffer, value, std::chars_format::scientific).ptr;
    const char *p = buffer;
    if (*p == '-') out += '-', p++;
    char digits[24];  // the significant digits, without the point: at most 17
    int count = 0;
    for (; *p != 'e'; p++)
        if (*p != '.') digits[count++] = *p;
    bool negative = p[1] == '-';
    int exponent = 0;  // value = D.DDD x 10^exponent
    for (p += 2; p < end; p++) exponent = exponent * 10 + (*p - '0');
    if (negative) exponent = -exponent;
    int decpt = exponent + 1;
    if (decpt <= -4 || decpt > 16) {
        out += digits[0];
        if (count > 1) out += '.', out.append(digits + 1, count - 1);
        out += negative ? "e-" : "e+";
        int magnitude = negative ? -exponent : exponent;
        if (magnitude < 10) out += '0';
        out += std::to_string(magnitude);
    } else if (decpt <= 0) {
        out += "0.";
        out.append(-decpt, '0');
        out.append(digits, count);
    } else if (decpt >= count) {
        out.append(digits, count);
        out.append(decpt - count, '0');
        out += ".0";
    } else {
        out.append(digits, decpt);
        out += '.';
        out.append(digits + decpt, count - decpt);
    }
}

/* csv_rows(step, prefixes, values): the monitor.csv rows of a step as csv.writer writes them, one
 * per prefix ("kind,name,dtype,"): "step,prefix" + its STATS values, repr each (as csv.writer writes
 * floats), "\r\n". Formatting the values was most of the monitor writer's time in Python (a float's
 * repr ~0.4 us there). A value that is not a finite float is written with its own repr. */
static PyObject *py_csv_rows(PyObject *self, PyObject *args) {
    const char *step;
    PyObject *prefixes, *values;
    int per_row;
    if (!PyArg_ParseTuple(args, "sO!O!i", &step, &PyList_Type, &prefixes, &PyList_Type, &values, &per_row))
        return NULL;
    Py_ssize_t rows = PyList_GET_SIZE(prefixes);
    if (per_row < 1 || PyList_GET_SIZE(values) != rows * per_row) {
        PyErr_Format(PyExc_ValueError, "csv_rows: %zd values for %zd rows of %d", PyList_GET_SIZE(values), rows,
                     per_row);
        return NULL;
    }
    std::string out;
    out.reserve(rows * (48 + 24 * per_row));
    for (Py_ssize_t row = 0; row < rows; row++) {
        PyObject *prefix = PyList_GET_ITEM(prefixes, row);
        Py_ssize_t length;
        const char *text = PyUnicode_Check(prefix) ? PyUnicode_AsUTF8AndSize(prefix, &length) : NULL;
        if (text == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "csv_rows: a prefix is not a str");
            return NULL;
        }
        out += step;
        out += ',';
        out.append(text, length);
        for (int column = 0; column < per_row; column++) {
            if (column) out += ',';
            PyObject *value = PyList_GET_ITEM(values, row * per_row + column);
            double number = PyFloat_CheckExact(value) ? PyFloat_AS_DOUBLE(value) : NAN;
            if (isfinite(number)) {
                append_float_repr(out, number);
                continue;
            }
            PyObject *shown = PyObject_Repr(value);
            if (shown == NULL) return NULL;
            const char *shown_text = PyUnicode_AsUTF8AndSize(shown, &length);
            if (shown_text == NULL) {
                Py_DECREF(shown);
                return NULL;
            }
            out.append(shown_text, length);
            Py_DECREF(shown);
        }
        out += "\r\n";
    }
    return PyUnicode_DecodeUTF8(out.data(), (Py_ssize_t)out.size(), NULL);
}

static PyMethodDef methods[] = {
    {"csv_rows", py_csv_rows, METH_VARARGS,
     "csv_rows(step, prefixes, values, per_row) -> the rows 'step,prefix,v1,...' csv.writer writes, floats as repr."},
    {"adam_host_stats", py_adam_host_stats, METH_VARARGS,
     "(m's statistics, v's, the norm of m / (sqrt(v) + eps)) of Adam's fp32 host state in one read, or None."},
    {"record_host_stats", py_record_host_stats, METH_VARARGS,
     "record_host_stats(measured, slots, kind, name, tensor, npu_in_host_memory) -> True when recorded (the "
     "monitor's _add for a plain float host tensor), False: take the general path."},
    {"host_stats", py_host_stats, METH_VARARGS,
     "[max, min, mean, norm, 0, 0] of a plain float tensor in host memory, or None (take the general path)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tensor_stats", NULL, -1, methods};

extern "C" PyMODINIT_FUNC PyInit__tensor_stats(void) { return PyModule_Create(&module); }
