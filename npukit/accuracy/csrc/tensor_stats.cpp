/* host_stats(tensor, npu_in_host_memory): the statistics of a plain float tensor in host memory in
 * one call, its dtype, layout, device, sizes and strides read from the tensor in C++.
 *
 * The monitor and the dump measure a tensor in a hook, which runs cache-cold after the op or the
 * backward before it: reading those fields from Python (dtype, layout, is_nested, device,
 * data_ptr, shape, stride, numel: each a different getter) cost ~30 us there, more than the
 * statistics of a small tensor. The kernels are stats.cpp's (stats_kernels.h).
 */
#include <torch/csrc/autograd/python_variable.h>

#include "stats_kernels.h"

/* [max, min, mean, norm, 0.0, 0.0] (tensor_stats' values), or None when the fast path does not
 * apply: a subclass, a sparse, nested or empty tensor, another device or dtype, a layout the
 * strided walk cannot take, or a nan/inf (whose counts torch's reductions give). */
static PyObject *py_host_stats(PyObject *self, PyObject *args) {
    PyObject *object;
    int npu_in_host_memory;
    if (!PyArg_ParseTuple(args, "Op", &object, &npu_in_host_memory)) return NULL;
    if (!THPVariable_CheckExact(object)) Py_RETURN_NONE;  // torch.Tensor or Parameter, no subclass
    const at::Tensor &tensor = THPVariable_Unpack(object);
    if (!tensor.defined() || tensor.layout() != at::kStrided || tensor.is_nested()) Py_RETURN_NONE;
    c10::DeviceType device = tensor.device().type();
    // the emulated NPU (PrivateUse1) keeps its tensors in host memory when npukit's backend made them
    if (!(device == c10::DeviceType::CPU || (npu_in_host_memory && device == c10::DeviceType::PrivateUse1)))
        Py_RETURN_NONE;
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

static PyMethodDef methods[] = {
    {"host_stats", py_host_stats, METH_VARARGS,
     "[max, min, mean, norm, 0, 0] of a plain float tensor in host memory, or None (take the general path)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tensor_stats", NULL, -1, methods};

extern "C" PyMODINIT_FUNC PyInit__tensor_stats(void) { return PyModule_Create(&module); }
