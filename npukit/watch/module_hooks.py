"""Module hooks: a reader's global module forward hooks and the module forwards running now
(ModuleHooks); the dump, the overflow detector and the monitor are its clients.

What every reader needs of them, done once here:
  - torch.compile's wrapper (OptimizedModule) and a fullgraph region's compiled backward graph are
    passed over (the model inside the wrapper makes the calls that count); the model inside a
    wrapper that runs it compiled (fullgraph=True) is still named, so that its parameters keep their
    module names;
  - the modules running, outermost first: a forward that starts with nothing running is a root
    forward, told to the reader (its step count: steps' root_forward) before its enter; the post
    hook pops only the module on top (one whose pre hook this reader passed over is not its);
  - the post hook runs also when forward raised (always_call: torch then calls it as
    hook(module, args, None), without kwargs, even under with_kwargs);
  - each module forward that ends counts as ops run (tensors.ops_ran: inference tensors' versions);
  - a module's path is named from the outermost module running (path).

What is a reader's own: whether it watches now (`watching`: the dump and the detector not inside
optimizer.step), what it does at a root forward, what it records as a module enters (the frame
kept with it on the stack) and leaves. How modules are named and which calls are torch.compile's
is the reader's to say (`names`: accuracy.naming.ModuleNames), as ApiMode's op names are. A hook's
error is the reader's guard's (hook_guard.unintercepted, or the monitor's own), under the reader's
name: `{owner}._on_module_pre_forward`, `{owner}._on_module_forward`.
"""

from __future__ import annotations

from npukit.watch.tensors import ops_ran


class ModuleHooks:
    """install() registers torch's global module forward pre and post hooks, remove() removes them.

    names: path(module, outermost_running) -> its dotted path; passed_over(module): a call no
        reader counts (torch.compile's wrapper, a compiled backward graph); runs_unseen(module) ->
        the model inside a wrapper that runs it compiled, or None
    owner: the reader's class name, which its hooks are reported and switched off under
    guard(hook, kind): the reader's hook guard, around all of a hook's work
    watching() -> False: module calls are passed over (not pushed, no root forward)
    root(module): a root forward starts (before enter, before the module is pushed)
    enter(module, args, is_root) -> the frame kept with the module while it runs
    leave(module, frame, args, [kwargs,] output): its forward ended (popped); output is None when
        forward raised, or, under with_kwargs, missing (and kwargs is None)
    `running`: [(module, frame)] outermost first; `forward_seen`: a module forward has started.
    """

    def __init__(self, names, *, owner: str, guard, watching=None, root=None, enter=None, leave=None,
                 with_kwargs: bool = False) -> None:
        self.names = names
        self.running: list[tuple[object, object]] = []
        self.forward_seen = False
        self._owner = owner
        self._guard = guard
        self._watching = watching
        self._root = root
        self._enter = enter
        self._leave = leave
        self._with_kwargs = with_kwargs
        self._handles: list = []

    def install(self) -> None:
        from torch.nn.modules import module as module_hooks

        self._handles = [
            module_hooks.register_module_forward_pre_hook(
                self._guard(self._pre_forward, f"{self._owner}._on_module_pre_forward")),
            module_hooks.register_module_forward_hook(
                self._guard(self._forward, f"{self._owner}._on_module_forward"),
                with_kwargs=self._with_kwargs, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def path(self, module) -> str:
        """module's dotted path, named from the outermost module running: asked before the module is
        pushed or after it is popped (with nothing else running, from the model that owns it)."""
        running = self.running
        return self.names.path(module, running[0][0] if running else None)

    def _pre_forward(self, module, args) -> None:
        self.forward_seen = True
        if self._watching is not None and not self._watching():
            return
        names = self.names
        if names.passed_over(module):
            inside = names.runs_unseen(module)
            if inside is not None:
                self.path(inside)
            return
        root = not self.running
        if root and self._root is not None:
            self._root(module)
        self.running.append((module, self._enter(module, args, root) if self._enter is not None else None))

    def _forward(self, module, args, *kwargs_output) -> None:
        ops_ran()  # the module's own code ran (at module level, no op was counted)
        running = self.running
        if not running or running[-1][0] is not module:
            return
        _, frame = running.pop()
        if self._leave is not None:
            self._leave(module, frame, args, *kwargs_output)
