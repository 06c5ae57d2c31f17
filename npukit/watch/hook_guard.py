"""The hook guard: an error inside a reader's hook (a bug of npukit's, a full disk) never reaches
the user's run. It is reported once, naming the hook and where it ran, that hook is switched off for
the rest of the run, and the run goes on. The readers listening are told, so that what they write
says it is incomplete from there on.

    unintercepted           a hook wrapped so: torch-function handling off, errors guarded
    hook_failed             report a hook's error once and switch it off
    broken_hooks            the hooks switched off (their __qualname__ or a reader's name for them)
    revive_hooks            a new session of a reader starts with its hooks on again
    add_failure_listener    a reader's on_hook_failed(kind, where, detail), until remove_failure_listener
"""

from __future__ import annotations

import sys

import torch

broken_hooks: set[str] = set()
_failure_listeners: list = []  # each active session's on_hook_failed(kind, where, detail)


def unintercepted(function, kind: str | None = None):
    """Run a hook with torch-function handling off: its own tensor accesses (.shape, .dtype, ...)
    would otherwise each go through the op hooks' mode (the mode is off only inside its own handler).
    No functools.wraps: hooks are wrapped per op, where copying metadata is a measurable cost.

    Crash safety: an error inside the hook is reported once (hook_failed), naming the hook and the
    module it ran for, that hook is switched off for the rest of the run, and the run goes on (the
    hook returns None: nothing of the user's changes). Only errors meant for the user (those with
    `npukit_propagate`, such as the overflow detector's OverflowStop) pass through.

    kind: the hook's name in reports and in broken_hooks (its __qualname__ unless given: a hook
    watch/ runs for a reader is named after the reader, `{reader class}.{hook}`, so that one
    reader's failure switches off only its own hook and revive_hooks finds it).
    """
    kind = kind or function.__qualname__

    def wrapper(*args, **kwargs):
        if kind in broken_hooks:
            return None
        try:
            with torch._C.DisableTorchFunction():
                return function(*args, **kwargs)
        except Exception as exc:
            if getattr(exc, "npukit_propagate", False):
                raise
            hook_failed(kind, exc, _hook_subject(args))
            return None
    return wrapper


def hook_failed(kind: str, exc: BaseException, subject: str = "") -> None:
    """Switch a hook off after an internal error and say so once (on stderr); the active sessions
    are told, so that what they write says they are incomplete from here on."""
    if kind in broken_hooks:
        return
    broken_hooks.add(kind)
    where = f" (at {subject})" if subject else ""
    detail = f"internal error in {kind}: {type(exc).__name__}: {exc}"
    print(f"npukit: internal error in {kind}{where}: {type(exc).__name__}: {exc}. This hook is switched off for "
          "the rest of the run; the run goes on. Please report this to the npukit maintainers.", file=sys.stderr)
    for listener in list(_failure_listeners):
        listener(kind, subject or kind, detail)


def revive_hooks(owner: str) -> None:
    """A new session of `owner` (a class name) starts with its hooks on again."""
    broken_hooks.difference_update([kind for kind in broken_hooks if kind.startswith(owner + ".")])


def add_failure_listener(listener) -> None:
    """listener(kind, where, detail) is called for each hook switched off from now on."""
    _failure_listeners.append(listener)


def remove_failure_listener(listener) -> None:
    if listener in _failure_listeners:
        _failure_listeners.remove(listener)


def _hook_subject(args) -> str:
    for arg in args[:2]:
        if isinstance(arg, torch.nn.Module):
            return f"module {type(arg).__name__}"
        if isinstance(arg, str):
            return arg
    return ""
