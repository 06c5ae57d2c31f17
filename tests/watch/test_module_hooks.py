"""ModuleHooks: what the dump, the overflow detector and the monitor are each told of module forwards
(the running stack, root forwards, torch.compile's wrapper passed over, forwards that raise), and a
reader's hook error switched off under the reader's own name."""

import pytest
import torch
import torch.nn as nn

from npukit.watch import hook_guard
from npukit.watch.module_hooks import ModuleHooks


class Names:
    """Paths from the outermost module running; a module of class `Wrapper` is passed over, and the
    model inside one is named all the same."""

    def __init__(self):
        self.named = []  # (module, outermost running)

    def path(self, module, outermost_running=None):
        self.named.append((module, outermost_running))
        if outermost_running is None:
            return ""
        return next(name for name, sub in outermost_running.named_modules() if sub is module)

    def passed_over(self, module):
        return type(module).__name__ == "Wrapper"

    def runs_unseen(self, wrapper):
        return wrapper.inner


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class Reader:
    def __init__(self, watching=None, with_kwargs=False):
        self.calls = []
        self.hooks = ModuleHooks(Names(), owner="Reader", guard=hook_guard.unintercepted, watching=watching,
                                 root=lambda module: self.calls.append(("root", module)),
                                 enter=self.enter, leave=self.leave, with_kwargs=with_kwargs)

    def enter(self, module, args, root):
        self.calls.append(("enter", module, root, self.hooks.path(module)))
        return f"frame of {type(module).__name__}"

    def leave(self, module, frame, args, *kwargs_output):
        self.calls.append(("leave", module, frame, len(self.hooks.running), kwargs_output))

    def __enter__(self):
        self.hooks.install()
        return self

    def __exit__(self, *exc_info):
        self.hooks.remove()


def test_a_reader_is_told_each_forward_on_a_stack_a_root_first_and_paths_from_the_outermost():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with Reader() as reader:
        model(torch.ones(1, 2))
    first, relu = model[0], model[1]
    assert reader.calls[:3] == [("root", model), ("enter", model, True, ""), ("enter", first, False, "0")]
    assert [call[:3] for call in reader.calls[3:]] == [
        ("leave", first, "frame of Linear"), ("enter", relu, False), ("leave", relu, "frame of ReLU"),
        ("leave", model, "frame of Sequential")]
    assert [call[3] for call in reader.calls if call[0] == "leave"] == [1, 1, 0]  # popped before leave
    assert reader.hooks.running == [] and reader.hooks.forward_seen
    model(torch.ones(1, 2))  # removed: no longer told
    assert len(reader.calls) == 7


def test_torch_compiles_wrapper_is_passed_over_and_the_model_inside_still_named():
    inner = nn.Linear(2, 2)
    with Reader() as reader:
        Wrapper(inner)(torch.ones(1, 2))
    assert reader.calls[:2] == [("root", inner), ("enter", inner, True, "")]  # the model is the root
    assert reader.hooks.names.named[0] == (inner, None)  # named as the wrapper started
    assert [call[0] for call in reader.calls] == ["root", "enter", "leave"]


def test_a_forward_that_raises_is_left_with_no_output_and_the_stack_unwinds():
    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("the user's error")

    model = nn.Sequential(nn.Linear(2, 2), Fails())
    for with_kwargs in (False, True):
        with Reader(with_kwargs=with_kwargs) as reader, pytest.raises(ValueError, match="the user's error"):
            model(torch.ones(1, 2))
        left = [call for call in reader.calls if call[0] == "leave"]
        assert [call[1] for call in left] == [model[0], model[1], model]
        # torch calls an always_call hook as hook(module, args, None) when forward raised, kwargs or not
        assert left[1][4] == (None,) and left[2][4] == (None,)
        *kwargs, output = left[0][4]  # the Linear's, which returned
        assert kwargs == ([{}] if with_kwargs else []) and isinstance(output, torch.Tensor)
        assert reader.hooks.running == []


def test_while_a_reader_does_not_watch_nothing_is_pushed_and_no_root_told():
    watching = [True]
    model = nn.Sequential(nn.Linear(2, 2))
    with Reader(watching=lambda: watching[0]) as reader:
        watching[0] = False
        model(torch.ones(1, 2))
        assert reader.calls == [] and reader.hooks.forward_seen
        watching[0] = True
        model(torch.ones(1, 2))
    assert [call[0] for call in reader.calls] == ["root", "enter", "enter", "leave", "leave"]


def test_a_readers_hook_error_switches_off_that_readers_hook_only_under_its_own_name(monkeypatch, capsys):
    monkeypatch.setattr(hook_guard, "broken_hooks", set())
    broken, healthy = Reader(), Reader()
    broken.hooks._owner = "Broken"

    def fails(module, args, root):
        raise ZeroDivisionError("injected fault")

    broken.hooks._enter = fails
    model = nn.Linear(2, 2)
    with broken, healthy:
        out = model(torch.ones(1, 2))
        model(torch.ones(1, 2))
    assert out.shape == (1, 2)  # the run goes on
    assert hook_guard.broken_hooks == {"Broken._on_module_pre_forward"}
    assert capsys.readouterr().err.count("internal error in Broken._on_module_pre_forward") == 1
    assert [call[0] for call in healthy.calls] == ["root", "enter", "leave"] * 2
    hook_guard.revive_hooks("Broken")
    assert hook_guard.broken_hooks == set()
