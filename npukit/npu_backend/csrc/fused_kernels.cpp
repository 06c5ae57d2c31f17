// The fused kernels' entry points for fused/*.py (bound as _C.<name>): they take the op's npu (or,
// for the golden reference, CPU) tensors, run the kernel of ATen's CPU capability on their CPU
// aliases and return a new tensor on the same device. The Python op checks the arguments first.
#include "fused_kernels.h"

#include <ATen/OpMathType.h>
#include <ATen/Version.h>
#include <torch/csrc/Dtype.h>
#include <torch/extension.h>

namespace npukit {
at::Tensor cpu_alias(const at::Tensor& t);  // device.cpp
void saturate_half(const at::Tensor& cpu);
}  // namespace npukit

namespace npukit::fused {
namespace {

const Kernels& kernels() {
  static const Kernels chosen = [] {
#if defined(__x86_64__)
    const std::string capability = at::get_cpu_capability();  // ATen's dispatch (ATEN_CPU_CAPABILITY too)
    if (capability == "AVX512") return AVX512::kernels();
    if (capability == "AVX2") return AVX2::kernels();
#endif
    return DEFAULT::kernels();
  }();
  return chosen;
}

// An fp16 result on the npu saturates as every fp16 result of the device does (saturation mode).
void finish(const at::Tensor& result_cpu, const at::Tensor& like) {
  if (like.is_privateuseone()) saturate_half(result_cpu);
}

int64_t product(at::IntArrayRef sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

at::Tensor swiglu_forward(const at::Tensor& x, int64_t dim) {
  auto sizes = x.sizes().vec();
  sizes[dim] /= 2;
  at::Tensor out = at::empty(sizes, x.options());
  const at::Tensor x_cpu = cpu_alias(x).contiguous(), out_cpu = cpu_alias(out);
  {
    pybind11::gil_scoped_release no_gil;
    kernels().swiglu_forward(x_cpu, out_cpu, product(x.sizes().slice(0, dim)),
                             product(at::IntArrayRef(sizes).slice(dim)));
  }
  finish(out_cpu, x);
  return out;
}

at::Tensor swiglu_backward(const at::Tensor& dy, const at::Tensor& x, int64_t dim) {
  if (dy.scalar_type() != x.scalar_type()) {  // computed in x's compute dtype, rounded once
    const auto compute = at::toOpMathType(x.scalar_type());
    return swiglu_backward(dy.to(compute), x.to(compute), dim).to(x.scalar_type());
  }
  at::Tensor dx = at::empty(x.sizes(), x.options());
  const at::Tensor x_cpu = cpu_alias(x).contiguous(), dy_cpu = cpu_alias(dy).contiguous(), dx_cpu = cpu_alias(dx);
  {
    pybind11::gil_scoped_release no_gil;
    kernels().swiglu_backward(dy_cpu, x_cpu, dx_cpu, product(x.sizes().slice(0, dim)), product(dy.sizes().slice(dim)));
  }
  finish(dx_cpu, x);
  return dx;
}

// x * cos + rotate(x) * sin of a 4-dim x, cos/sin broadcasting to it, rounded once to out_dtype.
at::Tensor rotary_mul(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave,
                      at::ScalarType out_dtype) {
  const auto compute = at::promote_types(at::toOpMathType(x.scalar_type()),
                                         at::promote_types(at::toOpMathType(cos.scalar_type()),
                                                           at::toOpMathType(sin.scalar_type())));
  if (at::toOpMathType(x.scalar_type()) != compute || x.scalar_type() != out_dtype) {
    return rotary_mul(x.to(compute), cos, sin, interleave, compute).to(out_dtype);
  }
  auto table = [&](const at::Tensor& t) {
    at::Tensor cpu = cpu_alias(t).to(compute);
    if (cpu.stride(-1) != 1) cpu = cpu.contiguous();
    return cpu.expand(x.sizes());
  };
  const at::Tensor cos_cpu = table(cos), sin_cpu = table(sin);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const at::Tensor x_cpu = cpu_alias(x).contiguous(), out_cpu = cpu_alias(out);
  {
    pybind11::gil_scoped_release no_gil;
    kernels().rotary(x_cpu, cos_cpu, sin_cpu, out_cpu, interleave);
  }
  finish(out_cpu, x);
  return out;
}

// RmsNorm's gradients: dx in x's dtype, dgamma in gamma's (both rounded once).
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& gamma,
                                                     const at::Tensor& rstd) {
  const auto compute = at::toOpMathType(x.scalar_type());
  if (dy.scalar_type() != x.scalar_type()) {
    auto [dx, dgamma] = rms_norm_backward(dy.to(compute), x.to(compute), gamma, rstd);
    return {dx.to(x.scalar_type()), dgamma};
  }
  const int64_t width = gamma.numel(), rows = width ? x.numel() / width : 0;
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dgamma = at::empty(gamma.sizes(), gamma.options().dtype(compute));
  const at::Tensor x_cpu = cpu_alias(x).contiguous(), dy_cpu = cpu_alias(dy).contiguous();
  const at::Tensor gamma_cpu = cpu_alias(gamma).to(compute).contiguous(), rstd_cpu = cpu_alias(rstd).to(compute).contiguous();
  const at::Tensor dx_cpu = cpu_alias(dx), dgamma_cpu = cpu_alias(dgamma);
  {
    pybind11::gil_scoped_release no_gil;
    kernels().rms_norm_backward(dy_cpu, x_cpu, gamma_cpu, rstd_cpu, dx_cpu, dgamma_cpu, rows, width);
  }
  finish(dx_cpu, x);
  return {dx, dgamma.to(gamma.scalar_type())};
}

}  // namespace

void bind(pybind11::module& m) {
  m.def("swiglu_forward", &swiglu_forward, "npu_swiglu's kernel (fused/activations.py)");
  m.def("swiglu_backward", &swiglu_backward, "npu_swiglu_backward's kernel (fused/activations.py)");
  m.def("rms_norm_backward", &rms_norm_backward, "npu_rms_norm_backward's kernel (fused/norms.py)");
  m.def("rotary_mul", [](const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave,
                         const pybind11::object& out_dtype) {
    TORCH_CHECK(THPDtype_Check(out_dtype.ptr()), "rotary_mul: out_dtype must be a torch.dtype");
    return rotary_mul(x, cos, sin, interleave, reinterpret_cast<THPDtype*>(out_dtype.ptr())->scalar_type);
  }, "npu_rotary_mul's kernel and its input gradient's (fused/rotary.py)");
}

}  // namespace npukit::fused
