"""The torch.cuda namespace: imports of it retargeted to torch_npu.npu, `torch.cuda.*` name chains
rewritten or reported; and the walk over torch name chains that UnsupportedApis shares."""

from __future__ import annotations

import ast
import re

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod
from npukit.migrate.codemods.cuda_methods import ATTRIBUTES, TORCH_CLASSES_WITH_CUDA
from npukit.migrate.codemods.scopes import dotted_name
from npukit.migrate.rules import Flag
from npukit.migrate.unsupported_apis import UNSUPPORTED_TORCH_APIS

_FROM_IMPORT = re.compile(r"from\s+([\w.]+)\s+import\b")
PLAIN_DECORATORS = ("custom_fwd", "custom_bwd")  # amp members that may decorate without a call


def unknown_cuda_flag(qualified: str) -> Flag:
    return Flag("unknown-cuda-api", "warning", f"{qualified} has no known torch_npu equivalent",
                "check the torch_npu API list; rewrite by hand or remove")


def is_torch_cuda(qualified: str) -> bool:
    return qualified == "torch.cuda" or qualified.startswith("torch.cuda.")


def chain_entry(qualified_prefixes: list[tuple[object, str]]) -> tuple[object, str, str] | None:
    """Which rule governs a name chain, from its (node, dotted name) prefixes, the most specific first:
    (prefix node, its dotted name, "renamed" | "unsupported" | "flagged" | "namespace"), or None."""
    for node, qualified in qualified_prefixes:
        if qualified in rules.CUDA_RENAMED:
            return node, qualified, "renamed"
        if qualified in UNSUPPORTED_TORCH_APIS and qualified not in rules.CUDA_FLAGGED:
            return node, qualified, "unsupported"
        if qualified in rules.CUDA_FLAGGED:
            return node, qualified, "flagged"
    for node, qualified in qualified_prefixes:
        if is_torch_cuda(qualified):
            return node, qualified, "namespace"
    return None


def ast_chain_candidates(model) -> list[ast.AST]:
    """The outermost name chains of the file's `ast` model that some chain rule may govern (a
    necessary condition: chain_entry finds an entry), and its names bound to torch members."""
    found = []
    for node in model.attributes:
        up = model.parent.get(id(node))
        if not (isinstance(up, ast.Attribute) and up.value is node) and model.qualname(node) is not None and \
                _ast_entry(model, node) is not None:
            found.append(node)
    for name, uses in model.loads.items():
        qualified = model.bindings.get(name)
        if qualified is not None and qualified.startswith("torch.") and chain_entry([(None, qualified)]) is not None:
            found += [use for use in uses if not isinstance(model.parent.get(id(use)), ast.Attribute)]
    return found


def qualified_prefixes(node, qualname, attribute_type: type) -> list[tuple[object, str]]:
    """(node, dotted name) of a name chain and of each chain it extends (`torch.cuda.x`, `torch.cuda`,
    `torch`), the most specific first, while they resolve through the imports (qualname); in either
    tree (attribute_type: ast.Attribute or cst.Attribute)."""
    prefixes = []
    while True:
        qualified = qualname(node)
        if qualified is None:
            break
        prefixes.append((node, qualified))
        if not isinstance(node, attribute_type):
            break
        node = node.value
    return prefixes


def _ast_entry(model, node: ast.AST):
    return chain_entry(qualified_prefixes(node, model.qualname, ast.Attribute))


class TorchNameChains:
    """visit_ methods handing `chain(prefix, qualified, kind)` the rule that governs each outermost name
    chain of the code (`torch.cuda.x.y`, `th.backends.cudnn.benchmark`, a name imported from torch),
    as chain_entry decides it: not in import statements, not nodes another codemod claimed, not a
    value's `.cuda` / `.is_cuda` (CudaMethods')."""

    def visit_Module(self, node: cst.Module) -> None:
        self.inner: set[int] = set()  # the values of attributes: not outermost
        self.import_depth = 0

    def visit_Import(self, node: cst.Import) -> None:
        self.import_depth += 1

    def leave_Import(self, original_node: cst.Import, updated_node: cst.Import) -> cst.Import:
        self.import_depth -= 1
        return updated_node

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        self.import_depth += 1

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> cst.ImportFrom:
        self.import_depth -= 1
        return updated_node

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.inner.add(id(node.value))
        if self.import_depth or id(node) in self.inner or id(node) in self.facts.claimed:
            return
        entry = self._entry(node)
        # a value's `.cuda` / `.is_cuda` is CudaMethods'
        if entry is not None and (node.attr.value not in ATTRIBUTES or self._module_attribute(node)):
            self.chain(*entry)

    def visit_Name(self, node: cst.Name) -> None:
        if self.import_depth or id(node) in self.inner or id(node) in self.facts.claimed or \
                not self.facts.bindings.get(node.value, "").startswith("torch."):
            return
        entry = self._entry(node)
        if entry is not None and self.facts.is_read(node):
            self.chain(*entry)

    def _entry(self, node: cst.BaseExpression) -> tuple | None:
        """chain_entry of the chain `node` ends, kept for the other codemods that walk the chains."""
        entries = self.facts.chain_entries
        if id(node) not in entries:
            entries[id(node)] = chain_entry(qualified_prefixes(node, self.facts.qualname, cst.Attribute))
        return entries[id(node)]

    def chain(self, node: cst.BaseExpression, qualified: str, kind: str) -> None:
        raise NotImplementedError

    def _module_attribute(self, node: cst.Attribute) -> bool:
        """`torch.version.cuda`, `torch.backends.cuda`: a module's attribute, not a value's method (as
        CudaMethods decides it)."""
        receiver = self.facts.qualname(node.value)
        module_names = {name for statement, names in self.facts.scopes.imports if isinstance(statement, cst.Import)
                        for name in names} if receiver is not None and receiver != "torch" else set()
        return receiver is not None and receiver not in TORCH_CLASSES_WITH_CUDA and (
            receiver == "torch" or self.facts.module_binding_reaches(node.value, module_names))


def import_target(qualified: str, amp_upgradable) -> tuple[str, str] | None:
    """For an imported torch.cuda module or member: (what it means after the rewrite, the rule), or None
    to keep it. amp_upgradable(): whether every use of the name can be given the device."""
    if qualified == "torch.cuda":
        return "torch.npu", "cuda-import"
    if not qualified.startswith("torch.cuda."):
        return None
    if qualified == "torch.cuda.amp" or qualified.startswith("torch.cuda.amp."):
        if amp_upgradable():
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


class ImportRetargets:
    """What becomes of the file's imports of torch.cuda (a FileFacts fact: the codemods that rewrite
    its names need to know which names the imports now bind):
    - `rebound`: local name -> what it means after the rewrite (`tc` -> torch.npu, `autocast` ->
      torch.amp.autocast), in expression space;
    - `plans`: how each import statement to rewrite is rewritten;
    - `flags`: the torch.cuda names each import statement imports that have no NPU counterpart.
    An amp import becomes torch.amp only when every use of its name can be given the device
    (a call, or a bare @custom_fwd / @custom_bwd); otherwise torch_npu.npu.amp."""

    def __init__(self, facts) -> None:
        self.facts = facts
        self.rebound: dict[str, str] = {}
        # import statement -> [(alias, its target module, its new text, changed, the rule of the change)]
        self.plans: dict[int, list[tuple[cst.ImportAlias | None, str, str, bool, str]]] = {}
        self.flags: dict[int, list[str]] = {}
        self._uses: dict[str, list[tuple[cst.CSTNode, cst.CSTNode]]] | None = None
        # (npu-migrate parses a file whole when one of its imports may be retargeted: CudaNamespace.candidates)
        if facts.whole_file or any(is_torch_cuda(qualified) for qualified in facts.bindings.values()):
            collector = _Imports()
            facts.module.visit(collector)
            # in the ast engine's order (the last statement first): where two imports bind one name, the first wins
            for statement in reversed(collector.statements):
                if isinstance(statement, cst.Import):
                    self._plan_import(statement)
                else:
                    self._plan_import_from(statement)

    def _plan_import(self, node: cst.Import) -> None:
        for alias in node.names:
            name = dotted_name(alias.name)
            if not (alias.asname and name.startswith("torch.cuda")):
                continue
            local = alias.asname.name.value
            target = self._target(name, local)
            if target is None:
                self.flags.setdefault(id(node), []).append(name)
                continue
            self.rebound[local] = target[0]
            self.plans.setdefault(id(node), []).append(
                (alias, "", _alias_text(_import_space(target[0]), local), True, target[1]))

    def _plan_import_from(self, node: cst.ImportFrom) -> None:
        if node.relative or node.module is None:
            return
        module = dotted_name(node.module)
        if not (module == "torch" or module.startswith("torch.cuda") or module.startswith("torch.backends")):
            return
        plan: list[tuple[cst.ImportAlias | None, str, str, bool]] = []
        rule = "cuda-import"
        if isinstance(node.names, cst.ImportStar):
            plan.append((None, "torch_npu.npu" if module == "torch.cuda" else module, "*", module == "torch.cuda"))
        else:
            for alias in node.names:
                name = dotted_name(alias.name)
                asname = alias.asname.name.value if alias.asname else None
                local = asname or name
                qualified = f"{module}.{name}"
                target = self._target(qualified, local)
                if target is None:
                    if qualified.startswith("torch.cuda"):
                        self.flags.setdefault(id(node), []).append(qualified)
                    plan.append((alias, module, _alias_text(name, asname), False))
                    continue
                self.rebound[local] = target[0]
                rule = target[1] if target[1] == "amp-upgrade" else rule
                target_module, _, new_name = _import_space(target[0]).rpartition(".")
                plan.append((alias, target_module, _alias_text(new_name, None if new_name == local else local), True))
        if not any(changed for *_, changed in plan):
            return
        modules = list(dict.fromkeys(target for _, target, _, _ in plan))
        start, end = self.facts.span(node)
        if len(modules) > 1 and "#" in self.facts.positions.text[start:end]:
            for alias, _, _, changed in plan:  # the import stays: its names keep their meaning
                if changed and alias is not None:
                    self.rebound.pop(alias.asname.name.value if alias.asname else dotted_name(alias.name), None)
        self.plans[id(node)] = [(*entry, rule) for entry in plan]

    def _target(self, qualified: str, local: str) -> tuple[str, str] | None:
        return import_target(qualified, lambda: self._amp_alias_upgradable(local, qualified))

    def _amp_alias_upgradable(self, local: str, qualified: str) -> bool:
        """Every read of `local` is a use that can be given the device: `amp.autocast(...)` for the
        module, a call of the member, or a bare decorator for custom_fwd / custom_bwd."""
        if self._uses is None:
            collector = _NameUses(self.facts)
            self.facts.module.visit(collector)
            self._uses = collector.uses
        for use, up, above in self._uses.get(local, ()):
            if qualified == "torch.cuda.amp":
                if not (isinstance(up, cst.Attribute) and up.value is use and up.attr.value in rules.AMP_CALLS):
                    return False
                if not _called_or_decorating(up, above, up.attr.value in PLAIN_DECORATORS):
                    return False
            else:
                member = qualified.rsplit(".", 1)[1]
                if member not in rules.AMP_CALLS or not _called_or_decorating(use, up, member in PLAIN_DECORATORS):
                    return False
        return True


def _called_or_decorating(node: cst.CSTNode, up: cst.CSTNode | None, decorator: bool) -> bool:
    """`node(...)`, or for a decorator also a bare `@node`. (A decorator passed around as a value
    cannot be given device_type: `wrap(custom_fwd)`.)"""
    if isinstance(up, cst.Call) and up.func is node:
        return True
    return decorator and isinstance(up, cst.Decorator) and up.decorator is node


class _Imports(cst.CSTVisitor):
    def __init__(self) -> None:
        self.statements: list[cst.CSTNode] = []

    def visit_Import(self, node: cst.Import) -> bool:
        self.statements.append(node)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        self.statements.append(node)
        return False


class _NameUses(cst.CSTVisitor):
    """Each read of a name: (the Name, its parent, its grandparent)."""

    def __init__(self, facts) -> None:
        self.reads = {id(name) for names in facts.scopes.reads.values() for name in names}
        self.stack: list[cst.CSTNode] = []
        self.uses: dict[str, list[tuple[cst.CSTNode, cst.CSTNode | None, cst.CSTNode | None]]] = {}

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.Name) and id(node) in self.reads:
            up = self.stack[-1] if self.stack else None
            above = self.stack[-2] if len(self.stack) > 1 else None
            self.uses.setdefault(node.value, []).append((node, up, above))
        self.stack.append(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self.stack.pop()


def _alias_text(name: str, asname: str | None) -> str:
    return f"{name} as {asname}" if asname else name


def _import_space(expr_qualified: str) -> str:
    """torch.npu.X is only an attribute alias; imports must name the real module torch_npu.npu."""
    if expr_qualified == "torch.npu" or expr_qualified.startswith("torch.npu."):
        return "torch_npu.npu" + expr_qualified[len("torch.npu"):]
    return expr_qualified


def _rename_rule(qualified: str) -> str:
    return "nvtx-to-mstx" if ".nvtx" in qualified else "cuda-renamed"


class CudaNamespace(TorchNameChains, NpuCodemod):
    """The torch.cuda namespace, through the file's imports:
    - imports of torch.cuda and its members are retargeted to torch_npu.npu in place
      (`import torch.cuda as tc` -> `import torch_npu.npu as tc`, `from torch.cuda import Stream` ->
      `from torch_npu.npu import Stream`); a from-import that would need two modules is split, or
      reported where comments make that unsafe (`import-split`); one of a name with no NPU
      counterpart is reported;
    - `torch.cuda.X` becomes `torch.npu.X` for the names torch_npu has (its submodules' members too);
      renamed names get their NPU name (`CUDAGraph` -> `NPUGraph`, nvtx -> mstx, allow_tf32 ->
      allow_hf32 with a precision note, `Backend.NCCL` -> `Backend.HCCL` ...);
    - CUDA names with no NPU answer are reported (`rules.CUDA_FLAGGED`, or `unknown-cuda-api`).
    (torch.cuda.amp calls are AmpUpgrade's; APIs on the unsupported list are UnsupportedApis'.)"""

    DESCRIPTION = "torch.cuda.* -> torch.npu.*, imports of torch.cuda -> torch_npu.npu, CUDA-only names reported"
    CONTEXT = "statement"  # decided from the statement holding the candidate and the imports
    RULES = ("cuda-namespace", "cuda-import", "cuda-renamed", "cuda-graph", "nvtx-to-mstx", "tf32-to-hf32",
             "nccl-to-hccl", "profiler-activity", "amp-upgrade")
    # a chain or an import names its table entry's last part
    FILES_CONTAINING = tuple(sorted({"cuda"} | {name.rsplit(".", 1)[-1] for name in (*rules.CUDA_RENAMED,
                                                                                      *rules.CUDA_FLAGGED)}))

    @classmethod
    def candidates(cls, model) -> list:
        found = []
        for node in model.imports:
            if isinstance(node, ast.ImportFrom):
                if node.level == 0 and node.module and (node.module.startswith("torch.cuda") or node.module == "torch"
                                                        and any(alias.name == "cuda" for alias in node.names)):
                    return [model.tree]  # the names it binds are retargeted wherever they are used
                continue
            names = [alias.name for alias in node.names if alias.asname and alias.name.startswith("torch.cuda")]
            if any(import_target(name, lambda: True) is not None for name in names):
                return [model.tree]
            if names:
                found.append(node)  # reported
        found += [node for node in ast_chain_candidates(model) if _ast_entry(model, node)[2] != "unsupported"]
        if any(isinstance(node, ast.Attribute) and node.attr in ATTRIBUTES and model.module_attribute_by_binding(node)
               for node in found):
            return [model.tree]  # `version.cuda`: a module's attribute by the bindings that reach it
        return found

    def visit_Module(self, node: cst.Module) -> None:
        super().visit_Module(node)
        self.retargets = self.facts.retargets
        self.context.scratch[RETARGETED_KEY] = dict(self.retargets.rebound)

    def visit_Import(self, node: cst.Import) -> None:
        super().visit_Import(node)
        for name in self.retargets.flags.get(id(node), ()):
            self._flag_cuda_name(node, name)
        for alias, _, text, _, rule in self.retargets.plans.get(id(node), ()):
            self._record_unless_same(*self.facts.span(alias), text, rule)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        super().visit_ImportFrom(node)
        for name in self.retargets.flags.get(id(node), ()):
            self._flag_cuda_name(node, name)
        if id(node) not in self.retargets.plans:
            return
        plan = self.retargets.plans[id(node)]
        rule = plan[0][4]
        modules = list(dict.fromkeys(target for _, target, _, _, _ in plan))
        start, end = self.facts.span(node)
        text = self.facts.positions.text
        if len(modules) == 1:
            match = _FROM_IMPORT.match(text, start, end)
            if match is None or match.group(1) != dotted_name(node.module):
                return
            if modules[0] != match.group(1):
                self._record_unless_same(match.start(1), match.end(1), modules[0], rule)
            for alias, _, new, changed, _ in plan:
                if changed and alias is not None:
                    alias_start, alias_end = self.facts.span(alias)
                    self._record_unless_same(alias_start, alias_end, new, rule)
            return
        # names now come from different modules: split the statement (only safe without comments in it)
        if "#" in text[start:end]:
            self.flag(node, Flag("import-split", "warning",
                                 "this import mixes torch.cuda names with others and contains comments",
                                 "split it by hand: " + "; ".join(
                                     f"from {m} import {', '.join(t for _, mm, t, _, _ in plan if mm == m)}"
                                     for m in modules)))
            return
        statements = [f"from {m} import {', '.join(new for _, target, new, _, _ in plan if target == m)}"
                      for m in modules]
        prefix = text[self.facts.positions.line_starts[self.facts.line_col(start)[0] - 1]:start]
        joiner = ("\n" + prefix) if prefix.strip() == "" else "; "
        self._record_unless_same(start, end, joiner.join(statements), rule)

    def _record_unless_same(self, start: int, end: int, text: str, rule: str) -> None:
        if self.facts.positions.text[start:end] != text:
            self._record(start, end, text, rule, True)

    def _flag_cuda_name(self, node: cst.CSTNode, qualified: str) -> None:
        for key in rules.dotted_prefixes(qualified):
            if key in rules.CUDA_FLAGGED:
                self.flag(node, rules.CUDA_FLAGGED[key])
                return
        self.flag(node, unknown_cuda_flag(qualified))

    # ------------------------------------------------------------------ name chains
    def chain(self, node: cst.BaseExpression, qualified: str, kind: str) -> None:
        if kind == "renamed":
            if self.rewrite_name(node, rules.CUDA_RENAMED[qualified],
                                  rules.CUDA_RENAMED_RULE.get(qualified, _rename_rule(qualified))) and \
                    qualified in rules.RENAME_NOTES:
                self.flag(node, rules.RENAME_NOTES[qualified])
        elif kind == "flagged":
            self.flag(node, rules.CUDA_FLAGGED[qualified])
        elif kind == "namespace":
            self._cuda_namespace(node, qualified)

    def _cuda_namespace(self, node: cst.BaseExpression, qualified: str) -> None:
        parts = qualified.split(".")
        root = _root(node)
        if isinstance(root, cst.Name) and root.value in self.retargets.rebound and \
                self.facts.bindings.get(root.value, "").startswith("torch.cuda"):
            # the alias import is rewritten; members keep their name unless renamed/flagged
            if len(parts) >= 3 and parts[2] not in rules.NPU_SAME_NAME and parts[2] not in ("amp", "nvtx"):
                self.flag(node, unknown_cuda_flag(qualified))
            return
        if len(parts) == 2:
            self.rewrite_name(node, "torch.npu", "cuda-namespace")
            return
        member = parts[2]
        if member in rules.NPU_SAME_NAME and (len(parts) == 3 or member not in rules.NPU_SUBMODULE_MEMBERS):
            self.rewrite_name(node, "torch.npu." + ".".join(parts[2:]), "cuda-namespace")
            if qualified in rules.RENAME_NOTES:
                self.flag(node, rules.RENAME_NOTES[qualified])
            return
        if member in rules.NPU_SUBMODULE_MEMBERS and len(parts) >= 4:
            if parts[3] in rules.NPU_SUBMODULE_MEMBERS[member]:
                self.rewrite_name(node, "torch.npu." + ".".join(parts[2:]), "cuda-namespace")
            else:
                self.flag(node, unknown_cuda_flag(qualified))
            return
        if member == "amp" and len(parts) >= 4:  # a non-call use (isinstance, a reference): torch_npu.npu.amp has it
            self.rewrite_name(node, "torch.npu." + ".".join(parts[2:]), "cuda-namespace")
            return
        self.flag(node, unknown_cuda_flag(qualified))


def _root(node: cst.BaseExpression) -> cst.BaseExpression:
    while isinstance(node, cst.Attribute):
        node = node.value
    return node


RETARGETED_KEY = "npukit.retargeted_imports"  # local name -> its meaning after the imports' rewrite
