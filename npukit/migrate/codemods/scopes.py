"""Which scope binds a name, and where a name is read: a per-file fact the codemods share.

The model is the `ast` engine's (pysource_model.SourceModel), kept exactly so the ported rules
decide as before: scopes are the module, functions, lambdas and classes (comprehensions belong to
the enclosing scope); a function's decorators, defaults and annotations belong to the enclosing
scope, its body to its own; a class body is not an enclosing scope for the functions in it. A name
is bound in a scope by an assignment, augmented or annotated assignment, `for`, `with ... as`, `:=`,
`del`, an import, a def or class, or a parameter.
"""

from __future__ import annotations

import libcst as cst

_CONSTANT_NAMES = frozenset({"None", "True", "False"})  # names to libcst, constants to Python


class Scopes:
    """The bindings and reads of one module (see the module docstring)."""

    def __init__(self, module: cst.Module) -> None:
        self.module = module
        self.enclosing: dict[cst.CSTNode, cst.CSTNode] = {}  # scope -> the scope its definition is in
        self.assigned: dict[cst.CSTNode, set[str]] = {module: set()}  # scope -> names bound in it
        self.parameters: dict[cst.CSTNode, set[str]] = {}
        self.scope_of: dict[cst.CSTNode, cst.CSTNode] = {}  # Name, Assign, import, def, class -> scope
        self.reads: dict[str, list[cst.Name]] = {}  # name -> the Name nodes that read it
        self.stores: dict[str, list[cst.Name]] = {}
        self.imports: list[tuple[cst.CSTNode, list[str]]] = []  # (import statement, names it binds)
        self.definitions: list[cst.CSTNode] = []  # defs and classes
        module.visit(_ScopeCollector(self))

    def defining_scope(self, name: str, scope: cst.CSTNode) -> cst.CSTNode:
        """The scope whose binding of `name` a read in `scope` sees (the module when none does)."""
        current = scope
        while current is not None:
            if name in self.assigned.get(current, ()):
                return current
            if current is self.module:
                break
            current = self.enclosing.get(current, self.module)
            while isinstance(current, cst.ClassDef):  # class bodies are not enclosing scopes for functions
                current = self.enclosing.get(current, self.module)
        return self.module

    def binding_count(self, name: str, scope: cst.CSTNode) -> int:
        """How many statements (and parameters) bind `name` directly in `scope`."""
        count = int(name in self.parameters.get(scope, ()))
        count += sum(1 for node, names in self.imports if self.scope_of[node] is scope and name in names)
        count += sum(1 for node in self.stores.get(name, ()) if self.scope_of[node] is scope)
        count += sum(1 for node in self.definitions if node.name.value == name and self.scope_of[node] is scope)
        return count


def assigned_targets(target: cst.CSTNode):
    """The names and attributes a binding (or `del`) target writes (`a`, `x.y, (b, *c)`), those ast
    gives a Store or Del context; not subscripts, nor what is read to reach them."""
    if isinstance(target, (cst.Name, cst.Attribute)):
        yield target
    elif isinstance(target, (cst.Tuple, cst.List)):
        for element in target.elements:
            yield from assigned_targets(element.value)
    elif isinstance(target, cst.StarredElement):
        yield from assigned_targets(target.value)


def _target_names(target: cst.CSTNode):
    """The names a binding target binds (`a`, `a, (b, *c)`), not attributes or subscripts."""
    return (node for node in assigned_targets(target) if isinstance(node, cst.Name))


def _parameter_names(params: cst.Parameters) -> set[str]:
    every = [*params.posonly_params, *params.params, *params.kwonly_params]
    every += [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
    return {param.name.value for param in every}


class BindingTargets:
    """visit_ methods handing `_bind(target, deleted)` each target a statement binds or deletes
    (what ast gives a Store or Del context): assignments, for, comprehensions, `with ... as`,
    `:=` and `del`. A visitor mixes it in and says what a binding means to it."""

    def _bind(self, target: cst.CSTNode, deleted: bool) -> None:
        raise NotImplementedError

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._bind(node.target, False)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._bind(node.target, False)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._bind(node.target, False)

    def visit_For(self, node: cst.For) -> None:
        self._bind(node.target, False)

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self._bind(node.target, False)

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._bind(node.asname.name, False)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._bind(node.target, False)

    def visit_Del(self, node: cst.Del) -> None:
        self._bind(node.target, True)


class _ScopeCollector(BindingTargets, cst.CSTVisitor):
    def __init__(self, scopes: Scopes) -> None:
        self.s = scopes
        self.stack: list[cst.CSTNode] = [scopes.module]
        self.not_reads: set[int] = set()  # Name nodes that are not reads (targets, attribute names ...)

    @property
    def scope(self) -> cst.CSTNode:
        return self.stack[-1]

    def _store(self, target: cst.CSTNode | None) -> None:
        if target is None:
            return
        for name in _target_names(target):
            self.not_reads.add(id(name))
            self.s.assigned[self.scope].add(name.value)
            self.s.stores.setdefault(name.value, []).append(name)
            self.s.scope_of[name] = self.scope

    # -------------------------------------------------------------- scopes
    def _define(self, node: cst.CSTNode, name: str, parameters: set[str]) -> None:
        self.s.assigned[self.scope].add(name)
        self.s.scope_of[node] = self.scope
        self.s.enclosing[node] = self.scope
        self.s.assigned[node] = set(parameters)
        self.s.parameters[node] = parameters

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.not_reads.add(id(node.name))
        self._define(node, node.name.value, _parameter_names(node.params))
        self.s.definitions.append(node)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.not_reads.add(id(node.name))
        self._define(node, node.name.value, set())
        self.s.definitions.append(node)

    def visit_Lambda(self, node: cst.Lambda) -> None:
        self._define(node, "", _parameter_names(node.params))

    def visit_FunctionDef_body(self, node: cst.FunctionDef) -> None:
        self.stack.append(node)

    def leave_FunctionDef_body(self, node: cst.FunctionDef) -> None:
        self.stack.pop()

    def visit_ClassDef_body(self, node: cst.ClassDef) -> None:
        self.stack.append(node)

    def leave_ClassDef_body(self, node: cst.ClassDef) -> None:
        self.stack.pop()

    def visit_Lambda_body(self, node: cst.Lambda) -> None:
        self.stack.append(node)

    def leave_Lambda_body(self, node: cst.Lambda) -> None:
        self.stack.pop()

    # -------------------------------------------------------------- bindings
    def _bind(self, target: cst.CSTNode, deleted: bool) -> None:
        self._store(target)

    def visit_Assign(self, node: cst.Assign) -> None:
        self.s.scope_of[node] = self.scope

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self.s.scope_of[node] = self.scope
        super().visit_AnnAssign(node)

    def _import(self, node: cst.CSTNode, names: list[str]) -> None:
        self.s.scope_of[node] = self.scope
        self.s.assigned[self.scope].update(names)
        self.s.imports.append((node, names))

    def visit_Import(self, node: cst.Import) -> None:
        self._import(node, [alias.asname.name.value if alias.asname else dotted_name(alias.name).split(".")[0] for alias in node.names])
        return False  # its names are not reads

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        names = ["*"] if isinstance(node.names, cst.ImportStar) else \
            [alias.asname.name.value if alias.asname else dotted_name(alias.name).split(".")[0] for alias in node.names]
        self._import(node, names)
        return False

    # -------------------------------------------------------------- names that are not reads
    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.not_reads.add(id(node.attr))

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self.not_reads.add(id(node.keyword))

    def visit_Param(self, node: cst.Param) -> None:
        self.not_reads.add(id(node.name))

    def visit_NameItem(self, node: cst.NameItem) -> None:  # global / nonlocal
        self.not_reads.add(id(node.name))

    def visit_ExceptHandler(self, node: cst.ExceptHandler) -> None:
        if node.name is not None:
            self.not_reads.update(id(n) for n in _target_names(node.name.name))

    def visit_MatchAs(self, node: cst.MatchAs) -> None:
        if node.name is not None:
            self.not_reads.add(id(node.name))

    def visit_MatchStar(self, node: cst.MatchStar) -> None:
        if node.name is not None:
            self.not_reads.add(id(node.name))

    def visit_MatchMapping(self, node: cst.MatchMapping) -> None:
        if node.rest is not None:
            self.not_reads.add(id(node.rest))

    def visit_MatchKeywordElement(self, node: cst.MatchKeywordElement) -> None:
        self.not_reads.add(id(node.key))

    def visit_Name(self, node: cst.Name) -> None:
        if id(node) not in self.not_reads and node.value not in _CONSTANT_NAMES:
            self.s.reads.setdefault(node.value, []).append(node)
            self.s.scope_of[node] = self.scope


def dotted_name(node: cst.BaseExpression) -> str:
    """`a.b.c` of an import's Name/Attribute."""
    return node.value if isinstance(node, cst.Name) else f"{dotted_name(node.value)}.{node.attr.value}"
