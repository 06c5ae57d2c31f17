"""torch.compile regions while npukit watches the run (dump, overflow detection).

The dump and the overflow detector hook every module call and every torch function. Dynamo cannot
trace through those hooks (it fails with "UnspecializedNNModuleVariable ... is already tracked for
mutation" on the global module hooks), and a compiled graph would hide its ops from them anyway. So
while a watching session is active, Dynamo is disabled (`torch._dynamo.config.disable`): a compiled
model or function runs its original Python code eagerly, each op is seen one by one, and a notice
says so once. When the last session stops, the setting is restored and caches are reset so the
program compiles again as before.

A `torch.compile(fullgraph=True)` region is the exception: it promises one graph, and torch raises
("torch.compile with fullgraph=True found no compiled frames") when it runs eagerly. Such a region
runs compiled: each call of it enables Dynamo for that call only, with npukit's hooks and
torch-function modes set aside (they would break its graph, and cannot see inside it anyway), and
tells every session that the region ran unwatched (`on_compiled_region(name)`), with a notice once
per region. Its callers' hooks still see what goes in and what comes out.
"""

from __future__ import annotations

import gc
import sys
import threading
import types
import warnings
import weakref

_lock = threading.Lock()
_users = 0
_saved: dict = {}
_listeners: list = []  # each session's on_compiled_region(name)
_announced_regions: set[str] = set()
_inside_region = 0  # > 0 while a fullgraph region runs compiled (its nested calls are inlined)
_pending_restores: list = []  # regions running now: what each set aside, put back when it returns
# fullgraph Dynamo contexts given the region hook -> the hook (removed again at the last leave)
_attached: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_HOOK_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"
NOTICE = ("npukit: torch.compile regions run eagerly while {what} is active, so that every op is seen "
          "(the numerics are those of the eager kernels)")
REGION_NOTICE = ("npukit: {name} is compiled with fullgraph=True: it runs compiled, and npukit's hooks cannot "
                 "see inside it (its ops are not dumped or checked for overflow one by one)")
REGION_DETAIL = "torch.compile(fullgraph=True) region: ran compiled; its ops are not recorded"
UNNAMED_REGION = "a torch.compile(fullgraph=True) region"


def enter(what: str, on_compiled_region=None) -> None:
    """Start running compiled regions eagerly (nested sessions share one setting).

    on_compiled_region(name): called each time a fullgraph region runs compiled, unwatched."""
    global _users
    with _lock:
        if on_compiled_region is not None:
            _listeners.append(on_compiled_region)
        _users += 1
        if _users > 1:
            return
        import torch

        dynamo = _dynamo()
        if dynamo is None:
            return
        compiled_before = _has_compiled_code(dynamo)
        _saved["disable"] = dynamo.config.disable
        dynamo.config.disable = True
        dynamo.reset()  # code compiled before the session would bypass the hooks
        _attach_to_fullgraph_regions(dynamo)
        original = torch.compile
        _saved["compile"] = original
        announced = []

        def compile_eagerly(*args, **kwargs):
            if not announced and not kwargs.get("fullgraph"):
                announced.append(True)
                print(NOTICE.format(what=what), file=sys.stderr)
            return original(*args, **kwargs)

        # torch warns that global module hooks fire again for the OptimizedModule wrapper; npukit's
        # hooks skip that wrapper (naming.is_compile_wrapper), so the warning is noise here
        warnings.filterwarnings("ignore", message=_HOOK_WARNING)
        compile_eagerly.__wrapped__ = original
        compile_eagerly.__doc__ = original.__doc__
        torch.compile = compile_eagerly
        if compiled_before:
            announced.append(True)
            print(NOTICE.format(what=what), file=sys.stderr)


def leave(on_compiled_region=None) -> None:
    global _users
    with _lock:
        if on_compiled_region is not None and on_compiled_region in _listeners:
            _listeners.remove(on_compiled_region)
        if _users == 0:
            return
        _users -= 1
        if _users or not _saved:
            return
        import torch

        torch.compile = _saved.pop("compile")
        warnings.filters[:] = [f for f in warnings.filters if not (f[1] is not None and f[1].pattern == _HOOK_WARNING)]
        while _pending_restores:  # a region whose return torch never reported (its own error)
            _pending_restores[-1]()
        dynamo = _dynamo()
        if dynamo is not None:
            _detach_from_fullgraph_regions(dynamo)
            dynamo.config.disable = _saved.pop("disable")
            dynamo.reset()
        _announced_regions.clear()


# ---------------------------------------------------------------------------- fullgraph regions
def _attach_to_fullgraph_regions(dynamo) -> None:
    """Give every fullgraph region the hook that runs it compiled: those made before the session
    (found once, by a scan of live objects) and those made while it runs (Dynamo's context call)."""
    context_class = getattr(dynamo.eval_frame, "_TorchDynamoContext", None)
    if context_class is None or not isinstance(context_class.__dict__.get("__call__"), types.FunctionType):
        return  # another torch: fullgraph regions run as the other compiled regions do
    optimized_module = getattr(dynamo.eval_frame, "OptimizedModule", None)
    names: dict[int, str] = {}
    contexts = []
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: it reads __class__, which deprecated objects warn on
        if issubclass(kind, context_class):
            contexts.append(obj)
        elif optimized_module and issubclass(kind, optimized_module):
            names.setdefault(id(obj.dynamo_ctx), region_name(obj._orig_mod))
        elif kind is types.FunctionType and "_torchdynamo_orig_callable" in obj.__dict__:
            for cell in obj.__closure__ or ():  # the function torch.compile returned: its context
                try:
                    content = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(content, context_class):
                    names.setdefault(id(content), region_name(obj._torchdynamo_orig_callable))
    for context in contexts:
        _attach(context, names.get(id(context), UNNAMED_REGION))
    original_call = context_class.__call__

    def call(self, fn, *args, **kwargs):
        _attach(self, region_name(fn))
        return original_call(self, fn, *args, **kwargs)

    call.__wrapped__ = original_call
    context_class.__call__ = call
    _saved["context_call"] = (context_class, original_call)


def _detach_from_fullgraph_regions(dynamo) -> None:
    patched = _saved.pop("context_call", None)
    if patched is not None:
        context_class, original_call = patched
        context_class.__call__ = original_call
    for context, hook in list(_attached.items()):
        hooks = getattr(context, "enter_exit_hooks", None)
        if hooks is not None and hook in hooks:
            hooks.remove(hook)
    _attached.clear()


def _attach(context, name: str) -> None:
    if not getattr(context, "fullgraph", False) or getattr(context, "export", False):
        return
    hooks = getattr(context, "enter_exit_hooks", None)
    if not isinstance(hooks, list):
        return
    hook = _attached.get(context)
    if hook is None:
        hook = _region_hook(name)
        _attached[context] = hook
        hooks.append(hook)  # Dynamo calls it at each call of the region, before its frame runs


def region_name(fn) -> str:
    """What the user calls the compiled thing: `sgd_update`, `Net.forward`."""
    import torch

    if isinstance(fn, torch.nn.Module):
        return f"{type(fn).__qualname__}.forward"
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module) and getattr(fn, "__name__", "") in ("_call_impl", "_wrapped_call_impl"):
        return f"{type(owner).__qualname__}.forward"  # Module.compile()
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) else UNNAMED_REGION


def _region_hook(name: str):
    def run_compiled():
        if not _users or _inside_region:
            return _nothing
        return _run_compiled(name)
    return run_compiled


def _nothing() -> None:
    return None


def _run_compiled(name: str):
    """Set npukit's watching aside and Dynamo on for one call of a fullgraph region; the returned
    function puts everything back (Dynamo calls it when the region returns or raises)."""
    global _inside_region
    for listener in list(_listeners):
        listener(name)
    if name not in _announced_regions:
        _announced_regions.add(name)
        print(REGION_NOTICE.format(name=name), file=sys.stderr)
    import torch._functorch.config as aot_config

    dynamo = _dynamo()
    disabled, lazy = dynamo.config.disable, aot_config.force_non_lazy_backward_lowering
    dynamo.config.disable = False
    # Its backward graph compiled now, with the hooks aside, not at the first backward, under them.
    aot_config.force_non_lazy_backward_lowering = True
    hooks = _set_hooks_aside()
    modes = _set_modes_aside()
    _inside_region += 1

    def restore() -> None:
        global _inside_region
        if restore not in _pending_restores:
            return
        _pending_restores.remove(restore)
        _inside_region -= 1
        _put_modes_back(modes)
        _put_hooks_back(hooks)
        dynamo.config.disable = disabled
        aot_config.force_non_lazy_backward_lowering = lazy
    _pending_restores.append(restore)
    return restore


def _npukit_owned(function) -> bool:
    module = getattr(function, "__module__", None) or getattr(type(function), "__module__", "")
    return isinstance(module, str) and module.startswith("npukit.")


def _hook_dicts() -> list[dict]:
    """torch's global module and optimizer hooks (Dynamo inlines them into the graph it traces)."""
    from torch.nn.modules import module
    from torch.optim import optimizer

    names = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
             "_global_backward_hooks")
    dicts = [getattr(module, name) for name in names if isinstance(getattr(module, name, None), dict)]
    dicts += [getattr(optimizer, name) for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
              if isinstance(getattr(optimizer, name, None), dict)]
    return dicts


def _set_hooks_aside() -> list[tuple[dict, list]]:
    saved = []
    for hooks in _hook_dicts():
        if any(_npukit_owned(hook) for hook in hooks.values()):
            saved.append((hooks, list(hooks.items())))
            for key in [key for key, hook in hooks.items() if _npukit_owned(hook)]:
                del hooks[key]
    return saved


def _put_hooks_back(saved: list[tuple[dict, list]]) -> None:
    for hooks, items in saved:
        added = [(key, hook) for key, hook in hooks.items() if all(key != old for old, _ in items)]
        hooks.clear()
        hooks.update(items)  # in their order: the user's hooks keep theirs around npukit's
        hooks.update(added)


def _set_modes_aside() -> list | None:
    """Pop the torch-function mode stack; push back the modes that are not npukit's."""
    import torch

    size = torch._C._len_torch_function_stack()
    modes = [torch._C._get_function_stack_at(i) for i in range(size)]
    if not any(_npukit_owned(mode) for mode in modes):
        return None
    for _ in range(size):
        torch._C._pop_torch_function_stack()
    for mode in modes:
        if not _npukit_owned(mode):
            torch._C._push_on_torch_function_stack(mode)
    return modes


def _put_modes_back(modes: list | None) -> None:
    if modes is None:
        return
    import torch

    for _ in range(torch._C._len_torch_function_stack()):
        torch._C._pop_torch_function_stack()
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)


def _dynamo():
    try:
        import torch._dynamo as dynamo
    except Exception:  # a torch build without Dynamo: nothing is compiled
        return None
    return dynamo


def _has_compiled_code(dynamo) -> bool:
    try:
        return bool(dynamo.utils.counters["stats"]["unique_graphs"])
    except Exception:
        return False


def runs_compiled_graph(module) -> bool:
    """An fx GraphModule that a fullgraph region's compiled backward runs (AOTAutograd's backward
    graph, called as a module during backward): part of the region, not a layer of the model."""
    if not _announced_regions or type(module).__name__ != "GraphModule":
        return False
    import torch

    return torch._C._current_graph_task_id() != -1


def runs_compiled(wrapper) -> bool:
    """torch.compile(model, fullgraph=True)'s OptimizedModule: the model inside runs compiled, unseen."""
    return getattr(wrapper, "dynamo_ctx", None) in _attached


_NOT_LAYER_CLASSES = frozenset({"OptimizedModule", "GraphModule"})


def not_a_layer(module) -> bool:
    """torch.compile's wrapper (OptimizedModule: the model it wraps makes the calls that count) or a
    fullgraph region's compiled backward graph: module calls a watcher's hooks pass over."""
    if type(module).__name__ not in _NOT_LAYER_CLASSES:
        return False  # a model's own layer, told by its class name alone (every module call asks)
    from npukit.accuracy.naming import is_compile_wrapper

    return is_compile_wrapper(module) or runs_compiled_graph(module)
