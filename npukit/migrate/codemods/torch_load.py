"""torch.load without map_location: a CUDA checkpoint does not load on an NPU host."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate import rules
from npukit.migrate.codemods.base import NpuCodemod, keyword_names, split_arguments
from npukit.migrate.rules import Flag

_LOAD_STATE_DICT = frozenset({"load_state_dict", "load_state_dict_from_checkpoint"})
_CONSTANTS = (cst.SimpleString, cst.ConcatenatedString, cst.Integer, cst.Float, cst.Imaginary, cst.Ellipsis)


class TorchLoadMapLocation(NpuCodemod):
    """`torch.load(f)` gets `map_location="cpu"` where its result provably goes only into
    `load_state_dict()` (which copies to the parameters' device): passed straight to it, or assigned
    once to a name whose every read is `m.load_state_dict(name)` / `m.load_state_dict(name["key"])`.
    Anything else loaded whole (a pickled model, `model, opt = torch.load(f)`, a checkpoint dict also
    read for other values) gets `map_location="npu"`: saved from CUDA tensors it would load onto CUDA.
    Each is reported (info) with the reason. A load of what the same code saved (`torch.save(x, f)`
    ... `torch.load(f)`: the same variable, the same literal path, or the same path expression over the
    same variables, `self`'s attributes alike in every method) is a round trip that keeps every
    tensor's device: it is left as it is."""

    DESCRIPTION = "torch.load without map_location gets 'cpu' (only into load_state_dict) or 'npu'"
    RULES = ("torch-load-map-location", "torch-load-weights-only")
    FILES_CONTAINING = ("load",)

    # follows the loaded value to its reads in the scope that binds it: the function around a call in
    # one; the whole file for a call outside functions, or where torch.save may have written the file
    CONTEXT = "function"

    @classmethod
    def candidates(cls, model) -> list:  # torch.load calls without map_location, through the file's imports
        found = [call for call in model.calls if model.qualname(call.func) == rules.TORCH_LOAD and
                 rules.torch_load_lacks_map_location(len(call.args), {keyword.arg for keyword in call.keywords})]
        if found and (not all(_in_function_body(model, call) for call in found) or _saved_keys(model) & {
                _ast_file_key(_ast_argument(call, 0, "f")) for call in found}):
            return [model.tree]
        return found

    def __init__(self, context) -> None:
        super().__init__(context)
        self._state_dict_arguments: set[int] = set()  # ids of nodes passed to load_state_dict
        self._assigned_to: dict[int, cst.Assign] = {}  # id of a call -> `name = call`
        self._loads: list[cst.Call] = []  # torch.load calls without a map_location
        self._saved_to: set[tuple] = set()  # the files torch.save writes (see _file_key)

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Attribute) and node.func.attr.value in _LOAD_STATE_DICT:
            positional, _ = split_arguments(node)
            if positional and not positional[0].star:
                value = positional[0].value
                self._state_dict_arguments.add(id(value))
                if isinstance(value, cst.Subscript) and len(value.slice) == 1 and \
                        isinstance(value.slice[0].comma, cst.MaybeSentinel) and \
                        isinstance(value.slice[0].slice, cst.Index) and _is_constant(value.slice[0].slice.value):
                    self._state_dict_arguments.add(id(value.value))  # m.load_state_dict(ckpt["model"])

    def visit_Assign(self, node: cst.Assign) -> None:
        if len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name) and isinstance(node.value, cst.Call):
            self._assigned_to[id(node.value)] = node

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        qualified = self.facts.qualname(original_node.func)
        if qualified == rules.TORCH_LOAD:
            positional, keywords = split_arguments(original_node)
            if rules.torch_load_lacks_map_location(len(positional), keyword_names(keywords)):
                self._loads.append(original_node)
        elif qualified == "torch.save":
            key = self._file_key(_argument(original_node, 1, "f"))
            if key is not None:
                self._saved_to.add(key)
        return updated_node

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        for call in self._loads:  # now that every load_state_dict() and torch.save() call has been seen
            if self._file_key(_argument(call, 0, "f")) not in self._saved_to:
                self._give_map_location(call)
            elif not self._flows_only_into_load_state_dict(call) and _lacks_weights_only(call):
                # the code's own file, loaded whole: torch >= 2.6 would refuse the objects it pickled
                self.append_keyword(call, "weights_only=False", "torch-load-weights-only", needs_torch_npu=False)
                self.flag(call, Flag("torch-load", "info", _WEIGHTS_ONLY_OWN_FILE, "nothing to do"))
        return updated_node

    def _file_key(self, node: cst.BaseExpression | None) -> tuple | None:
        """What identifies a file in this module: a variable (by the scope that binds it), a literal path,
        or a path expression (`os.path.join(self.root, name)`): its text, and the binding each variable
        in it reads, so `d` local to one function never equals `d` local to another. `self` and `cls`
        stand for the instance whichever method reads them (save in download(), load in __getitem__)."""
        if isinstance(node, cst.Name):
            scopes = self.facts.scopes
            return "name", node.value, scopes.defining_scope(node.value, scopes.scope_of.get(node, scopes.module))
        if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)) and isinstance(node.evaluated_value, str):
            return "path", node.evaluated_value
        if node is None or isinstance(node, cst.Lambda):
            return None
        scopes = self.facts.scopes
        bindings = set()
        for name in _names_read(node):
            scope = scopes.defining_scope(name.value, scopes.scope_of.get(name, scopes.module))
            bindings.add((name.value, "instance" if name.value in ("self", "cls") and scope is not scopes.module
                          else id(scope)))
        return "expression", _expression_text(self.facts.module.code_for_node(node)), frozenset(bindings)

    def _give_map_location(self, call: cst.Call) -> None:
        if self._flows_only_into_load_state_dict(call):
            location = "cpu"
            why = "its result only goes into load_state_dict(), which copies to the parameters' device"
            suggestion = "nothing to do unless the checkpoint is also used elsewhere"
        else:
            location = "npu"
            why = ("the loaded object is used as it is (not only through load_state_dict()): tensors saved from "
                   "CUDA would load onto CUDA, so they go to the NPU")
            suggestion = ("if the file was saved from CPU tensors (data, not a CUDA checkpoint) and must stay on the "
                          "CPU, use map_location=\"cpu\"")
        self.append_keyword(call, f'map_location="{location}"', "torch-load-map-location",
                            needs_torch_npu=location == "npu")
        self.flag(call, Flag("torch-load", "info",
                             f'added map_location="{location}": a checkpoint saved on CUDA does not load on an '
                             f"NPU host without it ({why})", suggestion))
        if location == "npu" and _lacks_weights_only(call):
            self.flag(call, Flag("torch-load-weights-only", "warning", _WEIGHTS_ONLY_FOREIGN_FILE,
                                 "if the file is yours or trusted and holds objects, pass weights_only=False; "
                                 "if it holds only tensors and containers, nothing to do"))

    def _flows_only_into_load_state_dict(self, call: cst.Call) -> bool:
        if id(call) in self._state_dict_arguments:
            return True
        assign = self._assigned_to.get(id(call))
        if assign is None:
            return False
        name = assign.targets[0].target.value
        scopes = self.facts.scopes
        scope = scopes.scope_of[assign]
        if scopes.binding_count(name, scope) != 1:
            return False  # rebound somewhere: the value's other uses are not followed
        uses = [use for use in scopes.reads.get(name, ()) if scopes.defining_scope(name, scopes.scope_of[use]) is scope]
        return bool(uses) and all(id(use) in self._state_dict_arguments for use in uses)


# torch_npu releases pair with recent torch, whose torch.load defaults to weights_only=True (2.6+)
_WEIGHTS_ONLY_OWN_FILE = (
    "added weights_only=False: this code saved the file itself (torch.save of the same path) and loads it "
    "whole; torch >= 2.6 (what torch_npu's current releases pair with) loads with weights_only=True by default and "
    "refuses pickled objects (a whole model, an optimizer, your own classes)")
_WEIGHTS_ONLY_FOREIGN_FILE = (
    "this load takes the file whole and torch >= 2.6 (what torch_npu's current releases pair with) loads with "
    "weights_only=True by default: a file holding pickled objects (a whole model, an optimizer, your own "
    "classes) no longer loads; weights_only=False was not added because nothing here shows the file is "
    "this project's own (unpickling runs code from the file)")


def _lacks_weights_only(call: cst.Call) -> bool:
    _, keywords = split_arguments(call)  # weights_only is keyword-only
    return not keyword_names(keywords) & {"weights_only", None}


def _saved_keys(model) -> set:
    """What the file's torch.save calls write to as _ast_file_key sees it (a name, whatever its scope)."""
    keys = {_ast_file_key(_ast_argument(call, 1, "f")) for call in model.calls if model.qualname(call.func) == "torch.save"}
    return keys - {None}


def _ast_file_key(node) -> tuple | None:
    """Coarser than the codemod's _file_key (no scopes): it only decides how much of the file the
    codemod reads, so equal keys from different scopes cost context, never a wrong rewrite."""
    if isinstance(node, ast.Name):
        return "name", node.id
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return "path", node.value
    if node is None or isinstance(node, ast.Lambda):
        return None
    return "expression", ast.unparse(node)


def _expression_text(code: str) -> str:
    """One spelling for an expression however it is spaced, quoted or wrapped across lines."""
    try:
        return ast.unparse(ast.parse(code.strip(), mode="eval"))
    except SyntaxError:  # a fragment ast cannot take alone: compare it as written
        return code


class _NameReads(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: list[cst.Name] = []

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)  # `a.b`: only `a` is read; `b` is an attribute name
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)  # `f(key=v)`: `key` is not read
        return False

    def visit_Name(self, node: cst.Name) -> None:
        self.names.append(node)


def _names_read(node: cst.CSTNode) -> list[cst.Name]:
    reads = _NameReads()
    node.visit(reads)
    return reads.names


def _ast_argument(call, index: int, keyword: str):
    """_argument in the `ast` model."""
    for arg in call.keywords:
        if arg.arg == keyword:
            return arg.value
    positional = call.args
    if any(isinstance(arg, ast.Starred) for arg in positional[:index + 1]):
        return None
    return positional[index] if index < len(positional) else None


def _in_function_body(model, node) -> bool:
    """The node is in the body of a def (its scope is a function's), not only in lambdas or headers."""
    child, current = node, model.parent.get(id(node))
    while current is not None and current is not model.tree:
        if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(child is inner for inner in current.body):
            return True
        child, current = current, model.parent.get(id(current))
    return False


def _argument(call: cst.Call, index: int, keyword: str) -> cst.BaseExpression | None:
    """The call's argument at this position or under this keyword (None when `*args` may hold it)."""
    positional, keywords = split_arguments(call)
    for arg in keywords:
        if arg.keyword is not None and arg.keyword.value == keyword:
            return arg.value
    if any(arg.star for arg in positional[:index + 1]):
        return None
    return positional[index].value if index < len(positional) else None


def _is_constant(node: cst.BaseExpression) -> bool:
    """What ast calls a Constant: a literal, None, True, False, `...`."""
    if isinstance(node, cst.Name):
        return node.value in ("None", "True", "False")
    return isinstance(node, _CONSTANTS)
