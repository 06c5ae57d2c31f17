"""Rules about specific calls: amp, torch.load, fork_rng, set_default_tensor_type, capability checks.

Each handler looks at one API (resolved through the import table) and either rewrites the call
(adding the NPU device argument, upgrading torch.cuda.amp to torch.amp) or reports what cannot be
migrated faithfully (device capability, device names parsed for GPU models, third-party kernels).
"""

from __future__ import annotations

import ast
import re

from npukit.migrate import rules
from npukit.migrate.pysource_model import newline_of, string_value
from npukit.migrate.pysource_names import third_party_flag
from npukit.migrate.rules import Flag
from npukit.migrate.unsupported_apis import UNSUPPORTED_TORCH_APIS


def lacks_device_argument(call: ast.Call, qualified: str, *, starred_may_give_it: bool = True) -> bool:
    """rules.lacks_device_argument for an ast call (the audit's)."""
    return rules.lacks_device_argument(qualified, len(call.args), any(isinstance(a, ast.Starred) for a in call.args),
                                       {k.arg for k in call.keywords}, starred_may_give_it=starred_may_give_it)


class CallRules:
    """Mixin for PythonMigrator: API-specific call rewrites and checks, decorators, dual-target code."""

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
                elif qualified in ("torch.get_autocast_gpu_dtype", "torch.set_autocast_gpu_dtype"):
                    self._handle_autocast_gpu_dtype(call, qualified)
                elif qualified in rules.LEGACY_CONSTRUCTORS and (call.args or call.keywords) and (
                        self.facts.cuda_default_tensor_type or "set_default_tensor_type" in self.text):
                    self._flag(call, rules.LEGACY_CONSTRUCTOR_CALL)
                elif qualified == "torch.set_default_tensor_type":
                    self._handle_default_tensor_type(call)
                elif qualified == "torch.cuda.get_device_properties":
                    self._check_device_properties(call)
                elif qualified == "torch.cuda.get_device_name":
                    self._check_device_name(call)
                if qualified == "torch.compile" and any(
                    k.arg == "mode" and string_value(k.value) in ("reduce-overhead", "max-autotune") for k in call.keywords
                ):
                    self._flag(call, Flag("compile", "warning", "mode='reduce-overhead'/'max-autotune' uses CUDA graphs",
                                          "use backend='npugraph_ex' (torchair) for graph capture on NPU"))
                top = qualified.split(".")[0]
                if top in rules.THIRD_PARTY_CALLS_REPORTED or (qualified.startswith("numba.cuda.")):
                    flag = third_party_flag(qualified)
                    if flag is not None:
                        self._flag(call, flag)
            self._handle_device_sinks(call, qualified, method)
            self._handle_backend_sinks(call, qualified, method)
            if method == "add_argument":
                self._handle_argparse(call)
            elif method == "startswith" and self._is_device_like(func.value) and call.args:
                self._rewrite_device_choices(call.args[0], "device-compare")
            if method in rules.UNSUPPORTED_TENSOR_METHODS and qualified is None:
                self._flag(call, Flag("unsupported-api", "warning",
                                      f"Tensor.{method} is not supported by torch_npu (if the receiver is a tensor)",
                                      rules.UNSUPPORTED_GENERIC.suggestion))
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

    def _handle_autocast_gpu_dtype(self, call: ast.Call, qualified: str) -> None:
        new = "torch.get_autocast_dtype" if qualified.endswith("get_autocast_gpu_dtype") else "torch.set_autocast_dtype"
        self.claimed.add(id(call.func))
        if self._rewrite_chain(call.func, new, "amp-upgrade"):
            self._insert_first_arg(call, '"npu"', "amp-upgrade")

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

    def _handle_default_tensor_type(self, call: ast.Call) -> None:
        if len(call.args) != 1 or call.keywords:
            return
        arg = call.args[0]
        name = self.qualname(arg) or string_value(arg) or ""
        match = re.fullmatch(r"torch\.cuda\.(Float|Half|BFloat16|Double)Tensor", name)
        statement = self.parent.get(id(call))
        if match is None or not isinstance(statement, ast.Expr) or self.torch_alias is None:
            return
        dtype = {"Float": "float32", "Half": "float16", "BFloat16": "bfloat16", "Double": "float64"}[match.group(1)]
        line_start = self.pos.line_starts[statement.lineno - 1]
        indent = self.text[line_start:self.pos.span(statement)[0]]
        if indent.strip():
            return
        torch = self.torch_alias
        newline = newline_of(self.text)
        self.claimed.add(id(arg))
        self._edit(statement, f'{torch}.set_default_device("npu"){newline}{indent}{torch}.set_default_dtype({torch}.{dtype})',
                   "default-tensor-type")
        self._flag(call, rules.LEGACY_CONSTRUCTOR_DEFAULT)
        if dtype == "float64":
            self._flag(call, rules.RENAME_NOTES["torch.cuda.DoubleTensor"])

    def _check_device_properties(self, call: ast.Call) -> None:
        up = self.parent.get(id(call))
        flag = Flag("device-properties", "error",
                    "NPU device properties have no major/minor/multi_processor_count (name and total_memory are fine)",
                    "gate on torch.npu.get_device_name() or a feature check")
        if isinstance(up, ast.Attribute) and up.attr in rules.DEVICE_PROPERTY_FIELDS_MISSING:
            self._flag(up, flag)
        elif isinstance(up, ast.Assign) and len(up.targets) == 1 and isinstance(up.targets[0], ast.Name):
            for use in self.loads.get(up.targets[0].id, ()):
                above = self.parent.get(id(use))
                if isinstance(above, ast.Attribute) and above.attr in rules.DEVICE_PROPERTY_FIELDS_MISSING:
                    self._flag(above, flag)

    def _check_device_name(self, call: ast.Call) -> None:
        up = self.parent.get(id(call))
        compared = isinstance(up, (ast.Compare, ast.Attribute))
        if isinstance(up, ast.Assign) and len(up.targets) == 1 and isinstance(up.targets[0], ast.Name):
            compared = any(
                isinstance(self.parent.get(id(use)), (ast.Compare, ast.Attribute))
                for use in self.loads.get(up.targets[0].id, ())
            )
        if compared:
            self._flag(call, Flag("device-name", "warning",
                                  "the device name is parsed (e.g. for 'A100'/'H100'); an NPU reports e.g. 'Ascend910B...'",
                                  "decide on a feature (torch.npu.is_bf16_supported(), memory size) instead of a GPU model"))

    def _handle_dual_target_ifs(self) -> None:
        """`if torch.cuda.is_available(): ... elif torch.npu.is_available():` keeps its CUDA branch."""
        for node in self.ifs:
            chain_tests = []
            current = node
            while True:
                chain_tests.append(current.test)
                if len(current.orelse) == 1 and isinstance(current.orelse[0], ast.If):
                    current = current.orelse[0]
                else:
                    break
            if len(chain_tests) < 2:
                continue
            sources = [self.pos.segment(t) for t in chain_tests]
            if not any("npu" in s for s in sources):
                continue
            for test in chain_tests:
                for sub in ast.walk(test):
                    if isinstance(sub, ast.Attribute) and self.qualname(sub) == "torch.cuda.is_available":
                        branch = self._if_for_test(node, test)
                        self._flag(sub, Flag("dual-target", "info",
                                             "this if/elif already has an NPU branch; the CUDA branch was kept",
                                             "nothing to do"), end_line=branch.body[-1].end_lineno)
                        self.frozen.append((self.pos.span(test)[0], self.pos.span(branch.body[-1])[1]))
        for conditional in self.conditionals:  # "cuda" if torch.cuda.is_available() else "npu" if ... else "cpu"
            text = self.pos.segment(conditional)
            if "npu" in text and any(isinstance(sub, ast.Attribute) and self.qualname(sub) == "torch.cuda.is_available"
                                     for sub in ast.walk(conditional.test)):
                self._flag(conditional, Flag("dual-target", "info",
                                             "this expression already has an NPU choice; its CUDA choice was kept",
                                             "nothing to do"), end_line=conditional.end_lineno)
                self.frozen.append(self.pos.span(conditional))

    @staticmethod
    def _if_for_test(node: ast.If, test: ast.AST) -> ast.If:
        while node.test is not test:
            node = node.orelse[0]
        return node

    def _handle_decorators(self) -> None:
        for decorator in self.decorators:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            qualified = self.qualname(target)
            if qualified in rules.THIRD_PARTY_DECORATORS:
                self._flag(decorator, third_party_flag(qualified))
            elif qualified is not None and not isinstance(decorator, ast.Call) and (
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
