"""`.cuda()` and `.is_cuda` on tensors and modules."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate.codemods.base import NpuCodemod, called_name, split_arguments
from npukit.migrate.codemods.scopes import BindingTargets, assigned_targets, dotted_name
from npukit.migrate.rules import Flag

ATTRIBUTES = ("cuda", "is_cuda")
# `args.cuda`, `cfg.cuda` ...: a flag of the user's configuration, when not called
CONFIG_RECEIVERS = frozenset(
    {"args", "opt", "opts", "cfg", "config", "conf", "flags", "FLAGS", "hparams", "hp", "options", "params", "settings"}
)
# torch classes whose `cuda` / `is_cuda` is the method itself (`torch.Tensor.cuda`), not a module attribute
TORCH_CLASSES_WITH_CUDA = frozenset({"torch.Tensor", "torch.nn.Module", "torch.UntypedStorage", "torch.TypedStorage"})
_METHOD_KEYWORDS = frozenset({"device", "non_blocking", "memory_format"})  # Tensor.cuda / Module.cuda's

USER_CUDA_METHOD = Flag("user-cuda-method", "info", "`.cuda()` here is a method of your own class; it was kept",
                        "rename it if it moves data to the device")
USER_CUDA_ATTRIBUTE = Flag("user-cuda-attribute", "info",
                           "`.is_cuda` here is an attribute of your own class; it was kept",
                           "rename it if it means the tensor property")


class _WrittenTargets(BindingTargets):
    """Notes the names and attributes that statements write (ast's Store and Del contexts): in
    `written`, the deleted ones also in `deleted`."""

    def _bind(self, target: cst.CSTNode, deleted: bool) -> None:
        for node in assigned_targets(target):
            self.written[id(node)] = node
            if deleted:
                self.deleted.add(id(node))


class _WrittenIn(_WrittenTargets, cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.written: dict[int, cst.CSTNode] = {}
        self.deleted: set[int] = set()


def defines_is_cuda(node: cst.ClassDef) -> bool:
    """A class with its own `is_cuda`: a method or property of that name, a class attribute, or
    `self.is_cuda = ...` in one of its methods (Tensor.is_cuda is read-only, so it is the class's)."""
    for item in _class_items(node):
        if isinstance(item, cst.FunctionDef):
            if item.name.value == "is_cuda":
                return True
            written = _WrittenIn()
            item.visit(written)
            if any(isinstance(target, cst.Attribute) and target.attr.value == "is_cuda"
                   and isinstance(target.value, cst.Name) and target.value.value == "self" and key not in written.deleted
                   for key, target in written.written.items()):
                return True
        elif isinstance(item, cst.Assign) and any(isinstance(t.target, cst.Name) and t.target.value == "is_cuda"
                                                  for t in item.targets):
            return True
        elif isinstance(item, cst.AnnAssign) and isinstance(item.target, cst.Name) and item.target.value == "is_cuda":
            return True
    return False


def _class_items(node: cst.ClassDef):
    """The statements of a class body as ast lists them (`a = 1; b = 2` is two)."""
    body = node.body.body
    for statement in body:
        if isinstance(statement, cst.SimpleStatementLine):
            yield from statement.body
        else:
            yield statement


def _tensor_method_shaped(call: cst.Call) -> bool:
    """A call shaped like Tensor.cuda / Module.cuda: no argument, a device, non_blocking=, memory_format=."""
    positional, keywords = split_arguments(call)
    if len(positional) > 2 or any(arg.star for arg in positional):
        return False
    return all(arg.keyword is not None and arg.keyword.value in _METHOD_KEYWORDS for arg in keywords)


class CudaMethods(_WrittenTargets, NpuCodemod):
    """`x.cuda()` becomes `x.npu()` and `x.is_cuda` becomes `x.is_npu`, on whatever is not a module
    the imports name (`torch.cuda`, `numba.cuda` are the namespace rules' business), as a call or
    as a reference (`f = x.cuda`). Kept as they are:
    - a `cuda` / `is_cuda` of the user's own classes (a class anywhere in the tree, npu-migrate's
      tree facts, or in this file, that defines it), on `self`, `super()`, `C(...)` or a name
      assigned `C(...)`: reported (info);
    - an uncalled `x.cuda` in a condition, on a configuration object (`args.cuda`), or in a file
      where `cuda` is data (`--cuda` flags, `self.cuda = ...`);
    - an assignment `x.is_cuda = ...` (Tensor.is_cuda cannot be set, so it is the user's).
    A name that is both an imported module and a variable (`import model` ... `model = model.Net()`)
    is decided by the binding that reaches the use; where that cannot be decided, a call shaped like
    the tensor method is rewritten and anything else is reported (`ambiguous-cuda`)."""

    DESCRIPTION = ".cuda() -> .npu() and .is_cuda -> .is_npu on tensors and modules"
    RULES = ("cuda-method", "is-cuda")
    FILES_CONTAINING = ("cuda",)

    CONTEXT = "statement"  # decided from its statement and the imports, or (context) its class

    @classmethod
    def candidates(cls, model) -> list:
        found = [node for node in model.attributes if model.cuda_method_use(node)]
        if found and (cls._file_classes_decide(model, found) or any(
                node.attr in ATTRIBUTES and (not isinstance(node.ctx, ast.Load) or model.module_attribute_by_binding(node))
                for node in model.attributes)):
            return [model.tree]  # decided by the file's classes, `cuda` data or the bindings of its imports
        return found

    @classmethod
    def context(cls, model, node) -> str:
        """`self.cuda()`, `super().cuda()`: whose they are is decided by the class around them."""
        return "class" if _self_or_super(node.value) else cls.CONTEXT

    @staticmethod
    def _file_classes_decide(model, found: list) -> bool:
        """The user's classes with their own cuda / is_cuda (the tree's and the file's) decide a use
        beyond its statement and class: a class of this file (not of the rest of the tree) does, and
        so does `x = C(...)` anywhere in the file for a use on `x`."""
        classes = model.cuda_method_classes | model.is_cuda_classes
        if not classes:
            return False
        tree = model.facts
        if model.cuda_method_classes - tree.cuda_method_classes or model.is_cuda_classes - tree.is_cuda_classes:
            return True
        receivers = {node.value.id for node in found if isinstance(node.value, ast.Name)}
        return any(isinstance(assign, ast.Assign) and isinstance(assign.value, ast.Call) and
                   _ast_called_name(assign.value.func) in classes and
                   any(isinstance(target, ast.Name) and target.id in receivers for target in assign.targets)
                   for assign in model.assigns)

    def visit_Module(self, node: cst.Module) -> None:
        self.written: dict[int, cst.CSTNode] = {}
        self.deleted: set[int] = set()
        self.calls: dict[int, cst.Call] = {}  # id of a called expression -> the call
        self.tested: set[int] = set()  # ids of a condition's operands (if/while/assert tests, and/or/not ...)
        self.classes: list[cst.ClassDef] = []  # the classes around the node visited
        self.uses: list[tuple[cst.Attribute, cst.ClassDef | None]] = []  # each .cuda / .is_cuda, its class
        self.own_cuda: set[str] = set()  # this file's classes with their own cuda / is_cuda
        self.own_is_cuda: set[str] = set()
        self.made_by: list[tuple[str, str]] = []  # (variable, the callable of `variable = C(...)`)
        self.module_names: set[str] = set()  # the names `import x` statements bind, in any scope (modules)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node)
        if any(isinstance(item, cst.FunctionDef) and item.name.value == "cuda" for item in _class_items(node)):
            self.own_cuda.add(node.name.value)
        if "is_cuda" in self.facts.positions.text and defines_is_cuda(node):
            self.own_is_cuda.add(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self.classes.pop()
        return updated_node

    def visit_Call(self, node: cst.Call) -> None:
        self.calls[id(node.func)] = node

    def visit_Assign(self, node: cst.Assign) -> None:
        if isinstance(node.value, cst.Call):
            made = called_name(node.value.func)
            self.made_by += [(t.target.value, made) for t in node.targets if isinstance(t.target, cst.Name)]

    def _test(self, *operands: cst.CSTNode | None) -> None:
        self.tested.update(id(operand) for operand in operands if operand is not None)

    def visit_If(self, node: cst.If) -> None:
        self._test(node.test)

    def visit_While(self, node: cst.While) -> None:
        self._test(node.test)

    def visit_Assert(self, node: cst.Assert) -> None:
        self._test(node.test, node.msg)

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self._test(node.test, node.body, node.orelse)

    def visit_BooleanOperation(self, node: cst.BooleanOperation) -> None:
        self._test(node.left, node.right)

    def visit_UnaryOperation(self, node: cst.UnaryOperation) -> None:
        self._test(node.expression)

    def visit_Comparison(self, node: cst.Comparison) -> None:
        self._test(node.left, *(target.comparator for target in node.comparisons))

    def visit_Import(self, node: cst.Import) -> None:
        self.module_names.update(alias.asname.name.value if alias.asname else dotted_name(alias.name).split(".")[0]
                                 for alias in node.names)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value in ATTRIBUTES:
            self.uses.append((node, self.classes[-1] if self.classes else None))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        """Decided once the whole file is seen: its imports, classes, assignments and `cuda` data count."""
        text = self.facts.positions.text
        cuda_is_data = "--cuda" in text or "--use_cuda" in text or "--use-cuda" in text or any(
            isinstance(node, cst.Attribute) and node.attr.value == "cuda" for node in self.written.values())
        for node, enclosing in self.uses:
            if not self._module_attribute(node):
                self._decide(node, enclosing, cuda_is_data)
        return updated_node

    def _decide(self, node: cst.Attribute, enclosing: cst.ClassDef | None, cuda_is_data: bool) -> None:
        loaded = id(node) not in self.written
        if node.attr.value == "is_cuda":
            if not loaded:
                return
            if self._user_receiver(node, enclosing, self.facts.tree.is_cuda_classes | self.own_is_cuda):
                self.flag(node, USER_CUDA_ATTRIBUTE)
            else:
                self.replace_with_text(node.attr, "is_npu", "is-cuda")
            return
        call = self.calls.get(id(node))
        root = _root_name(node.value)
        receiver = self.facts.qualname(node.value)
        if receiver is not None and not receiver.startswith("torch") and root in self.module_names:
            # `import model; model = model.Net(); model.cuda()`: a module name rebound to a value
            if call is not None and _tensor_method_shaped(call):
                self.replace_with_text(node.attr, "npu", "cuda-method")
            else:
                start, end = self.facts.span(node)
                self.flag(node, Flag(
                    "ambiguous-cuda", "warning",
                    f"`{self.facts.positions.text[start:end]}`: `{root}` is both an imported module and a variable "
                    "in this file, so this may or may not be the tensor/module .cuda() method; it was left unchanged",
                    "change it to .npu() if it moves a tensor or module to the device"))
            return
        if self._user_receiver(node, enclosing, self.facts.tree.cuda_method_classes | self.own_cuda):
            self.flag(node, USER_CUDA_METHOD)
        elif call is not None or (loaded and id(node) not in self.tested and not cuda_is_data and not (
                isinstance(node.value, cst.Name) and node.value.value in CONFIG_RECEIVERS)):
            self.replace_with_text(node.attr, "npu", "cuda-method")

    def _user_receiver(self, node: cst.Attribute, enclosing: cst.ClassDef | None, classes: frozenset[str]) -> bool:
        """The receiver is an instance of one of these (the user's) classes: `self` or `super()` in
        one, `C(...)`, or a name assigned `C(...)` anywhere in this file."""
        if not classes:
            return False
        receiver = node.value
        if isinstance(receiver, cst.Name) and receiver.value == "self" or \
                isinstance(receiver, cst.Call) and called_name(receiver.func) == "super":
            return enclosing is not None and enclosing.name.value in classes
        if isinstance(receiver, cst.Call):
            return called_name(receiver.func) in classes
        if isinstance(receiver, cst.Name):
            return any(variable == receiver.value and made in classes for variable, made in self.made_by)
        return False

    # ------------------------------------------------------------------ module attributes
    def _module_attribute(self, node: cst.Attribute) -> bool:
        """`torch.cuda`, `numba.cuda`, `import model ... model.cuda`: an attribute of a module the
        imports name (the namespace rules' business), not the tensor/module method."""
        receiver = self.facts.qualname(node.value)
        return receiver is not None and receiver not in TORCH_CLASSES_WITH_CUDA and (
            receiver == "torch" or self.facts.module_binding_reaches(node.value, self.module_names))



def _self_or_super(receiver: ast.AST) -> bool:
    return isinstance(receiver, ast.Name) and receiver.id == "self" or isinstance(receiver, ast.Call) and \
        isinstance(receiver.func, ast.Name) and receiver.func.id == "super"


def _ast_called_name(func: ast.AST) -> str | None:
    """called_name for an ast call."""
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def _root_name(node: cst.BaseExpression) -> str | None:
    while isinstance(node, cst.Attribute):
        node = node.value
    return node.value if isinstance(node, cst.Name) else None
