"""msprobe-compatible entry names, shared by the dump, the compare and the overflow detector.

    Functional.conv2d.0.forward            api call (torch.nn.functional), call index 0
    Tensor.add.1.backward                  backward of the second Tensor.add call
    Torch.matmul.0.forward                 torch.* function
    Module.layer1.0.conv1.Conv2d.forward.0 nn.Module call: path, class, direction, call index
    Module.layer1.0.conv1.Conv2d.parameters_grad.0

Leaves append `.input.0`, `.input.<kwarg>`, `.output.0`, `.parameters.weight` (nested: `.input.0.1`).
"""

from __future__ import annotations

import inspect
import re
import weakref
from collections import defaultdict
from functools import lru_cache

from npukit.accuracy import eager

FORWARD = "forward"
BACKWARD = "backward"
PARAMETERS_GRAD = "parameters_grad"
FOREACH_PREFIX = "_foreach_"  # torch._foreach_add_: one op over lists of tensors

# Tensor methods that only manage autograd/storage bookkeeping: never worth an entry.
_SKIPPED_TENSOR_METHODS = frozenset({
    "backward", "detach", "detach_", "requires_grad_", "retain_grad", "register_hook",
    "register_post_accumulate_grad_hook", "data_ptr", "storage", "untyped_storage", "_typed_storage",
    "__deepcopy__", "__reduce_ex__", "__setstate__", "__getstate__", "__torch_function__",
    "__get__", "__set__", "__delete__", "_make_subclass", "as_subclass", "__iter__", "__len__",
    "__repr__", "__format__", "__hash__", "__bool__", "tolist", "item", "numpy", "size", "dim", "stride",
    "numel", "element_size", "is_contiguous", "is_floating_point", "is_complex", "__dlpack__",
    "__dlpack_device__", "__array__", "__index__", "__int__", "__float__", "__contains__", "share_memory_",
    "pin_memory", "record_stream", "__setitem__",
})

_NAMESPACE_PREFIX = {"torch": "Torch", "torch.functional": "Torch", "torch.nn.functional": "Functional"}


@lru_cache(maxsize=1)
def api_name_table() -> dict:
    """Map each overridable torch function object to its msprobe api name ("Functional.relu")."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import get_overridable_functions

    table: dict = {}
    functions = get_overridable_functions()

    def add(namespace_funcs, prefix, name_prefix=""):
        for func in namespace_funcs:
            name = getattr(func, "__name__", None)
            if not name or name in _SKIPPED_TENSOR_METHODS:
                continue
            table.setdefault(func, f"{prefix}.{name_prefix}{name}")

    # Functional first: F.conv2d *is* torch.conv2d, and msprobe calls it Functional.conv2d.
    add(functions.get(F, ()), "Functional")
    add(functions.get(torch.Tensor, ()), "Tensor")
    for namespace, funcs in functions.items():
        module_name = getattr(namespace, "__name__", None)
        if not isinstance(module_name, str):
            continue  # Tensor property getters
        if module_name in _NAMESPACE_PREFIX:
            add(funcs, _NAMESPACE_PREFIX[module_name])
        elif module_name.startswith("torch."):
            # torch.linalg.norm -> Torch.linalg_norm: a dot would break the name grammar.
            add(funcs, "Torch", module_name.split(".", 1)[1].replace(".", "_") + "_")
    # torch._foreach_*: an optimizer's update of every parameter in one call (the default on
    # accelerators, the npu included). torch does not list them as overridable, but torch-function
    # modes see them; msprobe names torch._foreach_norm Torch._foreach_norm.
    for name in dir(torch):
        if name.startswith(FOREACH_PREFIX):
            table.setdefault(getattr(torch, name), f"Torch.{name}")
    return table


def foreach_op(api: str) -> str | None:
    """The per-tensor op a foreach api applies to each element of its lists (`Torch._foreach_add_`:
    `add_`), or None for any other api."""
    bare = api.partition(".")[2]
    return bare[len(FOREACH_PREFIX):] if bare.startswith(FOREACH_PREFIX) else None


def npu_op_api_name(func) -> str | None:
    """`NPU.npu_fusion_attention` for torch_npu's ops (`torch_npu.X`, `torch.ops.npu.X[.overload]`), as
    msprobe names them; None for anything else. Works with the real torch_npu and the emulator alike."""
    import torch

    if isinstance(func, torch._ops.OpOverload):
        func = func.overloadpacket
    if isinstance(func, torch._ops.OpOverloadPacket) and func._qualified_op_name.startswith("npu::"):
        return f"NPU.{func.__name__}"
    return None


class CallCounter:
    """Per-step call indices: the n-th call of an api or module name gets index n."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = defaultdict(int)

    def next(self, key: str) -> int:
        index = self._counts[key]
        self._counts[key] = index + 1
        return index

    def peek(self, key: str) -> int:
        """The index the next call of `key` gets."""
        return self._counts[key]

    def taken(self, key: str, index: int) -> None:
        """`index` is used: later calls of `key` get higher ones."""
        self._counts[key] = max(self._counts[key], index + 1)


def api_entry_name(api: str, index: int, direction: str = FORWARD) -> str:
    return f"{api}.{index}.{direction}"


def module_entry_name(path: str, class_name: str, index: int, direction: str = FORWARD) -> str:
    return f"Module.{path}.{class_name}.{direction}.{index}" if path else f"Module.{class_name}.{direction}.{index}"


def module_params_grad_name(path: str, class_name: str) -> str:
    """`Module.fc.Linear.parameters_grad.0`, as msprobe 26.2 names a module's parameter gradients
    (its index counts the step's backwards that reached the module; npukit writes the gradients the
    optimizer sees, once per step). Names without the index (npukit before) are read too."""
    return f"Module.{path}.{class_name}.{PARAMETERS_GRAD}.0" if path else f"Module.{class_name}.{PARAMETERS_GRAD}.0"


def with_direction(name: str, direction: str) -> str:
    """The forward entry of a backward entry or the other way: `Tensor.add.0.backward` <->
    `Tensor.add.0.forward`, `Module.fc.Linear.backward.0` <-> `Module.fc.Linear.forward.0`."""
    if name.startswith("Module."):
        base, _, index = name.rpartition(".")
        return f"{base.rpartition('.')[0]}.{direction}.{index}"
    return f"{name.rpartition('.')[0]}.{direction}"


_API_RE = re.compile(r"^(?P<base>.+)\.(?P<index>\d+)\.(?P<dir>forward|backward)$")
_MODULE_RE = re.compile(r"^(?P<base>Module\..+)\.(?P<dir>forward|backward)\.(?P<index>\d+)$")
# msprobe numbers each step's parameter gradients of a module: Module.fc.Linear.parameters_grad.0
_PARAMS_GRAD_RE = re.compile(r"^(?P<base>.+)\.parameters_grad(\.(?P<index>\d+))?$")


# Python operators msprobe names by their dunder method (it wraps Tensor.__add__ itself) and
# npukit by the op torch hands to __torch_function__ for them (x + y arrives as Tensor.add):
# one alignment key for both.
_OPERATOR_OPS = {"__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__isub__": "sub_",
                 "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div",
                 "__itruediv__": "div_", "__matmul__": "matmul", "__neg__": "neg", "__pow__": "pow"}


# The Tensor operators msprobe 26.2 wraps (its support_wrap_ops.yaml) and names by their dunder,
# less those Python never calls (__div__) or that only convert (__bool__).
MSPROBE_OPERATORS = (
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__floordiv__", "__ifloordiv__", "__mod__", "__rmod__", "__imod__", "__pow__", "__rpow__",
    "__ipow__", "__matmul__", "__and__", "__iand__", "__or__", "__ror__", "__ior__", "__xor__", "__rxor__",
    "__ixor__", "__lshift__", "__ilshift__", "__rshift__", "__irshift__", "__eq__", "__ne__", "__lt__",
    "__le__", "__gt__", "__ge__",
)


class OperatorNames:
    """Names `x + y` Tensor.__add__ (as msprobe does) rather than Tensor.add, the method torch hands
    __torch_function__ for it: while installed, each operator of MSPROBE_OPERATORS is a thin wrapper
    that marks the call it makes (`take()` in __torch_function__ reads and clears the mark).
    Installed by the first active dump or overflow session, removed by the last."""

    _installed = 0
    _originals: dict[str, object] = {}
    _pending: str | None = None

    @classmethod
    def install(cls) -> None:
        import torch

        cls._installed += 1
        if cls._installed > 1:
            return
        for dunder in MSPROBE_OPERATORS:
            original = getattr(torch.Tensor, dunder, None)
            if original is None:
                continue
            cls._originals[dunder] = torch.Tensor.__dict__.get(dunder)
            setattr(torch.Tensor, dunder, cls._wrapper(dunder, original))

    @classmethod
    def uninstall(cls) -> None:
        import torch

        cls._installed = max(cls._installed - 1, 0)
        if cls._installed:
            return
        for dunder, own in cls._originals.items():
            if own is None:
                delattr(torch.Tensor, dunder)  # inherited from TensorBase again
            else:
                setattr(torch.Tensor, dunder, own)
        cls._originals = {}
        cls._pending = None

    @classmethod
    def _wrapper(cls, dunder: str, original):
        def operator(self, *args):
            cls._pending = dunder
            try:
                return original(self, *args)
            finally:
                cls._pending = None
        operator.__name__ = operator.__qualname__ = dunder
        return operator

    @classmethod
    def take(cls, api: str) -> str:
        """`api` as msprobe names it: `Tensor.__add__` inside an operator, else `api`."""
        dunder = cls._pending
        if dunder is None:
            return api
        cls._pending = None  # only the operator's own call: not what runs inside it
        return f"Tensor.{dunder}" if api.startswith("Tensor.") else api


class MsprobeOpNames:
    """How the dump and the overflow detector name the ops watch's op hooks (watch.op_hooks.ApiMode)
    hand them: msprobe's api names (api_name_table, plus `extra`: func -> api name, e.g.
    creation_table()), torch_npu's ops as NPU.*, and Python operators by their dunder."""

    unlisted = staticmethod(npu_op_api_name)
    operators = OperatorNames

    def __init__(self, extra: dict | None = None) -> None:
        table = api_name_table()
        self.table = {**extra, **table} if extra else table


def operator_op(base: str) -> str:
    """`Tensor.__add__` -> `Tensor.add`; any other api name unchanged."""
    prefix, _, name = base.rpartition(".")
    op = _OPERATOR_OPS.get(name)
    return f"{prefix}.{op}" if op and prefix == "Tensor" else base


class ModulePaths(weakref.WeakKeyDictionary):
    """module -> dotted path, for every module a dump or overflow check has seen run.

    Several models in one script (a GAN's generator and discriminator, an actor and a critic) can
    hold submodules at the same path (`main.0`), or be of one class: the second and later models whose paths would
    collide are numbered as msprobe numbers a model list (`1.main.0`), so no two modules share a
    name and no gradient of one is written over the other's.
    """

    def add_model(self, root, prefix: str = "") -> None:
        """Name `root` and its submodules (those not named already), `root` at `prefix`."""
        named = [(name, sub) for name, sub in root.named_modules() if sub not in self]
        if not prefix and root not in self:
            taken = {path.split(".", 1)[0] for path in self.values() if path}
            # two models of one class (an actor's and a critic's nn.Linear called on their own)
            # would both be `Module.Linear`
            root_classes = {type(module).__name__ for module, path in self.items() if not path}
            if type(root).__name__ in root_classes or any(name and name.split(".", 1)[0] in taken for name, _ in named):
                index = 1
                while str(index) in taken:
                    index += 1
                prefix = str(index)
        for name, sub in named:
            full = f"{prefix}.{name}" if prefix and name else (prefix or name)
            self.setdefault(sub, _without_compile_wrapper(full))


def module_path(paths: ModulePaths, module, outermost_running=None) -> str:
    """Dotted path of `module` (cached in `paths`). A module created after its parent was first
    seen is found by re-walking the outermost module still running.

    torch.compile's wrapper (OptimizedModule) is transparent: the model inside it keeps the paths it
    has without compile (`fc1`, not `_orig_mod.fc1`).
    """
    path = paths.get(module)
    if path is None:
        if outermost_running is not None:
            paths.add_model(outermost_running, paths.get(outermost_running, ""))
        else:
            # Nothing above it runs: a head of a container whose own forward never runs
            # (`agent.actor(x)`), or a layer of a model whose .forward() was called directly. Its
            # names are its attribute path from the model it belongs to, found once per such root.
            root = _owning_root(module)
            if root is not module and root not in paths:
                paths.add_model(root)
        paths.add_model(module, paths.get(module, ""))
        path = paths[module]
    return path


class ModuleNames:
    """How a reader's module hooks (watch.module_hooks.ModuleHooks) name modules, as the dump names
    them (module_path, into `paths`), and which module calls they pass over: torch.compile's wrapper,
    whose model makes the calls that count, and a fullgraph region's compiled backward graph."""

    passed_over = staticmethod(eager.not_a_layer)  # asked at every module call: no frame in between

    def __init__(self, paths: ModulePaths) -> None:
        self.paths = paths

    def path(self, module, outermost_running=None) -> str:
        return module_path(self.paths, module, outermost_running)

    @staticmethod
    def runs_unseen(wrapper):
        """The model inside torch.compile(model, fullgraph=True)'s wrapper: it runs compiled, unseen,
        and is still named (its parameters keep their module names: `0.weight`); None otherwise."""
        return wrapper._orig_mod if eager.runs_compiled(wrapper) else None


_MAX_OWNER_DEPTH = 16
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> weakref to its outermost owner


def _owning_root(module):
    """The outermost module that holds `module` as a (nested) submodule; the module itself if none.

    Modules do not know their parents: the parent is found through the garbage collector's
    referrers (module <- parent's `_modules` dict <- parent's `__dict__` <- parent), a few scans
    of the heap, once per module that runs with nothing above it.
    """
    import gc

    import torch

    known = _OWNERS.get(module)
    owner = known() if known is not None else None
    # Found by an earlier session of this process (a test suite, a benchmark: one session each):
    # reused while the module is still inside it. A heap scan costs ~20 ms on a loaded interpreter.
    if owner is not None and (owner is module or any(sub is module for sub in owner.modules())):
        return owner
    current = module
    for _ in range(_MAX_OWNER_DEPTH):
        parent = None
        for holder in gc.get_referrers(current):
            if type(holder) is not dict or not all(isinstance(v, torch.nn.Module) or v is None
                                                   for v in holder.values()):
                continue
            for owner_dict in gc.get_referrers(holder):
                if type(owner_dict) is dict and owner_dict.get("_modules") is holder:
                    parent = next((owner for owner in gc.get_referrers(owner_dict)
                                   if isinstance(owner, torch.nn.Module) and owner.__dict__ is owner_dict), None)
                    if parent is not None:
                        break
            if parent is not None:
                break
        if parent is None:
            break
        current = parent
    _OWNERS[module] = weakref.ref(current)
    return current


_COMPILE_WRAPPED = "_orig_mod"


def is_compile_wrapper(module) -> bool:
    """torch.compile(module)'s OptimizedModule: it only forwards to the module it wraps."""
    return type(module).__name__ == "OptimizedModule" and _COMPILE_WRAPPED in module._modules


def _without_compile_wrapper(path: str) -> str:
    if _COMPILE_WRAPPED not in path:
        return path
    return ".".join(part for part in path.split(".") if part != _COMPILE_WRAPPED)


def split_entry_name(name: str) -> tuple[str, str, int | None]:
    """(base without call index, direction, call index) -- the key sequence alignment works on.

    `Functional.conv2d.3.forward` -> ("Functional.conv2d", "forward", 3);
    `Module.fc.Linear.backward.1` -> ("Module.fc.Linear", "backward", 1).
    """
    match = _MODULE_RE.match(name) if name.startswith("Module.") else None
    if match is None:
        match = _API_RE.match(name)
    if match is None:
        match = _PARAMS_GRAD_RE.match(name)
        if match is not None:
            return match["base"], PARAMETERS_GRAD, int(match["index"]) if match["index"] else None
        return name, "", None
    return match["base"], match["dir"], int(match["index"])


def module_path_of(name: str) -> str | None:
    """Module path of a Module entry ("layer1.0.conv1"), None for api entries."""
    if not name.startswith("Module."):
        return None
    base, _, _ = split_entry_name(name)
    parts = base.split(".")[1:-1]  # drop "Module" and the class name
    return ".".join(parts)


def name_matches(item: str, entry_name: str) -> bool:
    """True if the dot-separated components of `item` appear contiguously in `entry_name`.

    `conv2d`, `Functional.conv2d`, `layer1.0.conv1` and `Conv2d` all match
    `Module.layer1.0.conv1.Conv2d.forward.0` or `Functional.conv2d.0.forward` as a user expects.
    """
    wanted = item.split(".")
    parts = entry_name.split(".")
    width = len(wanted)
    return any(parts[i : i + width] == wanted for i in range(len(parts) - width + 1))


# Ops whose output holds whatever bytes were in memory (torch.empty & co., a growing resize_): its
# values differ from run to run, so it is marked uninitialized in the dump and neither compared nor
# checked for overflow.
UNINITIALIZED_OUTPUT = frozenset(
    {"Torch.empty", "Torch.empty_like", "Torch.empty_strided", "Tensor.new_empty", "Tensor.new_empty_strided",
     "Tensor.new", "Tensor.resize_", "Tensor.resize_as_"}
)
# In-place ops that overwrite every element of their first argument: its values before the op do not
# matter (the uninitialized buffer of `x.new().resize_(n).bernoulli_(p)`), so that input is marked too.
OVERWRITES_FIRST_INPUT = frozenset(
    f"Tensor.{op}" for op in ("bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
                              "log_normal_", "cauchy_", "fill_", "zero_", "copy_")
)
UNINITIALIZED = "uninitialized"  # the dump.json leaf field


def creation_table() -> dict:
    """Factory functions torch does not list as overridable (no tensor argument), by api name.

    Torch-function modes still see them; the overflow detector checks them, since a fill with
    +-inf in fp16 sets a saturation-mode device's overflow flag (`torch.full(s, float("-inf"))`).
    """
    import torch

    names = ("full", "tensor", "as_tensor", "scalar_tensor", "ones", "zeros", "arange", "range", "linspace",
             "logspace", "eye", "rand", "randn", "randint", "randperm", "normal")
    return {getattr(torch, name): f"Torch.{name}" for name in names if hasattr(torch, name)}


_IN_PLACE_OPERATORS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                                  "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                                  "__irshift__"})


def in_place_api(api: str) -> bool:
    """By its name, the api writes its first argument: `Tensor.add_`, `Torch._foreach_add_`,
    `Tensor.__iadd__`; not `Tensor.__add__` nor `Tensor.__invert__`."""
    op = api.rpartition(".")[2]
    return op in _IN_PLACE_OPERATORS if op.startswith("__") else op.endswith("_")


def writes_its_input(api: str, args: tuple, kwargs: dict) -> bool:
    """The call changes a tensor argument in place: `add_`, `__iadd__`, `out=`, or a functional
    asked to (`F.leaky_relu(x, 0.2, True)`, as nn.LeakyReLU(inplace=True) calls it)."""
    if in_place_api(api) or "out" in kwargs:
        return True
    if "inplace" in kwargs:
        return kwargs["inplace"] is True
    position = _inplace_positions().get(api)
    return position is not None and len(args) > position and args[position] is True


@lru_cache(maxsize=1)
def _inplace_positions() -> dict[str, int]:
    """api name -> position of its `inplace` argument, for the apis that have one (functionals)."""
    return {api: names.index("inplace") for api, names in functional_parameters().items() if "inplace" in names}


def caller_kwargs(api: str, kwargs: dict) -> dict:
    """The keyword arguments a caller can have written, as msprobe records them: torch's functionals
    hand __torch_function__ their private plumbing (`_stacklevel`) and their unset optional
    arguments (`dtype=None`) too."""
    if not kwargs or not api.startswith("Functional."):
        return kwargs
    unset = _unset_defaults().get(api, ())
    return {key: value for key, value in kwargs.items()
            if not key.startswith("_") and not (value is None and key in unset)}


def caller_arguments(api: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) of a functional as its caller most likely wrote them, which is what msprobe
    records: torch's Python functionals hand every optional argument to __torch_function__ by name.

    - Tensors by name (F.layer_norm's weight and bias) were passed by position: nn.LayerNorm,
      nn.GroupNorm, nn.BatchNorm* write `F.layer_norm(x, shape, self.weight, self.bias, self.eps)`.
      They and the arguments between them become positional (`input.2`, `input.3`, `input.4`).
    - Otherwise an argument at its default was not written (`F.relu(x)`, `F.cross_entropy(a, b)`).
    """
    kwargs = caller_kwargs(api, kwargs)
    names = functional_parameters().get(api) if kwargs and api.startswith("Functional.") else None
    if not names:
        return args, kwargs
    import torch

    if any(isinstance(value, torch.Tensor) for value in kwargs.values()):
        args, kwargs = list(args), dict(kwargs)
        for name in names[len(args):]:
            if name not in kwargs:
                break
            args.append(kwargs.pop(name))
        return tuple(args), kwargs
    defaults = _functional_defaults().get(api, {})
    return args, {key: value for key, value in kwargs.items()
                  if not (key in defaults and type(value) is type(defaults[key]) and value == defaults[key])}


@lru_cache(maxsize=1)
def _functional_defaults() -> dict[str, dict]:
    """Functional api name -> {parameter: default} for its parameters that have one."""
    import torch.nn.functional as F

    defaults = {}
    for api in functional_parameters():
        func = getattr(F, api.partition(".")[2], None)
        try:
            parameters = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            continue
        defaults[api] = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return defaults


@lru_cache(maxsize=1)
def _unset_defaults() -> dict[str, frozenset]:
    """Functional api name -> its parameters whose default is None."""
    return {api: frozenset(name for name, default in defaults.items() if default is None)
            for api, defaults in _functional_defaults().items()}


@lru_cache(maxsize=1)
def functional_parameters() -> dict[str, list[str]]:
    """Functional api name -> its parameter names in order (torch.nn.functional's Python functions)."""
    parameters = {}
    for func, api in api_name_table().items():
        if not api.startswith("Functional."):
            continue
        try:
            parameters[api] = list(inspect.signature(func).parameters)
        except (TypeError, ValueError):  # a builtin without a signature
            continue
    return parameters


def argument_position(api: str, keyword: str) -> int | None:
    """Where a keyword argument of a functional sits among its parameters: F.layer_norm's weight
    is argument 2 whether a caller passed it by position (msprobe records what the caller wrote) or
    by name (torch's __torch_function__ hands it over by name)."""
    names = functional_parameters().get(api) if api.startswith("Functional.") else None
    return names.index(keyword) if names and keyword in names else None
