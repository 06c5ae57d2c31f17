"""The user's call stack at an op, for the dump's stack.json and the overflow report.

Only the user's own frames are kept: torch's and npukit's are skipped, and the walk stops at the
launcher (npu-run, runpy, pytest, typer). Each distinct stack is stored once and referred to by id:
a training step runs the same few hundred call sites again and again.
"""

from __future__ import annotations

import linecache
import os
import runpy
import sys

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # npukit/
_LAUNCHER_FILES = frozenset({
    "<frozen runpy>", runpy.__file__, os.path.join(_OWN_DIR, "run.py"), os.path.join(_OWN_DIR, "cli.py"),
})
_LAUNCHER_PACKAGES = tuple(f"{os.sep}{name}{os.sep}" for name in ("_pytest", "pluggy", "typer", "click"))
_MAX_WALK = 64  # frames looked at per capture (torch's module call frames included)

_KEEP, _SKIP, _STOP = 0, 1, 2
# id(code) -> (kind, code): the code object is held so that its id is never reused.
_KINDS: dict[int, tuple[int, object]] = {}


def _kind(code) -> int:
    filename = code.co_filename
    if filename in _LAUNCHER_FILES or any(package in filename for package in _LAUNCHER_PACKAGES):
        return _STOP
    if filename.startswith((_TORCH_DIR, _OWN_DIR, "<frozen")):
        return _SKIP
    return _KEEP


def user_call_site(frame) -> tuple[str, int] | None:
    """(file, line) of the first of the user's own frames from `frame` outwards, by the rule the
    dump's stacks follow (torch's and npukit's frames skipped; None at the launcher)."""
    for _ in range(_MAX_WALK):
        if frame is None:
            return None
        kind = _kind(frame.f_code)
        if kind == _STOP:
            return None
        if kind == _KEEP:
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


class CallStacks:
    """Interned user call stacks: capture() returns a small id, frames(id) the frames."""

    def __init__(self, max_frames: int) -> None:
        self.max_frames = max_frames
        self._ids: dict[tuple, int] = {}
        self._stacks: list[tuple] = []  # id -> ((id(code), line), ...): ids hash fast, code objects don't

    def capture(self, skip: int) -> int:
        """Id of the current stack, leaving out the `skip` innermost frames of the caller's own."""
        kinds = _KINDS
        key = []
        frame = sys._getframe(skip + 1)
        for _ in range(_MAX_WALK):
            if frame is None or len(key) == self.max_frames:
                break
            code = frame.f_code
            known = kinds.get(id(code))
            if known is None:
                known = kinds[id(code)] = (_kind(code), code)
            if known[0] == _STOP:
                break
            if known[0] == _KEEP:
                key.append((id(code), frame.f_lineno))
            frame = frame.f_back
        key = tuple(key)
        stack_id = self._ids.get(key)
        if stack_id is None:
            stack_id = self._ids[key] = len(self._stacks)
            self._stacks.append(key)
        return stack_id

    def frames(self, stack_id: int) -> list[tuple[str, int, str, str]]:
        """(file, line, function, source line) of each frame, innermost first."""
        frames = []
        for code_id, line in self._stacks[stack_id]:
            code = _KINDS[code_id][1]
            frames.append((code.co_filename, line, code.co_name, linecache.getline(code.co_filename, line).strip()))
        return frames

    def __len__(self) -> int:
        return len(self._stacks)
