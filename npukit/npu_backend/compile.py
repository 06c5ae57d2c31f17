"""torch.compile on the emulated NPU: the dynamo backend "npu" and the default backend on npu tensors.

`torch.compile(model, backend="npu")` (the name torch_npu registers) captures the model with
dynamo, traces forward and backward with AOTAutograd (functionalised joint graph, partitioned
into a forward and a backward graph) and runs both graphs with the device's own kernels, so every
numeric policy of the device (fp16 saturation, fp32 accumulation, HF32) applies to compiled code
exactly as to eager code, and compiled results equal eager results.

The default backend, inductor, has no code generator for the npu device (its CPU code generator
assumes CPU tensors, its GPU one Triton). A graph whose tensors live on npu is therefore
compiled by the "npu" backend above; graphs on other devices go to inductor unchanged. Graph
capture backends ("npugraph_ex", "npugraphs") are not registered: NPU graph capture needs the
real device runtime.

Registration is lazy, because importing torch._dynamo costs seconds: `install()` (run by
`import npukit.npu_backend`) wraps `torch.compile` so the first call registers the backend.
Code that uses `torch._dynamo.optimize("npu")` without torch.compile calls `register()` first.
"""

from __future__ import annotations

import functools
import sys

import torch

BACKEND_NAME = "npu"
_registered = False
_compile_wrapped = False


def _run_graph_on_device(graph_module: torch.fx.GraphModule, example_inputs):
    """AOTAutograd forward/backward compiler: the graph runs op by op on the device's kernels."""
    from functorch.compile import make_boxed_func

    return make_boxed_func(graph_module.forward)


def npu_backend(graph_module: torch.fx.GraphModule, example_inputs, **kwargs):
    """The dynamo backend "npu": AOTAutograd-traced forward and backward graphs on the device."""
    from torch._dynamo.backends.common import aot_autograd

    compiler = aot_autograd(fw_compiler=_run_graph_on_device, bw_compiler=_run_graph_on_device,
                            keep_inference_input_mutations=True)
    return compiler(graph_module, example_inputs, **kwargs)


def graph_uses_npu(graph_module: torch.fx.GraphModule, example_inputs) -> bool:
    """Does any input or intermediate value of the captured graph live on an npu device?"""
    values = [value for value in example_inputs if isinstance(value, torch.Tensor)]
    values += [node.meta.get("example_value", node.meta.get("val")) for node in graph_module.graph.nodes]
    return any(isinstance(value, torch.Tensor) and value.device.type == "npu" for value in values)


def _route_npu_graphs_away_from_inductor() -> None:
    """Both doors into inductor: torch.compile's default wrapper and the registry's "inductor"."""
    import torch._dynamo.backends.inductor  # noqa: F401  (registers "inductor")
    from torch._dynamo.backends.registry import _COMPILER_FNS

    registry_inductor = _COMPILER_FNS["inductor"]

    @functools.wraps(registry_inductor)
    def inductor(graph_module, example_inputs, **kwargs):
        if graph_uses_npu(graph_module, example_inputs):
            return npu_backend(graph_module, example_inputs)
        return registry_inductor(graph_module, example_inputs, **kwargs)

    _COMPILER_FNS["inductor"] = inductor

    wrapper_cls = torch._TorchCompileInductorWrapper
    inductor_call = wrapper_cls.__call__

    @functools.wraps(inductor_call)
    def __call__(self, model_, inputs_, *args, **kwargs):
        if graph_uses_npu(model_, inputs_):
            return npu_backend(model_, inputs_)
        return inductor_call(self, model_, inputs_, *args, **kwargs)

    wrapper_cls.__call__ = __call__


def register() -> None:
    """Register the "npu" dynamo backend and route npu graphs of the default backend to it (idempotent)."""
    global _registered
    if _registered:
        return
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if BACKEND_NAME not in _COMPILER_FNS:
        register_backend(npu_backend, name=BACKEND_NAME)
    _route_npu_graphs_away_from_inductor()
    _registered = True


def install() -> None:
    """Make torch.compile register the backend on first use (cheap: torch._dynamo is not imported)."""
    global _compile_wrapped
    if "torch._dynamo" in sys.modules:
        register()
        return
    if _compile_wrapped:
        return
    stock_compile = torch.compile

    @functools.wraps(stock_compile)
    def compile(*args, **kwargs):
        register()
        return stock_compile(*args, **kwargs)

    torch.compile = compile
    _compile_wrapped = True
