// The legacy typed tensor classes torch.npu.FloatTensor, torch.npu.HalfTensor, ... made the
// way torch_npu makes them (torch_npu/csrc/utils/TensorType.cpp): real type objects of a
// "torch.tensortype" metaclass, whose constructor is torch's legacy tensor constructor for the
// PrivateUse1 dispatch key, whose isinstance check compares dispatch key and dtype, and whose
// tp_name is "torch.npu.<Scalar>Tensor" (so `t.type(torch.npu.HalfTensor)` resolves by name).
//
// Like torch_npu's, these objects are not in torch's own list of PyTensorTypes, so torch's
// py_set_default_tensor_type rejects them ("invalid type object: only floating-point types are
// supported as the default type"): `torch.set_default_tensor_type(torch.npu.HalfTensor)` fails
// on the emulated device exactly as it does with torch_npu on an Ascend host.

#include <torch/extension.h>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/utils/wrap_outputs.h>
#include <torch/csrc/utils/tensor_new.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

namespace npukit {

extern std::atomic<int> g_device_count;

namespace {

// The layout of torch_npu's PyTensorType (py_type must come first).
struct PyTensorType {
  PyTypeObject py_type;
  THPDtype* dtype;
  THPLayout* layout;
  bool is_npu;
  char name[64];
  int backend;
  int scalar_type;

  c10::ScalarType get_scalar_type() const { return static_cast<c10::ScalarType>(scalar_type); }
};

static_assert(std::is_standard_layout<PyTensorType>::value, "PyTensorType must be standard layout");

PyObject* Tensor_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  HANDLE_TH_ERRORS
  auto& tensor_type = *reinterpret_cast<PyTensorType*>(type);
  TORCH_WARN_ONCE(
      "Warning: The torch.npu.*DtypeTensor constructors are no longer recommended. "
      "It's best to use methods such as torch.tensor(data, dtype=*, device='npu') to create tensors.");
  TORCH_CHECK_TYPE(g_device_count.load() != 0, "type ", tensor_type.name,
                   " not available. Torch not compiled with npu enabled.");
  return THPVariable_Wrap(torch::utils::legacy_tensor_ctor(
      c10::DispatchKey::PrivateUse1, tensor_type.get_scalar_type(), args, kwargs));
  END_HANDLE_TH_ERRORS
}

PyObject* Tensor_instancecheck(PyObject* self, PyObject* arg) {
  HANDLE_TH_ERRORS
  auto& tensor_type = *reinterpret_cast<PyTensorType*>(self);
  if (THPVariable_Check(arg)) {
    const auto& var = THPVariable_Unpack(arg);
    if (c10::legacyExtractDispatchKey(var.key_set()) == c10::DispatchKey::PrivateUse1 &&
        var.scalar_type() == tensor_type.get_scalar_type()) {
      Py_RETURN_TRUE;
    }
  }
  Py_RETURN_FALSE;
  END_HANDLE_TH_ERRORS
}

PyObject* Tensor_dtype(PyObject* self, void*) {
  return torch::autograd::utils::wrap(reinterpret_cast<PyTensorType*>(self)->dtype);
}

PyObject* Tensor_layout(PyObject* self, void*) {
  return torch::autograd::utils::wrap(reinterpret_cast<PyTensorType*>(self)->layout);
}

PyObject* Tensor_is_npu(PyObject* self, void*) {
  return PyBool_FromLong(reinterpret_cast<PyTensorType*>(self)->is_npu);
}

PyObject* Tensor_is_sparse(PyObject* self, void*) {
  return PyBool_FromLong(reinterpret_cast<PyTensorType*>(self)->layout->layout != at::Layout::Strided);
}

PyMethodDef metaclass_methods[] = {
    {"__instancecheck__", Tensor_instancecheck, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef metaclass_properties[] = {
    {"dtype", Tensor_dtype, nullptr, nullptr, nullptr},
    {"layout", Tensor_layout, nullptr, nullptr, nullptr},
    {"is_npu", Tensor_is_npu, nullptr, nullptr, nullptr},
    {"is_sparse", Tensor_is_sparse, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject metaclass = {
    PyVarObject_HEAD_INIT(nullptr, 0) "torch.tensortype", /* tp_name */
    sizeof(PyTypeObject) /* tp_basicsize */
};

PyTypeObject tensor_type_prototype = {
    PyVarObject_HEAD_INIT(&metaclass, 0) nullptr, /* tp_name */
    sizeof(PyTensorType) /* tp_basicsize */
};

// The methods of torch.Tensor, copied onto each type (torch.npu.FloatTensor.add exists).
THPObjectPtr tensor_dict() {
  THPObjectPtr torch_module(PyImport_ImportModule("torch"));
  if (!torch_module) throw python_error();
  THPObjectPtr tensor_class(PyObject_GetAttrString(torch_module.get(), "Tensor"));
  if (!tensor_class) throw python_error();
  auto tensor_type = reinterpret_cast<PyTypeObject*>(tensor_class.get());
  TORCH_CHECK(tensor_type->tp_base, "missing base type for Tensor");
  THPObjectPtr dict(PyDict_New());
  if (!dict) throw python_error();
  if (PyDict_Merge(dict.get(), tensor_type->tp_dict, 0) < 0) throw python_error();
  if (PyDict_Merge(dict.get(), tensor_type->tp_base->tp_dict, 0) < 0) throw python_error();
  return dict;
}

// Never freed, like torch's own PyTensorTypes: they live as long as the process and must
// still be valid in atexit handlers and global destructors.
std::vector<PyTensorType*> g_tensor_types;

}  // namespace

py::list legacy_tensor_types() {
  if (g_tensor_types.empty()) {
    metaclass.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE;
    metaclass.tp_methods = metaclass_methods;
    metaclass.tp_getset = metaclass_properties;
    metaclass.tp_base = &PyType_Type;
    if (PyType_Ready(&metaclass) < 0) throw python_error();

    auto dict = tensor_dict();
    // torch_npu's list (all_declared_types_npu), in its order.
    for (auto scalar_type : {c10::ScalarType::Byte, c10::ScalarType::Char, c10::ScalarType::Double,
                             c10::ScalarType::Float, c10::ScalarType::Int, c10::ScalarType::Long,
                             c10::ScalarType::Short, c10::ScalarType::Half, c10::ScalarType::Bool,
                             c10::ScalarType::BFloat16}) {
      auto* type = new PyTensorType();
      type->backend = static_cast<int>(c10::Backend::PrivateUse1);
      type->scalar_type = static_cast<int>(scalar_type);
      type->layout = torch::getTHPLayout(at::Layout::Strided);
      type->dtype = torch::getTHPDtype(scalar_type);
      type->is_npu = true;
      std::string name = std::string("torch.npu.") + c10::toString(scalar_type) + "Tensor";
      std::strncpy(type->name, name.c_str(), sizeof(type->name));
      type->name[sizeof(type->name) - 1] = '\0';

      PyTypeObject& py_type = type->py_type;
      std::memcpy(&py_type, &tensor_type_prototype, sizeof(PyTypeObject));
      // Subclassing torch.npu.<Scalar>Tensor is not supported (no Py_TPFLAGS_BASETYPE).
      py_type.tp_flags = Py_TPFLAGS_DEFAULT;
      py_type.tp_name = type->name;
      py_type.tp_new = Tensor_new;
      if (PyType_Ready(&py_type) < 0) throw python_error();
      if (PyDict_Merge(py_type.tp_dict, dict.get(), 0) < 0) throw python_error();
      g_tensor_types.push_back(type);
    }
  }
  py::list types;
  for (auto* type : g_tensor_types) {
    types.append(py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(type)));
  }
  return types;
}

}  // namespace npukit
