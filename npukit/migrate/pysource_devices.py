"""Rules about device and backend values: "cuda" -> "npu", "nccl" -> "hccl".

A string is rewritten only where it is a device use: a device parameter (`torch.device(...)`,
`device=`, `.to(...)`, `map_location=` ...), a comparison with a device expression, an argparse
default, or a variable that flows into one (simple intra-file dataflow). Other "cuda" strings are
reported, never guessed; docstrings, comments and log messages are never touched.
"""

from __future__ import annotations

import ast

from npukit.migrate import rules
from npukit.migrate.pysource_model import last_name, string_value
from npukit.migrate.rules import Flag


class DeviceRules:
    """Mixin for PythonMigrator: device/backend strings, int ordinals, comparisons, dataflow."""

    def _device_literals(self, expr: ast.AST) -> list[ast.AST]:
        """String nodes that make `expr` a CUDA device value ("cuda", f"cuda:{i}", "cuda:%d" % i ...)."""
        value = string_value(expr)
        if value is not None:
            return [expr] if rules.DEVICE_TEMPLATE.match(value) else []
        if isinstance(expr, ast.JoinedStr):
            parts = expr.values
            first = string_value(parts[0]) if parts else None
            if first is not None and rules.DEVICE_TEMPLATE.match(first) and all(
                isinstance(p, ast.FormattedValue) for p in parts[1:]
            ) and (len(parts) == 1 or first.endswith(":")):
                return [expr]
            return []
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Mod, ast.Add)):
            left = expr.left
            while isinstance(left, ast.BinOp) and isinstance(left.op, ast.Add):
                left = left.left
            value = string_value(left)
            if value is not None and rules.DEVICE_TEMPLATE.match(value) and (value != "cuda" or isinstance(expr.op, ast.Mod)):
                return [left]
            return []
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "format":
            value = string_value(expr.func.value)
            if value is not None and rules.DEVICE_TEMPLATE.match(value):
                return [expr.func.value]
            return []
        if isinstance(expr, ast.IfExp):
            return self._device_literals(expr.body) + self._device_literals(expr.orelse)
        if isinstance(expr, ast.BoolOp):
            found: list[ast.AST] = []
            for value_node in expr.values:
                found += self._device_literals(value_node)
            return found
        return []

    def _rewrite_device_expr(self, expr: ast.AST, rule: str) -> bool:
        literals = self._device_literals(expr)
        for literal in literals:
            self._rewrite_string_prefix(literal, "cuda", "npu", rule)
        return bool(literals)

    def _is_int_ordinal(self, expr: ast.AST) -> bool:
        if isinstance(expr, ast.Constant):
            return type(expr.value) is int
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "int":
            return True
        name = last_name(expr)
        return name is not None and name in rules.INT_ORDINAL_NAMES and self.qualname(expr) is None

    def _rewrite_int_ordinal(self, expr: ast.AST) -> None:
        if isinstance(expr, ast.Constant):
            self._edit(expr, f'"npu:{expr.value}"', "int-ordinal")
            return
        source = self.pos.segment(expr)
        quote = '"' if '"' not in source else "'"
        if quote in source or "\n" in source:
            return
        self._edit(expr, f"f{quote}npu:{{{source}}}{quote}", "int-ordinal")

    def _is_device_like(self, expr: ast.AST) -> bool:
        """An expression that evidently holds a device or device type (x.device.type, args.device ...)."""
        if isinstance(expr, ast.Call) and last_name(expr.func) in ("str", "repr") and expr.args:
            return self._is_device_like(expr.args[0])
        if isinstance(expr, ast.Call) and last_name(expr.func) in ("get_device_type", "get_backend"):
            return True
        name = last_name(expr)
        if name is None:
            return False
        lowered = name.lower()
        return "device" in lowered or lowered in ("dev", "type", "accelerator") or self.qualname(expr) is None and lowered.endswith("_dev")

    # device and backend positions
    def _handle_device_sinks(self, call: ast.Call, qualified: str | None, method: str | None) -> None:
        positions: list[tuple[ast.AST, bool]] = []  # (expr, int ordinal allowed)
        for keyword in call.keywords:
            if keyword.arg and rules.DEVICE_KEYWORD.match(keyword.arg):
                positions.append((keyword.value, keyword.arg == "device"))
        if call.args and not isinstance(call.args[0], ast.Starred):
            if qualified in rules.DEVICE_FIRST_ARG:
                positions.append((call.args[0], False))
                if qualified == "torch.device" and len(call.args) == 1 and self._is_int_ordinal(call.args[0]) \
                        and not isinstance(call.args[0], ast.Constant):
                    self._insert_first_arg(call, '"npu"', "int-ordinal")
            elif method in rules.DEVICE_FIRST_ARG_METHODS and qualified is None:
                positions.append((call.args[0], True))
            elif qualified == rules.TORCH_LOAD and len(call.args) >= 2:
                positions.append((call.args[1], False))
        positions += [(arg, False) for arg in self._local_device_arguments(call)]
        for expr, ints_allowed in positions:
            if self._rewrite_device_expr(expr, "device-string"):
                continue
            if isinstance(expr, ast.Dict):  # map_location={"cuda:1": "cuda:0"}
                for item in list(expr.keys) + list(expr.values):
                    if item is not None:
                        self._rewrite_device_expr(item, "device-string")
            elif ints_allowed and self._is_int_ordinal(expr):
                self._rewrite_int_ordinal(expr)
            else:
                self._note_flow_use(expr)

    def _local_device_arguments(self, call: ast.Call) -> list[ast.AST]:
        """Positional arguments of this file's own functions whose parameter is named like a device."""
        name = call.func.id if isinstance(call.func, ast.Name) else None
        if name is None or name in self.bindings:
            return []
        if not hasattr(self, "_local_signatures"):
            self._local_signatures: dict[str, list[str]] = {}
            for function in self.functions:
                if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    params = [a.arg for a in function.args.posonlyargs + function.args.args]
                    # one name defined twice with different signatures is ambiguous: keep neither
                    known = self._local_signatures.setdefault(function.name, params)
                    if known != params:
                        self._local_signatures[function.name] = []
        params = self._local_signatures.get(name, [])
        return [arg for arg, param in zip(call.args, params)
                if not isinstance(arg, ast.Starred) and "device" in param.lower()]

    def _handle_argparse(self, call: ast.Call) -> None:
        for keyword in call.keywords:
            if keyword.arg == "default":
                self._rewrite_device_expr(keyword.value, "argparse-default")
            elif keyword.arg == "choices":
                self._rewrite_device_choices(keyword.value, "argparse-default")

    def _rewrite_device_choices(self, expr: ast.AST, rule: str) -> None:
        items = expr.elts if isinstance(expr, (ast.List, ast.Tuple, ast.Set)) else [expr]
        for item in items:
            value = string_value(item)
            if value is not None and rules.DEVICE_TEMPLATE.match(value):
                self._rewrite_string_prefix(item, "cuda", "npu", rule)

    def _handle_compares(self) -> None:
        for node in self.compares:
            operands = [node.left, *node.comparators]
            for index, op in enumerate(node.ops):
                left, right = operands[index], operands[index + 1]
                if isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)):
                    for const, other in ((left, right), (right, left)):
                        if string_value(const) is not None and rules.DEVICE_VALUE.match(const.value) \
                                and self._is_device_like(other):
                            self._rewrite_string_prefix(const, "cuda", "npu", "device-compare")
                elif isinstance(op, (ast.In, ast.NotIn)):
                    if isinstance(right, (ast.List, ast.Tuple, ast.Set)):
                        for item in right.elts:
                            if string_value(item) is not None and rules.DEVICE_VALUE.match(item.value) \
                                    and self._is_device_like(left):
                                self._rewrite_string_prefix(item, "cuda", "npu", "device-compare")
                    elif string_value(left) is not None and rules.DEVICE_VALUE.match(left.value) \
                            and self._is_device_like(right):
                        self._rewrite_string_prefix(left, "cuda", "npu", "device-compare")

    def _note_flow_use(self, expr: ast.AST) -> None:
        """A variable or attribute that flows into a device use: ("attr", source) or (scope id, name)."""
        if isinstance(expr, ast.Name) and expr.id not in self.bindings:
            scope = self.scope_of.get(id(expr), self.tree)
            self.flow_uses.add((id(self._defining_scope(expr.id, scope)), expr.id))
        elif isinstance(expr, ast.Attribute) and self.qualname(expr) is None:
            self.flow_uses.add(("attr", self.pos.segment(expr)))

    def _defining_scope(self, name: str, scope: ast.AST) -> ast.AST:
        current = scope
        while current is not None:
            if name in self.assigned.get(id(current), ()):
                return current
            if current is self.tree:
                break
            current = self.scope_of.get(id(current), self.tree)
            while isinstance(current, ast.ClassDef):  # class bodies are not enclosing scopes for functions
                current = self.scope_of.get(id(current), self.tree)
        return self.tree

    def _handle_assignments(self) -> None:
        candidates: list[tuple[tuple, str, ast.AST]] = []  # (flow key, name, value)
        for node in self.assigns:
            value = node.value
            if value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            scope = self.scope_of.get(id(node), self.tree)
            for target in targets:
                if isinstance(target, ast.Name):
                    candidates.append(((id(scope), target.id), target.id, value))
                elif isinstance(target, ast.Attribute):
                    candidates.append((("attr", self.pos.segment(target)), target.attr, value))
        for function in self.functions:
            arguments = function.args
            positional = arguments.posonlyargs + arguments.args
            for arg, default in zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults):
                candidates.append(((id(function), arg.arg), arg.arg, default))
            for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
                if default is not None:
                    candidates.append(((id(function), arg.arg), arg.arg, default))
        for key, name, value in candidates:
            lowered = name.lower()
            literals = self._device_literals(value)
            if literals:
                if key in self.flow_uses or "device" in lowered or lowered in ("dev", "accelerator") or lowered.endswith("_dev"):
                    for literal in literals:
                        self._rewrite_string_prefix(literal, "cuda", "npu", "device-variable")
                elif isinstance(value, ast.Constant):
                    self._flag(value, Flag("device-string", "info",
                                           f"'{value.value}' is assigned to `{name}` but not seen flowing into a device use",
                                           "if it is a device, change it to 'npu' by hand"))
        # dict displays: {"device": "cuda"} configure a device by key; so does an item assignment:
        # kwargs["device_type"] = "cuda"
        keyed = [(node.keys, node.values) for node in self.dicts]
        keyed += [([target.slice], [node.value]) for node in self.assigns if node.value is not None
                  for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                  if isinstance(target, ast.Subscript)]
        for keys, values in keyed:
            for key, value in zip(keys, values):
                key_text = string_value(key) if key is not None else None
                if key_text is None:
                    continue
                if "device" in key_text.lower():
                    self._rewrite_device_expr(value, "device-variable")

    def _handle_strings(self) -> None:
        for node in self.strings:
            if id(node) in self.docstrings or id(node) in self.claimed:
                continue
            value = node.value
            up = self.parent.get(id(node))
            if isinstance(up, (ast.JoinedStr, ast.FormattedValue)):
                continue  # parts of f-strings have no reliable position; the f-string is the unit
            if self._in_log_call(node):
                continue
            is_dict_key = isinstance(up, ast.Dict) and any(k is node for k in up.keys)
            if value != "cuda" and rules.DEVICE_TEMPLATE.match(value) and not is_dict_key:
                # "cuda:0", "cuda:%d", "cuda:{}": the text itself says it is a device
                self._rewrite_string_prefix(node, "cuda", "npu", "device-string")
            elif rules.DEVICE_VALUE.match(value) and not is_dict_key:
                self._flag(node, Flag("device-string", "info",
                                      f"'{value}' is not in a recognised device position and was left unchanged",
                                      "change it to 'npu' by hand if it names the device"))

    def _handle_fstrings(self) -> None:
        for node in self.fstrings:
            if id(node) in self.claimed or self._in_log_call(node):
                continue
            up = self.parent.get(id(node))
            if isinstance(up, ast.Dict) and any(k is node for k in up.keys):
                continue
            if self._device_literals(node):  # f"cuda:{rank}" says by itself that it is a device
                self._rewrite_string_prefix(node, "cuda", "npu", "device-string")

    def _handle_availability_choices(self) -> None:
        """`"cuda" if torch.cuda.is_available() else "cpu"` names a device wherever it appears (case 1)."""
        for node in self.conditionals:
            if any(isinstance(sub, ast.Call) and self.qualname(sub.func) == "torch.cuda.is_available"
                   for sub in ast.walk(node.test)):
                self._rewrite_device_expr(node, "device-string")
