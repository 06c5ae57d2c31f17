"""Op hooks: ApiMode, the TorchFunctionMode that sees every torch / functional / Tensor call of the
run (torch itself is never patched) and hands it to a reader's handler; the dump and the overflow
detector are its clients.

What an op is called is the reader's to say (`names`: the dump's and the detector's are msprobe's,
accuracy.naming.MsprobeOpNames); an op the names leave out runs unseen. A handler's error is the
hook guard's (hook_guard): reported once, the handler switched off, the op's result returned.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.autograd.graph
from torch.overrides import TorchFunctionMode

from npukit.watch import hook_guard
from npukit.watch.tensors import ops_ran

_TORCH = os.sep + "torch" + os.sep
_TORCH_DISTRIBUTED = _TORCH + "distributed" + os.sep
# torch's own Python an op call may pass through between its caller and __torch_function__
_THROUGH = tuple(_TORCH + name for name in ("overrides.py", "_tensor.py", "functional.py", "_jit_internal.py"))


def _called_by_torch_distributed() -> bool:
    """The op is called by torch.distributed's own Python (FSDP2 sharding and gathering parameters,
    DDP's helpers), not by the model: not the user's op, and it may read a buffer a collective has
    not filled yet (FSDP2 views its all-gather output, a torch.empty, before the gather: a correct
    4-rank run compared as diverging on every rank with errors up to 1e40)."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        filename = frame.f_code.co_filename
        if _TORCH_DISTRIBUTED in filename:
            return True
        if not filename.endswith(_THROUGH):
            return False
        frame = frame.f_back
    return False


# The calls that run autograd's engine. Inside a mode's __torch_function__ the mode is off the stack,
# and the engine runs the backward with the stack it finds: the Python of a custom autograd
# Function's backward (MindSpeed's grouped matmul), a tensor hook or a checkpoint's recompute would
# run unseen, though a real NPU run's msprobe records them.
_BACKWARD_CALLS = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})
_waiting_for_engine = threading.local()
_engine_entry_wrapped = False


# The arguments a mode below the ApiModes (npu-run --precision-fix: its finite_fill) ran the op with in
# place of its caller's, for the op run_op last ran (it clears them): see op_ran_with().
_ran_with = threading.local()


def op_ran_with(args: tuple, kwargs: dict) -> None:
    """Said by a mode below the watching ones that ran the op it was handed with other numbers than
    its caller passed (finite_fill: -inf as finfo(dtype).min), once the op has run: a dump above it
    then records what the op computed with, not what the script wrote."""
    _ran_with.value = (args, kwargs)


def rewritten_arguments() -> tuple[tuple, dict] | None:
    """(args, kwargs) the op a handler's run_op just ran was run with by a mode below, or None: as passed."""
    return getattr(_ran_with, "value", None)


def _modes_waiting() -> list:
    modes = getattr(_waiting_for_engine, "modes", None)
    if modes is None:
        modes = _waiting_for_engine.modes = []
    return modes


def _install_engine_entry() -> None:
    """Wrap autograd's engine entry (once): a backward started by a call an ApiMode is handling runs
    with that mode back on the stack."""
    global _engine_entry_wrapped
    if _engine_entry_wrapped:
        return
    _engine_entry_wrapped = True
    original = torch.autograd.graph._engine_run_backward

    def _engine_run_backward(*args, **kwargs):
        waiting = _modes_waiting()
        if not waiting:
            return original(*args, **kwargs)
        pushed = []
        for mode in waiting:  # the outermost call's mode first: it was the top of the stack
            if not any(torch._C._get_function_stack_at(i) is mode for i in range(torch._C._len_torch_function_stack())):
                pushed.append(mode)
        for mode in reversed(pushed):
            torch._C._push_on_torch_function_stack(mode)
        try:
            return original(*args, **kwargs)
        finally:
            for _ in pushed:
                torch._C._pop_torch_function_stack()

    torch.autograd.graph._engine_run_backward = _engine_run_backward
    torch.autograd._engine_run_backward = _engine_run_backward


class ApiMode(TorchFunctionMode):
    """Hands each torch / functional / Tensor api call to `handle(api, run_op, args, kwargs)` while
    `wanted()` is true; the handler runs the op itself, through run_op (between measuring its
    inputs and its outputs).

    names: how ops are named, with
        table       op function -> its api name (the ops the handler is given)
        unlisted    func -> an api name for an op the table lacks (torch_npu's), or None: not seen
        operators   install() / uninstall() around the mode's life, take(api) -> the name of the op a
                    Python operator called (`x + y` named apart from the Tensor.add it calls)

    lift() takes it off the torch-function stack while an optimizer runs (its hundreds of update
    ops would each pay a Python dispatch just to be ignored); restore() puts it back.
    """

    def __init__(self, wanted, handle, names) -> None:
        super().__init__()
        self._wanted = wanted
        self._handle = handle
        self._kind = getattr(handle, "__qualname__", "api handler")
        self._table = names.table
        self._unlisted = names.unlisted
        self._operators = names.operators
        self._lifted = False
        self._names_operators = False

    def __enter__(self):
        _install_engine_entry()
        self._operators.install()
        self._names_operators = True
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARD_CALLS:
            waiting = _modes_waiting()
            waiting.append(self)
            try:
                return self._handle_call(func, args, kwargs)
            finally:
                waiting.pop()
        return self._handle_call(func, args, kwargs)

    def _handle_call(self, func, args, kwargs):
        api = self._table.get(func) or self._unlisted(func)
        if api is None or self._kind in hook_guard.broken_hooks or not self._wanted() \
                or _called_by_torch_distributed():
            return func(*args, **kwargs)
        api = self._operators.take(api)
        # The handler runs the op itself (between measuring inputs and outputs). An error of the op
        # is the user's and propagates; an error of the handler is npukit's: reported once, the
        # handler switched off, and the op's result returned (the op is never run twice).
        ran: list = []

        def run_op(*op_args, **op_kwargs):
            _ran_with.value = None  # (a rewrite said for an op no handler saw)
            try:
                result = func(*op_args, **op_kwargs)
            except BaseException as exc:
                ran.append(exc)
                raise
            finally:
                ops_ran()
            ran.append(result)
            return result

        try:
            return self._handle(api, run_op, args, kwargs)
        except Exception as exc:
            if getattr(exc, "npukit_propagate", False) or (ran and ran[0] is exc):
                raise
            hook_guard.hook_failed(self._kind, exc, api)
            return ran[0] if ran else func(*args, **kwargs)

    def _on_top(self) -> bool:
        size = torch._C._len_torch_function_stack()
        return bool(size) and torch._C._get_function_stack_at(size - 1) is self

    def lift(self) -> None:
        if self._on_top():
            torch._C._pop_torch_function_stack()
            self._lifted = True

    def restore(self) -> None:
        if self._lifted:
            torch._C._push_on_torch_function_stack(self)
            self._lifted = False

    def close(self) -> None:
        """Leave the stack. When another mode entered after this one is still active, this one
        stays below it, passing every call through (its `wanted()` is false by then)."""
        self.restore()
        if self._on_top():
            self.__exit__(None, None, None)
        if self._names_operators:
            self._operators.uninstall()
            self._names_operators = False
