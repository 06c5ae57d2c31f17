"""Names: the file's import table, which the remaining ast rules resolve names with.

Names are resolved through the file's own import table (`import torch as th`, `from torch import
cuda`, `import torch.cuda as tc` ...): `th.cuda.synchronize()` is found, `numba.cuda.jit` is not
mistaken for torch. (The rules about names are libcst codemods: CudaNamespace, AmpUpgrade and
UnsupportedApis in npukit.migrate.codemods.)
"""

from __future__ import annotations

import ast

from npukit.migrate.codemods.cuda_methods import TORCH_CLASSES_WITH_CUDA


class NameRules:
    """Mixin for PythonMigrator: the import table, and whether a `.cuda` is a value's (the CudaMethods
    codemod's candidates)."""

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

    @staticmethod
    def _root_name(node: ast.AST) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

