"""torch.compile regions run eagerly while npukit watches the run (dump, overflow detection).

The dump and the overflow detector hook every module call and every torch function. Dynamo cannot
trace through those hooks (it fails with "UnspecializedNNModuleVariable ... is already tracked for
mutation" on the global module hooks), and a compiled graph would hide its ops from them anyway. So
while a watching session is active, Dynamo is disabled (`torch._dynamo.config.disable`): a compiled
model or function runs its original Python code eagerly, each op is seen one by one, and a notice
says so once. When the last session stops, the setting is restored and caches are reset so the
program compiles again as before.
"""

from __future__ import annotations

import sys
import threading
import warnings

_lock = threading.Lock()
_users = 0
_saved: dict = {}

_HOOK_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"
NOTICE = ("npukit: torch.compile regions run eagerly while {what} is active, so that every op is seen "
          "(the numerics are those of the eager kernels)")


def enter(what: str) -> None:
    """Start running compiled regions eagerly (nested sessions share one setting)."""
    global _users
    with _lock:
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
        original = torch.compile
        _saved["compile"] = original
        announced = []

        def compile_eagerly(*args, **kwargs):
            if not announced:
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


def leave() -> None:
    global _users
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users or not _saved:
            return
        import torch

        torch.compile = _saved.pop("compile")
        warnings.filters[:] = [f for f in warnings.filters if not (f[1] is not None and f[1].pattern == _HOOK_WARNING)]
        dynamo = _dynamo()
        if dynamo is not None:
            dynamo.config.disable = _saved.pop("disable")
            dynamo.reset()


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
