"""Rules about names: imports, the torch.cuda namespace, unsupported APIs.

Names are resolved through the file's own import table (`import torch as th`, `from torch import
cuda`, `import torch.cuda as tc` ...): `th.cuda.synchronize()` is found, `numba.cuda.jit` is not
mistaken for torch. Imports of torch.cuda are retargeted to torch_npu.npu in place.
"""

from __future__ import annotations

import ast
import re

from npukit.migrate import rules
from npukit.migrate.codemods.cuda_methods import TORCH_CLASSES_WITH_CUDA
from npukit.migrate.rules import Flag
from npukit.migrate.unsupported_apis import UNSUPPORTED_TORCH_APIS


class NameRules:
    """Mixin for PythonMigrator: import table, torch.cuda.* chains (`.cuda()` and `.is_cuda` on values are
    the CudaMethods codemod's)."""

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
                if not self._called_or_decorating(up, up.attr in ("custom_fwd", "custom_bwd")):
                    return False
            else:
                member = qualified.rsplit(".", 1)[1]
                if member not in rules.AMP_CALLS:
                    return False
                if not self._called_or_decorating(use, member in ("custom_fwd", "custom_bwd")):
                    return False
        return True

    def _called_or_decorating(self, node: ast.AST, decorator: bool) -> bool:
        """`node(...)`, or for a decorator also a bare `@node`: a use that can be given device_type.
        (A decorator passed around as a value cannot: `wrap(custom_fwd)`.)"""
        up = self.parent.get(id(node))
        if isinstance(up, ast.Call) and up.func is node:
            return True
        return decorator and isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and any(
            item is node for item in up.decorator_list)

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

    def _flag_cuda_qualname(self, node: ast.AST, qualified: str) -> None:
        for key in rules.dotted_prefixes(qualified):
            if key in rules.CUDA_FLAGGED:
                self._flag(node, rules.CUDA_FLAGGED[key])
                return
        self._flag(node, unknown_cuda_flag(qualified))

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
                self._flag(node, unknown_cuda_flag(qualified))
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
                self._flag(node, unknown_cuda_flag(qualified))
            return
        if member == "amp" and len(parts) >= 4:  # a non-call use (isinstance, a reference): torch_npu.npu.amp has it
            self._rewrite_chain(node, "torch.npu." + ".".join(parts[2:]), "cuda-namespace")
            return
        self._flag(node, unknown_cuda_flag(qualified))

    def _flag_unsupported(self, node: ast.AST, qualified: str) -> None:
        if self._is_type_reference(node):
            return  # isinstance(m, nn.GRU), except X, annotations: a type check runs the API nowhere
        suggestion = rules.UNSUPPORTED_SUGGESTIONS.get(qualified, rules.UNSUPPORTED_GENERIC.suggestion)
        flag = Flag("unsupported-api", rules.UNSUPPORTED_GENERIC.severity, f"{qualified}: {rules.UNSUPPORTED_GENERIC.reason}", suggestion)
        self._flag(node, flag)

    def _handle_attributes(self) -> None:
        for node in self.attributes:
            if self.cuda_method_use(node):
                continue  # the CudaMethods codemod's
            up = self.parent.get(id(node))
            outermost = not (isinstance(up, ast.Attribute) and up.value is node)
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

    def cuda_method_use(self, node: ast.Attribute) -> bool:
        """`.cuda` / `.is_cuda` on a value (a tensor, a module, an object of the user's), not an attribute
        of a module the imports name (`torch.cuda`, `numba.cuda`): the CudaMethods codemod's."""
        if node.attr not in ("cuda", "is_cuda"):
            return False
        receiver = self.qualname(node.value)
        return not (receiver is not None and receiver not in TORCH_CLASSES_WITH_CUDA
                    and (receiver == "torch" or self._module_binding_reaches(node.value)))

    def module_attribute_by_binding(self, node: ast.Attribute) -> bool:
        """Whether `node` is a module's attribute or a value's is decided by which binding of its root
        name reaches it (a name `import x` binds, unless the receiver is torch or a torch class)."""
        receiver = self.qualname(node.value)
        return receiver is not None and receiver != "torch" and receiver not in TORCH_CLASSES_WITH_CUDA and \
            self._root_name(node.value) in self.module_names

    def _module_binding_reaches(self, receiver: ast.AST) -> bool:
        """The receiver's root name is bound by `import x` at this use, not rebound to a value first.

        Decided per use site: the last binding of the name before the use in the scope that defines it
        (a use inside a function, of a module-level name that is also assigned, cannot be decided).
        """
        root = receiver
        while isinstance(root, ast.Attribute):
            root = root.value
        if not isinstance(root, ast.Name) or root.id not in self.module_names:
            return False
        scope = self._defining_scope(root.id, self.scope_of.get(id(root), self.tree))
        bindings = self._binding_sites(root.id, scope)
        if all(is_import for _, is_import in bindings):
            return True
        if self.scope_of.get(id(root), self.tree) is not scope:
            return False  # a nested scope sees whichever binding ran last: unknown
        before = [is_import for line, is_import in bindings if line < root.lineno]
        return bool(before) and before[-1]

    def _binding_sites(self, name: str, scope: ast.AST) -> list[tuple[int, bool]]:
        """(line, is an import) of every binding of `name` directly in `scope`, in source order."""
        cache = self._binding_site_cache
        key = (name, id(scope))
        if key in cache:
            return cache[key]
        sites: list[tuple[int, bool]] = []
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and \
                any(a.arg == name for a in ast.walk(scope.args) if isinstance(a, ast.arg)):
            sites.append((0, False))  # a parameter
        for node in self.imports:
            if self.scope_of.get(id(node), self.tree) is scope:
                if any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                    sites.append((node.lineno, True))
        for node in self.stores.get(name, ()):
            if self.scope_of.get(id(node)) is scope:
                sites.append((node.lineno, False))
        for node in self.definitions:
            if getattr(node, "name", None) == name and self.scope_of.get(id(node)) is scope:
                sites.append((node.lineno, False))
        sites.sort()
        cache[key] = sites
        return sites

    def _is_type_reference(self, node: ast.AST) -> bool:
        """`node` is a class named in isinstance/issubclass, an except clause or an annotation."""
        up = self.parent.get(id(node))
        if isinstance(up, ast.Tuple):
            node, up = up, self.parent.get(id(up))
        if isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id in ("isinstance", "issubclass"):
            return len(up.args) == 2 and up.args[1] is node
        if isinstance(up, ast.ExceptHandler):
            return up.type is node
        current = node
        while isinstance(up, (ast.Subscript, ast.BinOp, ast.Tuple, ast.Attribute)):  # Optional[nn.GRU], A | B
            current, up = up, self.parent.get(id(up))
        return (isinstance(up, ast.arg) and up.annotation is current) or \
            (isinstance(up, ast.AnnAssign) and up.annotation is current) or \
            (isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)) and up.returns is current)

    @staticmethod
    def _root_name(node: ast.AST) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None


def _alias_text(name: str, asname: str | None) -> str:
    return f"{name} as {asname}" if asname else name


def _import_space(expr_qualified: str) -> str:
    """torch.npu.X is only an attribute alias; imports must name the real module torch_npu.npu."""
    if expr_qualified == "torch.npu" or expr_qualified.startswith("torch.npu."):
        return "torch_npu.npu" + expr_qualified[len("torch.npu"):]
    return expr_qualified


def unknown_cuda_flag(qualified: str) -> Flag:
    return Flag("unknown-cuda-api", "warning", f"{qualified} has no known torch_npu equivalent",
                "check the torch_npu API list; rewrite by hand or remove")


def _rename_rule(qualified: str) -> str:
    if ".nvtx" in qualified:
        return "nvtx-to-mstx"
    return "cuda-renamed"
