"""Rules about specific calls: amp, unsupported torch APIs.

Each handler looks at one API (resolved through the import table) and either rewrites the call
(adding the NPU device argument, upgrading torch.cuda.amp to torch.amp) or reports what cannot be
migrated faithfully. (More call rules are libcst codemods: npukit.migrate.codemods.)
"""

from __future__ import annotations

import ast

from npukit.migrate import rules
from npukit.migrate.unsupported_apis import UNSUPPORTED_TORCH_APIS


def lacks_device_argument(call: ast.Call, qualified: str, *, starred_may_give_it: bool = True) -> bool:
    """rules.lacks_device_argument for an ast call (the audit's)."""
    return rules.lacks_device_argument(qualified, len(call.args), any(isinstance(a, ast.Starred) for a in call.args),
                                       {k.arg for k in call.keywords}, starred_may_give_it=starred_may_give_it)


class CallRules:
    """Mixin for PythonMigrator: API-specific call rewrites and checks, decorators."""

    def _handle_calls(self) -> None:
        for call in self.calls:
            func = call.func
            qualified = self.qualname(func)
            method = func.attr if isinstance(func, ast.Attribute) else None
            if qualified is not None:
                if qualified.startswith("torch.cuda.amp.") or (
                    qualified.startswith("torch.amp.") and self._is_upgraded_amp(func)
                ):
                    self._handle_amp_call(call, qualified)
            self._handle_device_sinks(call, qualified, method)
            if method == "add_argument":
                self._handle_argparse(call)
            elif method == "startswith" and self._is_device_like(func.value) and call.args:
                self._rewrite_device_choices(call.args[0], "device-compare")
            if qualified is not None and qualified in UNSUPPORTED_TORCH_APIS and qualified not in rules.CUDA_FLAGGED:
                self._flag_unsupported(call, qualified)

    def _is_upgraded_amp(self, func: ast.AST) -> bool:
        root = func
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and self.rebound.get(root.id, "").startswith("torch.amp") and \
            self.bindings.get(root.id, "").startswith("torch.cuda.amp")

    def _handle_amp_call(self, call: ast.Call, qualified: str) -> None:
        member = qualified.rsplit(".", 1)[1]
        if member not in rules.AMP_CALLS:
            return
        root = call.func
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in self.rebound and not self._is_upgraded_amp(call.func):
            return  # imported from torch_npu.npu.amp, whose defaults are already the NPU
        self.claimed.add(id(call.func))
        if not self._is_upgraded_amp(call.func) and not self._rewrite_chain(call.func, "torch.amp." + member, "amp-upgrade"):
            return
        if member == "autocast":
            self._convert_autocast_positionals(call)
            self._insert_first_arg(call, '"npu"', "amp-upgrade")
        elif member == "GradScaler":
            self._insert_first_arg(call, '"npu"', "amp-upgrade")
        else:  # custom_fwd / custom_bwd used as @decorator(...)
            self._append_keyword(call, 'device_type="npu"', "amp-upgrade")

    def _convert_autocast_positionals(self, call: ast.Call) -> None:
        for index, arg in enumerate(call.args[: len(rules.CUDA_AUTOCAST_POSITIONAL)]):
            name = rules.CUDA_AUTOCAST_POSITIONAL[index]
            self._edit(arg, f"{name}={self.pos.segment(arg)}", "amp-upgrade")

    def _insert_first_arg(self, call: ast.Call, text: str, rule: str) -> None:
        if call.args:
            first = call.args[0]
            if isinstance(first, ast.Starred):
                return
            start, _ = self.pos.span(first)
            self._edit((start, start), f"{text}, ", rule)
        elif call.keywords:
            start, _ = self.pos.span(call.keywords[0])
            self._edit((start, start), f"{text}, ", rule)
        else:
            _, end = self.pos.span(call)
            self._edit((end - 1, end - 1), text, rule)

    def _append_keyword(self, call: ast.Call, text: str, rule: str, *, needs_torch_npu: bool = True) -> None:
        _, end = self.pos.span(call)
        inside = self.text[self.pos.span(call.func)[1]:end - 1]
        if call.args or call.keywords:
            last = (call.args + [k.value for k in call.keywords])[-1]
            _, last_end = self.pos.span(last)
            tail = self.text[last_end:end - 1]
            if "," in tail:  # a trailing comma: insert after it
                comma = last_end + tail.index(",") + 1
                self._edit((comma, comma), f" {text},", rule, needs_torch_npu=needs_torch_npu)
            else:
                self._edit((last_end, last_end), f", {text}", rule, needs_torch_npu=needs_torch_npu)
        elif inside.strip("( \t") == "":
            self._edit((end - 1, end - 1), text, rule, needs_torch_npu=needs_torch_npu)

    def _handle_decorators(self) -> None:
        for decorator in self.decorators:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            qualified = self.qualname(target)
            if qualified is not None and not isinstance(decorator, ast.Call) and (
                qualified.startswith("torch.cuda.amp.custom_") or self._is_upgraded_amp(target)
                and qualified.rsplit(".", 1)[-1] in ("custom_fwd", "custom_bwd")
            ):
                member = qualified.rsplit(".", 1)[1]
                self.claimed.add(id(target))
                if self._is_upgraded_amp(target):
                    self._edit(target, self.pos.segment(target) + '(device_type="npu")', "amp-upgrade")
                else:
                    text = self._replacement_text(target, "torch.amp." + member)
                    if text is not None:
                        self._edit(target, text + '(device_type="npu")', "amp-upgrade")
