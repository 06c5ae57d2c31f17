"""CUDA -> NPU rewrite of one Python source, decided on its syntax tree.

The tree comes from the stdlib `ast` parser (C speed) and every rewrite is a replacement of the
exact source span of one node, so everything outside the edited nodes - comments, formatting,
quotes, line endings - stays byte-for-byte. Names are resolved through a per-file alias table
built from the file's imports (`import torch as th`, `from torch import cuda`, ...); there is no
whole-program analysis. Device strings are rewritten only where they are device uses: a device
parameter, a comparison with a device expression, or a variable that flows into one.
"""

from __future__ import annotations

import ast
import bisect
import re
import warnings
from dataclasses import dataclass

from npukit.migrate import rules
from npukit.migrate.model import Change, Edit, Finding
from npukit.migrate.rules import Flag
from npukit.migrate.unsupported_apis import UNSUPPORTED_TORCH_APIS

_NEWLINE = re.compile(r"\r\n|\r|\n")
_STRING_HEAD = re.compile(r"([A-Za-z]*)('''|\"\"\"|'|\")")
_CONFIG_RECEIVERS = frozenset(
    {"args", "opt", "opts", "cfg", "config", "conf", "flags", "FLAGS", "hparams", "hp", "options", "params", "settings"}
)
_TORCH_CLASSES_WITH_CUDA = frozenset({"torch.Tensor", "torch.nn.Module", "torch.UntypedStorage", "torch.TypedStorage"})
_TEST_PARENTS = (ast.If, ast.While, ast.BoolOp, ast.UnaryOp, ast.IfExp, ast.Assert, ast.Compare)
_SCOPE_NODES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)

# rules whose effect torch_npu's runtime transfer_to_npu also achieves (used by --runtime)
TRANSFER_TO_NPU_COVERS = frozenset(
    {"cuda-namespace", "cuda-import", "cuda-method", "is-cuda", "device-string", "device-variable", "amp-upgrade",
     "cuda-graph", "cuda-renamed", "backend-string", "int-ordinal", "import-torch-npu", "default-tensor-type"}
)


class MigrationSyntaxError(Exception):
    """The source does not parse; carries a message naming the line."""


@dataclass
class PythonOutcome:
    text: str  # the new source (== input when nothing changed)
    changes: list[Change]
    findings: list[Finding]
    edits: list[Edit]  # what turned the input into text (offsets into the input)


class _Positions:
    """Maps ast positions (1-based line, UTF-8 byte column) to offsets in the decoded text."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.line_starts = [0] + [m.end() for m in _NEWLINE.finditer(text)]

    def offset(self, line: int, col: int) -> int:
        start = self.line_starts[line - 1]
        end = self.line_starts[line] if line < len(self.line_starts) else len(self.text)
        line_text = self.text[start:end]
        if line_text.isascii():
            return start + col
        return start + len(line_text.encode("utf-8")[:col].decode("utf-8", errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset))

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def line_text(self, line: int) -> str:
        start = self.line_starts[line - 1]
        end = self.line_starts[line] if line < len(self.line_starts) else len(self.text)
        return self.text[start:end].rstrip("\r\n")


def _parse(text: str, path: str) -> ast.Module:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences etc. are the user's business
            return ast.parse(text, filename=path)
    except SyntaxError as exc:
        where = f"line {exc.lineno}" if exc.lineno else "unknown line"
        raise MigrationSyntaxError(f"does not parse as Python 3 ({where}: {exc.msg})") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
        raise MigrationSyntaxError(f"does not parse as Python 3 ({type(exc).__name__}: {exc})") from None


def _string_value(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _last_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class PythonMigrator:
    """Analyses one module and produces non-overlapping edits plus findings."""

    def __init__(self, text: str, path: str) -> None:
        self.text = text
        self.path = path
        self.pos = _Positions(text)
        self.tree = _parse(text, path)
        self.edits: dict[tuple[int, int], Edit] = {}
        self.findings: dict[tuple[int, int, str], Finding] = {}
        self.claimed: set[int] = set()  # ids of nodes a specific rule has dealt with
        self.frozen: list[tuple[int, int]] = []  # spans never edited (the CUDA branch of dual-target code)
        self._qualname_cache: dict[int, str | None] = {}
        self._collect()

    # ------------------------------------------------------------------ collection (one pass)
    def _collect(self) -> None:
        self.parent: dict[int, ast.AST] = {}
        self.scope_of: dict[int, ast.AST] = {}
        self.assigned: dict[int, set[str]] = {}  # scope id -> names bound there
        self.calls: list[ast.Call] = []
        self.attributes: list[ast.Attribute] = []
        self.strings: list[ast.Constant] = []
        self.compares: list[ast.Compare] = []
        self.fstrings: list[ast.JoinedStr] = []
        self.assigns: list[ast.AST] = []
        self.imports: list[ast.AST] = []
        self.functions: list[ast.AST] = []
        self.cuda_method_classes: set[str] = set()
        self.docstrings: set[int] = set()
        self.ifs: list[ast.If] = []
        self.dicts: list[ast.Dict] = []
        self.decorators: list[ast.AST] = []
        self.loads: dict[str, list[ast.Name]] = {}

        module = self.tree
        self.assigned[id(module)] = set()
        stack: list[tuple[ast.AST, ast.AST]] = [(module, module)]
        parent = self.parent
        scope_of = self.scope_of
        loads = self.loads
        while stack:
            node, scope = stack.pop()
            kind = type(node)
            inner_scope = scope
            if kind is ast.Name:
                scope_of[id(node)] = scope
                if type(node.ctx) is ast.Load:
                    loads.setdefault(node.id, []).append(node)
                else:
                    self.assigned[id(scope)].add(node.id)
            elif kind is ast.Attribute:
                self.attributes.append(node)
            elif kind is ast.Call:
                self.calls.append(node)
            elif kind is ast.Constant:
                if type(node.value) is str:
                    self.strings.append(node)
            elif kind is ast.Compare:
                self.compares.append(node)
            elif kind is ast.JoinedStr:
                self.fstrings.append(node)
            elif kind is ast.Dict:
                self.dicts.append(node)
            elif kind is ast.Assign or kind is ast.AnnAssign:
                self.assigns.append(node)
                scope_of[id(node)] = scope
            elif kind is ast.Import or kind is ast.ImportFrom:
                self.imports.append(node)
                for alias in node.names:
                    self.assigned[id(scope)].add((alias.asname or alias.name).split(".")[0])
            elif kind is ast.If:
                self.ifs.append(node)
            elif kind in _SCOPE_NODES:
                inner_scope = self._enter_scope(node, scope)
            for name in _child_fields(kind):
                value = getattr(node, name)
                # a function's decorators, defaults and annotations belong to the enclosing scope
                child_scope = inner_scope if name == "body" else scope
                if type(value) is list:
                    for child in value:
                        if isinstance(child, ast.AST):
                            parent[id(child)] = node
                            stack.append((child, child_scope))
                elif isinstance(value, ast.AST):
                    parent[id(value)] = node
                    stack.append((value, child_scope))

    def _enter_scope(self, node: ast.AST, scope: ast.AST) -> ast.AST:
        kind = type(node)
        if kind is ast.Module:
            inner = scope
        else:
            self.assigned[id(scope)].add(getattr(node, "name", ""))
            self.scope_of[id(node)] = scope
            self.decorators.extend(getattr(node, "decorator_list", ()))
            inner = node
        body = node.body
        if type(body) is list and body:
            first = body[0]
            if isinstance(first, ast.Expr) and _string_value(first.value) is not None:
                self.docstrings.add(id(first.value))
        if kind is ast.ClassDef:
            self.assigned[id(node)] = set()
            for item in body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "cuda":
                    self.cuda_method_classes.add(node.name)
        elif kind is not ast.Module:
            self.functions.append(node)
            self.assigned[id(node)] = {a.arg for a in _all_args(node.args)}
        return inner

    # ------------------------------------------------------------------ helpers
    def qualname(self, node: ast.AST) -> str | None:
        key = id(node)
        if key in self._qualname_cache:
            return self._qualname_cache[key]
        result = None
        if isinstance(node, ast.Name):
            result = self.bindings.get(node.id)
        elif isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            if base is not None:
                result = f"{base}.{node.attr}"
        self._qualname_cache[key] = result
        return result

    def _edit(self, node_or_span, text: str, rule: str, *, needs_torch_npu: bool = True) -> None:
        """Replace a node's source (or a (start, end) span) with text."""
        if isinstance(node_or_span, tuple):
            start, end = node_or_span
        else:
            start, end = self.pos.span(node_or_span)
        if self.text[start:end] == text or any(a <= start and end <= b for a, b in self.frozen):
            return
        line = bisect.bisect_right(self.pos.line_starts, start)
        col = start - self.pos.line_starts[line - 1] + 1  # where the replaced text itself starts
        self.edits.setdefault((start, end), Edit(start, end, text, rule, line, col, needs_torch_npu))

    def _flag(self, node: ast.AST, flag: Flag, *, reason: str | None = None) -> None:
        key = (node.lineno, node.col_offset, flag.kind)
        if key in self.findings:
            return
        self.findings[key] = Finding(
            path=self.path, line=node.lineno, col=node.col_offset + 1, kind=flag.kind, severity=flag.severity,
            code=self.pos.line_text(node.lineno).strip(), reason=reason or flag.reason, suggestion=flag.suggestion,
        )

    def _in_log_call(self, node: ast.AST) -> bool:
        current = node
        while True:
            up = self.parent.get(id(current))
            if up is None or isinstance(up, ast.stmt):
                return isinstance(up, ast.Raise)
            if isinstance(up, ast.Call) and _last_name(up.func) in rules.LOG_CALLS:
                return True
            current = up

    def _rewrite_string_prefix(self, node: ast.AST, old: str, new: str, rule: str) -> bool:
        """Rewrite the leading `old` of a string literal (plain or f-string) to `new`, keeping quotes."""
        if id(node) in self.claimed:
            return True
        start, end = self.pos.span(node)
        segment = self.text[start:end]
        head = _STRING_HEAD.match(segment)
        if head is None or not segment.startswith(old, head.end()):
            return False
        self.claimed.add(id(node))
        at = start + head.end()
        self._edit((at, at + len(old)), new, rule)
        return True

    def _rewrite_string_value(self, node: ast.Constant, new_value: str, rule: str, *, needs_torch_npu: bool = True) -> bool:
        """Replace the whole value of a simple (escape-free) string literal, keeping prefix and quotes."""
        if id(node) in self.claimed:
            return True
        segment = self.pos.segment(node)
        head = _STRING_HEAD.match(segment)
        if head is None:
            return False
        quote = head.group(2)
        body = segment[head.end():len(segment) - len(quote)]
        if body != node.value or not segment.endswith(quote) or "\\" in body:
            return False
        self.claimed.add(id(node))
        self._edit(node, f"{head.group(1)}{quote}{new_value}{quote}", rule, needs_torch_npu=needs_torch_npu)
        return True

    # ------------------------------------------------------------------ device string expressions
    def _device_literals(self, expr: ast.AST) -> list[ast.AST]:
        """String nodes that make `expr` a CUDA device value ("cuda", f"cuda:{i}", "cuda:%d" % i ...)."""
        value = _string_value(expr)
        if value is not None:
            return [expr] if rules.DEVICE_TEMPLATE.match(value) else []
        if isinstance(expr, ast.JoinedStr):
            parts = expr.values
            first = _string_value(parts[0]) if parts else None
            if first is not None and rules.DEVICE_TEMPLATE.match(first) and all(
                isinstance(p, ast.FormattedValue) for p in parts[1:]
            ) and (len(parts) == 1 or first.endswith(":")):
                return [expr]
            return []
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Mod, ast.Add)):
            left = expr.left
            while isinstance(left, ast.BinOp) and isinstance(left.op, ast.Add):
                left = left.left
            value = _string_value(left)
            if value is not None and rules.DEVICE_TEMPLATE.match(value) and (value != "cuda" or isinstance(expr.op, ast.Mod)):
                return [left]
            return []
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "format":
            value = _string_value(expr.func.value)
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

    def _backend_literal(self, expr: ast.AST) -> ast.Constant | None:
        value = _string_value(expr)
        if value is not None and rules.BACKEND_VALUE.match(value) and "nccl" in value:
            return expr
        return None

    def _rewrite_backend(self, node: ast.Constant, rule: str) -> None:
        new = re.sub(r"\bnccl\b", "hccl", re.sub(r"\bcuda\b", "npu", node.value))
        self._rewrite_string_value(node, new, rule)

    def _is_int_ordinal(self, expr: ast.AST) -> bool:
        if isinstance(expr, ast.Constant):
            return type(expr.value) is int
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "int":
            return True
        name = _last_name(expr)
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
        if isinstance(expr, ast.Call) and _last_name(expr.func) in ("str", "repr") and expr.args:
            return self._is_device_like(expr.args[0])
        if isinstance(expr, ast.Call) and _last_name(expr.func) in ("get_device_type", "get_backend"):
            return True
        name = _last_name(expr)
        if name is None:
            return False
        lowered = name.lower()
        return "device" in lowered or lowered in ("dev", "type", "accelerator") or self.qualname(expr) is None and lowered.endswith("_dev")

    # ------------------------------------------------------------------ imports / alias table
    def _build_bindings(self) -> None:
        self.bindings: dict[str, str] = {}
        self.has_torch_npu_import = False
        self.has_transfer_to_npu = False
        self.imports_torch = False
        self.module_names: set[str] = set()  # names bound by `import x` (certainly modules)
        for node in self.imports:
            module = node.module if isinstance(node, ast.ImportFrom) else None
            roots = [module.split(".")[0]] if module and node.level == 0 else []
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            self.imports_torch = self.imports_torch or "torch" in roots
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "torch_npu":
                        self.has_torch_npu_import = True
                        if alias.name.startswith("torch_npu.contrib.transfer_to_npu"):
                            self.has_transfer_to_npu = True
                    local = alias.asname or alias.name.split(".")[0]
                    self.bindings[local] = alias.name if alias.asname else local
                    self.module_names.add(local)
            elif node.level == 0 and node.module:
                if node.module.split(".")[0] == "torch_npu":
                    self.has_torch_npu_import = True
                    if node.module == "torch_npu.contrib" and any(a.name == "transfer_to_npu" for a in node.names):
                        self.has_transfer_to_npu = True
                for alias in node.names:
                    if alias.name != "*":
                        self.bindings[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        # `torch` used without an import in this file (a snippet, a notebook split) still means torch
        if "torch" not in self.bindings and "torch" not in self.assigned[id(self.tree)]:
            self.bindings["torch"] = "torch"
        self.torch_alias = next((name for name, q in self.bindings.items() if q == "torch"), None)
        # alias -> expression-space target for aliases whose import we rewrite
        self.rebound: dict[str, str] = {}

    def _amp_alias_upgradable(self, local: str, qualified: str) -> bool:
        """True if every use of `local` is a call we can give a device argument to."""
        for use in self.loads.get(local, ()):
            up = self.parent.get(id(use))
            if qualified == "torch.cuda.amp":  # module alias: uses must be amp.autocast(...) etc.
                if not (isinstance(up, ast.Attribute) and up.attr in rules.AMP_CALLS):
                    return False
                if up.attr in ("custom_fwd", "custom_bwd"):
                    continue
                call = self.parent.get(id(up))
                if not (isinstance(call, ast.Call) and call.func is up):
                    return False
            else:
                member = qualified.rsplit(".", 1)[1]
                if member not in rules.AMP_CALLS:
                    return False
                if member in ("custom_fwd", "custom_bwd"):
                    continue
                if not (isinstance(up, ast.Call) and up.func is use):
                    return False
        return True

    def _import_target(self, qualified: str, local: str) -> tuple[str, str | None] | None:
        """For an imported torch.cuda module/member: (expression-space target, rule) or None to keep."""
        if qualified == "torch.cuda":
            return "torch.npu", "cuda-import"
        if not qualified.startswith("torch.cuda."):
            return None
        if qualified == "torch.cuda.amp" or qualified.startswith("torch.cuda.amp."):
            if self._amp_alias_upgradable(local, qualified):
                return "torch.amp" + qualified[len("torch.cuda.amp"):], "amp-upgrade"
            return "torch.npu" + qualified[len("torch.cuda"):], "cuda-import"
        if qualified in rules.CUDA_RENAMED:
            return rules.CUDA_RENAMED[qualified], "cuda-import"
        parts = qualified.split(".")
        member = parts[2]
        if len(parts) == 3 and member in rules.NPU_SAME_NAME and qualified not in rules.CUDA_FLAGGED:
            return "torch.npu." + member, "cuda-import"
        if len(parts) == 4 and member in rules.NPU_SUBMODULE_MEMBERS and parts[3] in rules.NPU_SUBMODULE_MEMBERS[member]:
            return "torch.npu." + ".".join(parts[2:]), "cuda-import"
        return None

    def _handle_imports(self) -> None:
        for node in self.imports:
            if isinstance(node, ast.Import):
                self._handle_import(node)
            elif node.level == 0 and node.module:
                self._handle_import_from(node)
            self._flag_third_party_import(node)

    def _handle_import(self, node: ast.Import) -> None:
        """`import torch.cuda as tc` -> `import torch_npu.npu as tc`, edited alias by alias."""
        for alias in node.names:
            if not (alias.asname and alias.name.startswith("torch.cuda")):
                continue
            target = self._import_target(alias.name, alias.asname)
            if target is None:
                self._flag_cuda_qualname(node, alias.name)
                continue
            expr_target, rule = target
            self.rebound[alias.asname] = expr_target
            self._edit(alias, _alias_text(_import_space(expr_target), alias.asname), rule)

    def _handle_import_from(self, node: ast.ImportFrom) -> None:
        module = node.module
        if not (module == "torch" or module.startswith("torch.cuda") or module.startswith("torch.backends")):
            return
        # each imported name -> (target module, alias text); None target = keep as is
        plan: list[tuple[ast.alias, str, str, bool]] = []
        rule_used = "cuda-import"
        for alias in node.names:
            local = alias.asname or alias.name
            if alias.name == "*":
                plan.append((alias, "torch_npu.npu" if module == "torch.cuda" else module, "*", module == "torch.cuda"))
                continue
            qualified = f"{module}.{alias.name}"
            target = self._import_target(qualified, local)
            if target is None:
                if qualified.startswith("torch.cuda"):
                    self._flag_cuda_qualname(node, qualified)
                plan.append((alias, module, _alias_text(alias.name, alias.asname), False))
                continue
            expr_target, rule = target
            rule_used = rule if rule == "amp-upgrade" else rule_used
            self.rebound[local] = expr_target
            target_module, _, name = _import_space(expr_target).rpartition(".")
            plan.append((alias, target_module, _alias_text(name, None if name == local else local), True))
        if not any(changed for *_, changed in plan):
            return
        modules = list(dict.fromkeys(target for _, target, _, _ in plan))
        if len(modules) == 1:
            self._retarget_import_from(node, modules[0], plan, rule_used)
            return
        # names now come from different modules: split the statement (only safe without comments in it)
        if "#" in self.pos.segment(node):
            for alias, _, _, changed in plan:  # the import stays: its names keep their meaning
                if changed:
                    self.rebound.pop(alias.asname or alias.name, None)
            self._flag(node, Flag("import-split", "warning",
                                  "this import mixes torch.cuda names with others and contains comments",
                                  "split it by hand: " + "; ".join(
                                      f"from {m} import {', '.join(t for _, mm, t, _ in plan if mm == m)}" for m in modules)))
            return
        statements = [f"from {m} import {', '.join(text for _, target, text, _ in plan if target == m)}" for m in modules]
        start, _ = self.pos.span(node)
        line_start = self.pos.line_starts[node.lineno - 1]
        prefix = self.text[line_start:start]
        joiner = ("\n" + prefix) if prefix.strip() == "" else "; "
        self._edit(node, joiner.join(statements), rule_used)

    def _retarget_import_from(self, node: ast.ImportFrom, target_module: str, plan, rule: str) -> None:
        """Edit the module name and the renamed aliases in place (keeps parentheses and comments)."""
        start, end = self.pos.span(node)
        match = re.match(r"from\s+([\w.]+)\s+import\b", self.text[start:end])
        if match is None or match.group(1) != node.module:
            return
        if target_module != node.module:
            self._edit((start + match.start(1), start + match.end(1)), target_module, rule)
        for alias, _, text, changed in plan:
            if changed and alias.name != "*" and self.pos.segment(alias) != text:
                self._edit(alias, text, rule)

    def _flag_third_party_import(self, node: ast.AST) -> None:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            flag = _third_party_flag(name)
            if flag is not None:
                self._flag(node, flag)
                return

    def _flag_cuda_qualname(self, node: ast.AST, qualified: str) -> None:
        for key in _prefixes(qualified):
            if key in rules.CUDA_FLAGGED:
                self._flag(node, rules.CUDA_FLAGGED[key])
                return
        self._flag(node, _unknown_cuda(qualified))

    # ------------------------------------------------------------------ chains: torch.cuda.X etc.
    def _replacement_text(self, node: ast.AST, new_qualified: str) -> str | None:
        """Source text for `node` (a Name/Attribute chain) so that it means new_qualified."""
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name):
            base = self.rebound.get(root.id, self.bindings.get(root.id))
            if base is not None and (new_qualified == base or new_qualified.startswith(base + ".")):
                return root.id + new_qualified[len(base):]
        top, _, rest = new_qualified.partition(".")
        if top == "torch" and self.torch_alias is not None:
            return f"{self.torch_alias}.{rest}" if rest else self.torch_alias
        if top == "torch_npu":
            return new_qualified
        return None

    def _rewrite_chain(self, node: ast.AST, new_qualified: str, rule: str) -> bool:
        text = self._replacement_text(node, new_qualified)
        last = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        if text is None or not self.pos.segment(node).endswith(last):  # guard against a wrong position
            return False
        needs = new_qualified.startswith(("torch.npu", "torch_npu")) or rule not in ("cuda-renamed",)
        self._edit(node, text, rule, needs_torch_npu=needs)
        return True

    def _handle_chain(self, node: ast.AST) -> None:
        """node: the outermost Name/Attribute of a dotted chain that resolves to a qualified name."""
        prefixes: list[tuple[ast.AST, str]] = []
        current = node
        while True:
            qualified = self.qualname(current)
            if qualified is None:
                break
            prefixes.append((current, qualified))
            if not isinstance(current, ast.Attribute):
                break
            current = current.value
        for prefix_node, qualified in prefixes:  # outermost (most specific) first
            if qualified in rules.CUDA_RENAMED:
                if self._rewrite_chain(prefix_node, rules.CUDA_RENAMED[qualified], rules.CUDA_RENAMED_RULE.get(qualified, _rename_rule(qualified))):
                    if qualified in rules.RENAME_NOTES:
                        self._flag(prefix_node, rules.RENAME_NOTES[qualified])
                return
            if qualified in UNSUPPORTED_TORCH_APIS and qualified not in rules.CUDA_FLAGGED:
                self._flag_unsupported(prefix_node, qualified)
                return
            if qualified in rules.CUDA_FLAGGED:
                self._flag(prefix_node, rules.CUDA_FLAGGED[qualified])
                return
        for prefix_node, qualified in prefixes:
            if qualified == "torch.cuda" or qualified.startswith("torch.cuda."):
                self._handle_cuda_namespace(prefix_node, qualified)
                return

    def _handle_cuda_namespace(self, node: ast.AST, qualified: str) -> None:
        parts = qualified.split(".")
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in self.rebound and self.bindings.get(root.id, "").startswith("torch.cuda"):
            # the alias import is rewritten; members keep their name unless renamed/flagged
            if len(parts) >= 3 and parts[2] not in rules.NPU_SAME_NAME and parts[2] not in ("amp", "nvtx"):
                self._flag(node, _unknown_cuda(qualified))
            return
        if len(parts) == 2:
            self._rewrite_chain(node, "torch.npu", "cuda-namespace")
            return
        member = parts[2]
        if member in rules.NPU_SAME_NAME and (len(parts) == 3 or member not in rules.NPU_SUBMODULE_MEMBERS):
            self._rewrite_chain(node, "torch.npu." + ".".join(parts[2:]), "cuda-namespace")
            if qualified in rules.RENAME_NOTES:
                self._flag(node, rules.RENAME_NOTES[qualified])
            return
        if member in rules.NPU_SUBMODULE_MEMBERS and len(parts) >= 4:
            if parts[3] in rules.NPU_SUBMODULE_MEMBERS[member]:
                self._rewrite_chain(node, "torch.npu." + ".".join(parts[2:]), "cuda-namespace")
            else:
                self._flag(node, _unknown_cuda(qualified))
            return
        if member == "amp" and len(parts) >= 4:  # a non-call use (isinstance, a reference): torch_npu.npu.amp has it
            self._rewrite_chain(node, "torch.npu." + ".".join(parts[2:]), "cuda-namespace")
            return
        self._flag(node, _unknown_cuda(qualified))

    def _flag_unsupported(self, node: ast.AST, qualified: str) -> None:
        suggestion = rules.UNSUPPORTED_SUGGESTIONS.get(qualified, rules.UNSUPPORTED_GENERIC.suggestion)
        flag = Flag("unsupported-api", rules.UNSUPPORTED_GENERIC.severity, f"{qualified}: {rules.UNSUPPORTED_GENERIC.reason}", suggestion)
        self._flag(node, flag)

    # ------------------------------------------------------------------ calls
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
                elif qualified == "torch.is_autocast_enabled" and not call.args and not call.keywords:
                    self._insert_first_arg(call, '"npu"', "amp-upgrade")
                elif qualified == "torch.random.fork_rng" and not any(k.arg == "device_type" for k in call.keywords):
                    self._append_keyword(call, 'device_type="npu"', "fork-rng-device-type")
                elif qualified == rules.TORCH_LOAD:
                    self._handle_torch_load(call)
                elif qualified == "torch.set_default_tensor_type":
                    self._handle_default_tensor_type(call)
                elif qualified == "torch.cuda.get_device_properties":
                    self._check_device_properties(call)
                elif qualified == "torch.cuda.get_device_name":
                    self._check_device_name(call)
                if qualified == "torch.compile" and any(
                    k.arg == "mode" and _string_value(k.value) in ("reduce-overhead", "max-autotune") for k in call.keywords
                ):
                    self._flag(call, Flag("compile", "warning", "mode='reduce-overhead'/'max-autotune' uses CUDA graphs",
                                          "use backend='npugraph_ex' (torchair) for graph capture on NPU"))
                top = qualified.split(".")[0]
                if top in rules.THIRD_PARTY_CALLS_REPORTED or (qualified.startswith("numba.cuda.")):
                    flag = _third_party_flag(qualified)
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

    def _handle_torch_load(self, call: ast.Call) -> None:
        """A CUDA-saved checkpoint does not load on an NPU host without map_location."""
        if len(call.args) >= 2 or any(k.arg in ("map_location", None) for k in call.keywords):
            return
        up = self.parent.get(id(call))
        target = up.targets[0] if isinstance(up, ast.Assign) and len(up.targets) == 1 else None
        target_name = (_last_name(target) or "").lower() if target is not None else ""
        if any(word in target_name for word in ("model", "net", "module")):
            # a whole pickled module: on the GPU it came back on the GPU, so bring it back on the NPU
            location, why = "npu", "the loaded object looks like a whole model, which came back on the GPU before"
        else:
            # state dicts and data: load_state_dict() copies to the parameters' device anyway
            location, why = "cpu", "load_state_dict() and optimizer.load_state_dict() move tensors to the right device"
        self._append_keyword(call, f'map_location="{location}"', "torch-load-map-location", needs_torch_npu=location == "npu")
        self._flag(call, Flag("torch-load", "info",
                              f'added map_location="{location}": a checkpoint saved on CUDA does not load on an NPU '
                              f"host without it ({why})",
                              "check where the loaded tensors are used; move them with .to(device) if needed"))

    def _handle_default_tensor_type(self, call: ast.Call) -> None:
        if len(call.args) != 1 or call.keywords:
            return
        arg = call.args[0]
        name = self.qualname(arg) or _string_value(arg) or ""
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
        newline = _newline_of(self.text)
        self.claimed.add(id(arg))
        self._edit(statement, f'{torch}.set_default_device("npu"){newline}{indent}{torch}.set_default_dtype({torch}.{dtype})',
                   "default-tensor-type")
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
                self._note_flow_use(expr, "device")

    def _handle_backend_sinks(self, call: ast.Call, qualified: str | None, method: str | None) -> None:
        exprs = [k.value for k in call.keywords if k.arg == "backend"]
        name = (qualified or "").rsplit(".", 1)[-1] or method
        if name == "init_process_group" and call.args:
            exprs.append(call.args[0])
        for expr in exprs:
            literal = self._backend_literal(expr)
            if literal is not None:
                self._rewrite_backend(literal, "backend-string")
            elif isinstance(expr, (ast.Name, ast.Attribute)):
                self._note_flow_use(expr, "backend")
                if name == "init_process_group" and isinstance(expr, ast.Attribute) and self.qualname(expr) is None:
                    self._pending_backend_sinks.append(expr)

    def _handle_argparse(self, call: ast.Call) -> None:
        for keyword in call.keywords:
            if keyword.arg == "default":
                if self._rewrite_device_expr(keyword.value, "argparse-default"):
                    continue
                literal = self._backend_literal(keyword.value)
                if literal is not None:
                    self._rewrite_backend(literal, "argparse-default")
            elif keyword.arg == "choices":
                self._rewrite_device_choices(keyword.value, "argparse-default")
        for arg in call.args:
            flag_name = _string_value(arg)
            if flag_name and flag_name.startswith("-") and "cuda" in flag_name.lower():
                self._flag(arg, Flag("cli-flag", "info", f"the CLI flag {flag_name} keeps its name (it is your interface)",
                                     "only the .cuda() calls it guards were rewritten; consider renaming the flag"))
            if flag_name and flag_name.startswith("-") and "backend" in flag_name.lower():
                self.backend_flag_seen = True

    def _rewrite_device_choices(self, expr: ast.AST, rule: str) -> None:
        items = expr.elts if isinstance(expr, (ast.List, ast.Tuple, ast.Set)) else [expr]
        for item in items:
            value = _string_value(item)
            if value is None:
                continue
            if rules.DEVICE_TEMPLATE.match(value):
                self._rewrite_string_prefix(item, "cuda", "npu", rule)
            elif self._backend_literal(item) is not None:
                self._rewrite_backend(item, rule)

    # ------------------------------------------------------------------ comparisons
    def _handle_compares(self) -> None:
        for node in self.compares:
            operands = [node.left, *node.comparators]
            for index, op in enumerate(node.ops):
                left, right = operands[index], operands[index + 1]
                if isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)):
                    for const, other in ((left, right), (right, left)):
                        if _string_value(const) is None:
                            continue
                        if self._backend_literal(const) is not None and _string_value(other) is None:
                            self._rewrite_backend(const, "backend-compare")
                        elif rules.DEVICE_VALUE.match(const.value) and self._is_device_like(other):
                            self._rewrite_string_prefix(const, "cuda", "npu", "device-compare")
                elif isinstance(op, (ast.In, ast.NotIn)):
                    if isinstance(right, (ast.List, ast.Tuple, ast.Set)):
                        for item in right.elts:
                            if self._backend_literal(item) is not None:
                                self._rewrite_backend(item, "backend-compare")
                            elif _string_value(item) is not None and rules.DEVICE_VALUE.match(item.value) \
                                    and self._is_device_like(left):
                                self._rewrite_string_prefix(item, "cuda", "npu", "device-compare")
                    elif _string_value(left) is not None and rules.DEVICE_VALUE.match(left.value) \
                            and self._is_device_like(right):
                        self._rewrite_string_prefix(left, "cuda", "npu", "device-compare")

    # ------------------------------------------------------------------ simple dataflow
    def _note_flow_use(self, expr: ast.AST, kind: str) -> None:
        if isinstance(expr, ast.Name) and expr.id not in self.bindings:
            scope = self.scope_of.get(id(expr), self.tree)
            defining = self._defining_scope(expr.id, scope)
            self.flow_uses.add((kind, id(defining), expr.id))
        elif isinstance(expr, ast.Attribute) and self.qualname(expr) is None:
            self.flow_uses.add((kind, "attr", self.pos.segment(expr)))

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
        candidates: list[tuple[str, object, str, ast.AST]] = []  # (kind, key, name, value)
        for node in self.assigns:
            value = node.value
            if value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            scope = self.scope_of.get(id(node), self.tree)
            for target in targets:
                if isinstance(target, ast.Name):
                    candidates.append(("name", (id(scope), target.id), target.id, value))
                elif isinstance(target, ast.Attribute):
                    candidates.append(("attr", ("attr", self.pos.segment(target)), target.attr, value))
        for function in self.functions:
            arguments = function.args
            positional = arguments.posonlyargs + arguments.args
            for arg, default in zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults):
                candidates.append(("name", (id(function), arg.arg), arg.arg, default))
            for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
                if default is not None:
                    candidates.append(("name", (id(function), arg.arg), arg.arg, default))
        for _kind, key, name, value in candidates:
            lowered = name.lower()
            literals = self._device_literals(value)
            if literals:
                used = ("device", *key) in self.flow_uses if key[0] != "attr" else ("device", "attr", key[1]) in self.flow_uses
                if used or "device" in lowered or lowered in ("dev", "accelerator") or lowered.endswith("_dev"):
                    for literal in literals:
                        self._rewrite_string_prefix(literal, "cuda", "npu", "device-variable")
                elif isinstance(value, ast.Constant):
                    self._flag(value, Flag("device-string", "info",
                                           f"'{value.value}' is assigned to `{name}` but not seen flowing into a device use",
                                           "if it is a device, change it to 'npu' by hand"))
                continue
            literal = self._backend_literal(value)
            if literal is not None:
                used = ("backend", *key) in self.flow_uses if key[0] != "attr" else ("backend", "attr", key[1]) in self.flow_uses
                if used or "backend" in lowered:
                    self._rewrite_backend(literal, "backend-string")
        # dict displays: {"device": "cuda", "backend": "nccl"} configure a device/backend by key
        for node in self.dicts:
            for key, value in zip(node.keys, node.values):
                key_text = _string_value(key) if key is not None else None
                if key_text is None:
                    continue
                if "device" in key_text.lower():
                    self._rewrite_device_expr(value, "device-variable")
                elif "backend" in key_text.lower() and self._backend_literal(value) is not None:
                    self._rewrite_backend(value, "backend-string")
        for call in self.calls:  # dict(backend="nccl")
            if isinstance(call.func, ast.Name) and call.func.id == "dict":
                for keyword in call.keywords:
                    if keyword.arg and "backend" in keyword.arg.lower() and self._backend_literal(keyword.value) is not None:
                        self._rewrite_backend(keyword.value, "backend-string")

    # ------------------------------------------------------------------ attributes: .cuda(), .is_cuda
    def _handle_attributes(self) -> None:
        # a `cuda` that is data (an argparse flag, `self.cuda = True`) makes bare `x.cuda` references ambiguous
        cuda_is_data = "--cuda" in self.text or "--use_cuda" in self.text or "--use-cuda" in self.text or any(
            a.attr == "cuda" and not isinstance(a.ctx, ast.Load) for a in self.attributes)
        for node in self.attributes:
            up = self.parent.get(id(node))
            outermost = not (isinstance(up, ast.Attribute) and up.value is node)
            receiver = self.qualname(node.value)
            # `torch.cuda`, `numba.cuda`: a module attribute; `from m import model; model.cuda()`: a method
            receiver_is_module = receiver is not None and receiver not in _TORCH_CLASSES_WITH_CUDA and (
                receiver == "torch" or self._root_name(node.value) in self.module_names)
            if node.attr in ("cuda", "is_cuda") and not receiver_is_module:
                if id(node) in self.claimed:
                    continue
                if node.attr == "is_cuda":
                    self._rename_attr(node, "is_npu", "is-cuda")
                    continue
                called = isinstance(up, ast.Call) and up.func is node
                if self._is_user_cuda_receiver(node):
                    self._flag(node, Flag("user-cuda-method", "info",
                                          "`.cuda()` here is a method of your own class; it was kept",
                                          "rename it if it moves data to the device"))
                    continue
                if called:
                    self._rename_attr(node, "npu", "cuda-method")
                elif isinstance(node.ctx, ast.Load) and not isinstance(up, _TEST_PARENTS) and not cuda_is_data \
                        and not (isinstance(node.value, ast.Name) and node.value.id in _CONFIG_RECEIVERS):
                    self._rename_attr(node, "npu", "cuda-method")
                continue
            if outermost and id(node) not in self.claimed and self.qualname(node) is not None:
                self._handle_chain(node)
        for name, uses in self.loads.items():
            qualified = self.bindings.get(name)
            if qualified is None or not (qualified.startswith("torch.") or qualified == "torch"):
                continue
            for use in uses:
                up = self.parent.get(id(use))
                if isinstance(up, ast.Attribute) or id(use) in self.claimed:
                    continue
                self._handle_chain(use)

    @staticmethod
    def _root_name(node: ast.AST) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def _rename_attr(self, node: ast.Attribute, new: str, rule: str) -> None:
        _, end = self.pos.span(node)
        if self.text[end - len(node.attr):end] != node.attr:  # a position the parser got wrong: do nothing
            return
        self._edit((end - len(node.attr), end), new, rule)

    def _is_user_cuda_receiver(self, node: ast.Attribute) -> bool:
        if not self.cuda_method_classes:
            return False
        receiver = node.value
        if isinstance(receiver, ast.Name) and receiver.id == "self":
            return self._enclosing_class_defines_cuda(node)
        if isinstance(receiver, ast.Call) and _last_name(receiver.func) == "super":
            return self._enclosing_class_defines_cuda(node)
        if isinstance(receiver, ast.Call) and _last_name(receiver.func) in self.cuda_method_classes:
            return True
        if isinstance(receiver, ast.Name):
            for assign in self.assigns:
                if isinstance(assign, ast.Assign) and isinstance(assign.value, ast.Call) \
                        and _last_name(assign.value.func) in self.cuda_method_classes \
                        and any(isinstance(t, ast.Name) and t.id == receiver.id for t in assign.targets):
                    return True
        return False

    def _enclosing_class_defines_cuda(self, node: ast.AST) -> bool:
        current = self.parent.get(id(node))
        while current is not None:
            if isinstance(current, ast.ClassDef):
                return current.name in self.cuda_method_classes
            current = self.parent.get(id(current))
        return False

    # ------------------------------------------------------------------ strings: env vars, nvidia-smi, leftovers
    def _handle_strings(self) -> None:
        for node in self.strings:
            if id(node) in self.docstrings or id(node) in self.claimed:
                continue
            value = node.value
            up = self.parent.get(id(node))
            if isinstance(up, (ast.JoinedStr, ast.FormattedValue)):
                continue  # parts of f-strings have no reliable position; the f-string is the unit
            if value in rules.ENV_RENAMES:
                if self._rewrite_string_value(node, rules.ENV_RENAMES[value], "env-var", needs_torch_npu=False):
                    if value in rules.ENV_RENAME_NOTES:
                        self._flag(node, rules.ENV_RENAME_NOTES[value])
                continue
            if value in rules.ENV_FLAGGED:
                self._flag(node, rules.ENV_FLAGGED[value])
                continue
            if re.fullmatch(r"(TORCH_)?NCCL_[A-Z0-9_]+", value):
                self._flag(node, rules.NCCL_ENV_FLAG, reason=f"{value}: {rules.NCCL_ENV_FLAG.reason}")
                continue
            if value.lstrip().startswith("nvidia-smi"):
                self._flag(node, rules.NVIDIA_SMI)
                continue
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
            elif self._backend_literal(node) is not None and not is_dict_key:
                self._flag(node, Flag("backend-string", "info",
                                      f"'{value}' is not in a recognised backend position and was left unchanged",
                                      "change it to 'hccl' by hand if it names the process-group backend"))
            elif rules.ENV_NAME.search(value) and not self._in_log_call(node):
                self._flag(node, Flag("env-var", "warning", "a CUDA/NCCL environment variable inside a string",
                                      "ASCEND_RT_VISIBLE_DEVICES / PYTORCH_NPU_ALLOC_CONF / ASCEND_LAUNCH_BLOCKING; "
                                      "NCCL_* have HCCL_* counterparts with other knobs"))

    def _handle_fstrings(self) -> None:
        for node in self.fstrings:
            if id(node) in self.claimed or self._in_log_call(node):
                continue
            up = self.parent.get(id(node))
            if isinstance(up, ast.Dict) and any(k is node for k in up.keys):
                continue
            if self._device_literals(node):  # f"cuda:{rank}" says by itself that it is a device
                self._rewrite_string_prefix(node, "cuda", "npu", "device-string")
            elif node.values and (_string_value(node.values[0]) or "").lstrip().startswith("nvidia-smi"):
                self._flag(node, rules.NVIDIA_SMI)

    def _handle_decorators(self) -> None:
        for decorator in self.decorators:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            qualified = self.qualname(target)
            if qualified in rules.THIRD_PARTY_DECORATORS:
                self._flag(decorator, _third_party_flag(qualified))
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
                        self._flag(sub, Flag("dual-target", "info",
                                             "this if/elif already has an NPU branch; the CUDA branch was kept",
                                             "nothing to do"))
                        branch = self._if_for_test(node, test)
                        self.frozen.append((self.pos.span(test)[0], self.pos.span(branch.body[-1])[1]))

    @staticmethod
    def _if_for_test(node: ast.If, test: ast.AST) -> ast.If:
        while node.test is not test:
            node = node.orelse[0]
        return node

    def _flag_backend_sinks(self) -> None:
        for expr in self._pending_backend_sinks:
            self._flag(expr, Flag("backend-string", "info",
                                  f"the process-group backend comes from {self.pos.segment(expr)}",
                                  "make sure it resolves to 'hccl' (argparse/config defaults of 'nccl' were rewritten)"))

    # ------------------------------------------------------------------ driver
    def analyse(self) -> tuple[list[Edit], list[Finding]]:
        self.flow_uses: set[tuple] = set()
        self._pending_backend_sinks: list[ast.AST] = []
        self.backend_flag_seen = False
        self._build_bindings()
        self._handle_dual_target_ifs()
        self._handle_imports()
        self._handle_decorators()
        self._handle_calls()
        self._handle_compares()
        self._handle_assignments()
        self._handle_attributes()
        self._handle_strings()
        self._handle_fstrings()
        self._flag_backend_sinks()
        edits = sorted(self.edits.values(), key=lambda e: (e.start, e.end))
        edits = _drop_overlaps(edits)
        findings = sorted(self.findings.values(), key=lambda f: (f.line, f.col, f.kind))
        return edits, findings

    def insertion_point(self) -> int | None:
        """Offset where `import torch_npu` goes: after the docstring and `from __future__` imports."""
        body = self.tree.body
        if not body:
            return None
        index = 0
        if isinstance(body[0], ast.Expr) and _string_value(body[0].value) is not None:
            index = 1
        while index < len(body) and isinstance(body[index], ast.ImportFrom) and body[index].module == "__future__":
            index += 1
        if index < len(body) and body[index].lineno > (body[index - 1].end_lineno if index else 0):
            return self.pos.line_starts[body[index].lineno - 1]  # right before the first real statement
        last = body[index - 1]
        if last.end_lineno < len(self.pos.line_starts):
            return self.pos.line_starts[last.end_lineno]
        return len(self.text)


_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}
_NOT_CHILDREN = frozenset({"ctx", "op", "ops", "type_ignores"})  # singletons and operators: no rule needs them


def _child_fields(kind: type) -> tuple[str, ...]:
    fields = _CHILD_FIELDS.get(kind)
    if fields is None:
        fields = tuple(f for f in kind._fields if f not in _NOT_CHILDREN)
        _CHILD_FIELDS[kind] = fields
    return fields


def _all_args(arguments: ast.arguments) -> list[ast.arg]:
    result = arguments.posonlyargs + arguments.args + arguments.kwonlyargs
    if arguments.vararg:
        result.append(arguments.vararg)
    if arguments.kwarg:
        result.append(arguments.kwarg)
    return result


def _alias_text(name: str, asname: str | None) -> str:
    return f"{name} as {asname}" if asname else name


def _import_space(expr_qualified: str) -> str:
    """torch.npu.X is only an attribute alias; imports must name the real module torch_npu.npu."""
    if expr_qualified == "torch.npu" or expr_qualified.startswith("torch.npu."):
        return "torch_npu.npu" + expr_qualified[len("torch.npu"):]
    return expr_qualified


def _prefixes(qualified: str) -> list[str]:
    parts = qualified.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _third_party_flag(qualified: str) -> Flag | None:
    for prefix in _prefixes(qualified):
        if prefix in rules.THIRD_PARTY:
            return rules.THIRD_PARTY[prefix]
    return None


def _unknown_cuda(qualified: str) -> Flag:
    return Flag("unknown-cuda-api", "warning", f"{qualified} has no known torch_npu equivalent",
                "check the torch_npu API list; rewrite by hand or remove")


def _rename_rule(qualified: str) -> str:
    if ".nvtx" in qualified:
        return "nvtx-to-mstx"
    return "cuda-renamed"


def _newline_of(text: str) -> str:
    match = _NEWLINE.search(text)
    return match.group(0) if match else "\n"


def _drop_overlaps(edits: list[Edit]) -> list[Edit]:
    """Keep edits that do not overlap an earlier one (insertions at one point are all kept)."""
    kept: list[Edit] = []
    last_end = -1
    for edit in edits:
        if edit.start < last_end and not (edit.start == edit.end == kept[-1].end):
            continue
        kept.append(edit)
        last_end = max(last_end, edit.end)
    return kept


def apply_edits(text: str, edits: list[Edit]) -> str:
    pieces = []
    position = 0
    for edit in edits:
        pieces.append(text[position:edit.start])
        pieces.append(edit.text)
        position = edit.end
    pieces.append(text[position:])
    return "".join(pieces)


TRANSFER_TO_NPU_IMPORT = "import torch_npu\nfrom torch_npu.contrib import transfer_to_npu"


def _is_entry_point(tree: ast.Module) -> bool:
    for statement in tree.body:
        if isinstance(statement, ast.If) and isinstance(statement.test, ast.Compare):
            text = ast.dump(statement.test)
            if "__name__" in text and "__main__" in text:
                return True
    return False


def remap_findings(findings: list[Finding], text: str, edits: list[Edit]) -> list[Finding]:
    """Move findings to their line numbers in the rewritten text (edits may add lines)."""
    growth = [(e.start, e.text.count("\n") - text.count("\n", e.start, e.end)) for e in edits]
    growth = [(start, delta) for start, delta in growth if delta]
    if not growth:
        return findings
    positions = _Positions(text)
    remapped = []
    for finding in findings:
        offset = positions.line_starts[min(finding.line, len(positions.line_starts)) - 1]
        shift = sum(delta for start, delta in growth if start <= offset)
        remapped.append(Finding(finding.path, finding.line + shift, finding.col, finding.kind, finding.severity,
                                finding.code, finding.reason, finding.suggestion))
    return remapped


def migrate_python(text: str, path: str, *, runtime: bool = False, entry_point: bool | None = None) -> PythonOutcome:
    """Rewrite one Python source. Raises MigrationSyntaxError if it does not parse.

    Findings carry the line numbers of the input; remap_findings moves them to the output.
    """
    migrator = PythonMigrator(text, path)
    edits, findings = migrator.analyse()
    newline = _newline_of(text)
    if runtime:
        is_entry = _is_entry_point(migrator.tree) if entry_point is None else entry_point
        return _runtime_outcome(migrator, edits, findings, newline, is_entry)
    if edits and any(e.needs_torch_npu for e in edits) and migrator.imports_torch and not migrator.has_torch_npu_import:
        at = migrator.insertion_point()
        if at is not None:
            prefix = newline if at == len(text) and text and not text.endswith(("\n", "\r")) else ""
            line = text.count("\n", 0, at) + 1
            edits = sorted([*edits, Edit(at, at, f"{prefix}import torch_npu{newline}", "import-torch-npu", line, 1)],
                           key=lambda e: (e.start, e.end))
    new_text = apply_edits(text, edits)
    if new_text != text:
        try:
            _parse(new_text, path)
        except MigrationSyntaxError as exc:  # a bug in a rule must never corrupt a user's file
            finding = Finding(path, 1, 1, "internal-error", "error", "", f"the rewrite would not parse ({exc}); file left unchanged",
                              "please report this file to the npukit maintainers")
            return PythonOutcome(text, [], [*findings, finding], [])
    changes = [Change(path, e.line, e.col, e.rule, text[e.start:e.end], e.text.strip("\r\n")) for e in edits]
    return PythonOutcome(new_text, changes, findings, edits)


def _runtime_outcome(migrator: PythonMigrator, edits: list[Edit], findings: list[Finding], newline: str,
                     is_entry: bool) -> PythonOutcome:
    """--runtime: keep the source, insert transfer_to_npu at entry points, report what it does not cover."""
    text = migrator.text
    extra = []
    for edit in edits:
        if edit.rule not in TRANSFER_TO_NPU_COVERS:
            extra.append(Finding(migrator.path, edit.line, edit.col, "not-covered-by-transfer_to_npu", "warning",
                                 migrator.pos.line_text(edit.line).strip(),
                                 f"transfer_to_npu does not handle this ({edit.rule})",
                                 f"change it by hand: {text[edit.start:edit.end]!r} -> {edit.text!r}"))
    findings = sorted([*findings, *extra], key=lambda f: (f.line, f.col, f.kind))
    uses_torch = any(q == "torch" or q.startswith("torch.") for q in migrator.bindings.values()) and "torch" in text
    if migrator.has_transfer_to_npu or not is_entry or not uses_torch:
        return PythonOutcome(text, [], findings, [])
    at = migrator.insertion_point()
    lines = [] if migrator.has_torch_npu_import else ["import torch_npu"]
    lines.append("from torch_npu.contrib import transfer_to_npu")
    insertion = "".join(line + newline for line in lines)
    line = text.count("\n", 0, at) + 1
    edit = Edit(at, at, insertion, "runtime-transfer-to-npu", line, 1)
    change = Change(migrator.path, line, 1, edit.rule, "", insertion.strip())
    return PythonOutcome(apply_edits(text, [edit]), [change], findings, [edit])
