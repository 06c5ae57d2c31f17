"""What the `--fused` codemods share: a call of a CUDA kernel library planned as its torch_npu / torch
equivalent (or kept, with the reason), the call's arguments bound to the library's parameters, and
the library's imports removed once every use of what they bind was rewritten.

Each concern (FlashAttentionToNpu, FlashRotaryToNpu, XformersAttentionToNpu, ApexNormsToTorch,
ApexAdamToTorch, ApexSgdToTorch, ApexMultiTensorToTorch, FlashNormFunctionsToNpu, FlashLayersToTorch)
says which calls are its own and plans each one (`plan`); a plan is a pure function of the call and the
file's import table (ApexMultiTensorToTorch also reads the function around the call, whether it reads
the overflow buffer; FlashLayersToTorch the whole file, whether it uses a class other than by calling
it), so ThirdPartyCuda asks the same plans to tell, without `--fused`, which calls `--fused` would take,
and with it, why a kept call was kept. FusedImports then removes the imports no use is left of.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as matchers

from npukit.migrate import rules
from npukit.migrate.codemods.base import EDITS_KEY, FROZEN_KEY, FileFacts, NpuCodemod, split_arguments
from npukit.migrate.codemods.scopes import dotted_name
from npukit.migrate.pysource_model import apply_edits

_CUDA_WORD = re.compile(r"cuda", re.IGNORECASE)
FUSED_REMOVED_KEY = "npukit.fused_removed"  # (ids of the names the --fused rewrites removed, their libraries)
MAX_LINE = 100  # a rewrite longer than this is wrapped inside its parentheses


@dataclass(frozen=True)
class FusedPlan:
    """text: the call's replacement, or None when the call is kept; about: what it becomes (for the
    report's hint) or why it is kept; dropped: the parts of the call besides its name whose text the
    replacement does not keep (an xformers mask object), so the names they use are gone with it;
    edits: other nodes the rewrite replaces (node, its new text; a statement line and "": the line
    removed), such as the assignment of the mask object a variable held (its dropped parts in dropped)."""

    text: str | None
    about: str
    dropped: tuple[cst.CSTNode, ...] = ()
    edits: tuple[tuple[cst.CSTNode, str], ...] = ()


def kept(reason: str) -> FusedPlan:
    return FusedPlan(None, reason)


def fused_hint(call: cst.Call, facts: FileFacts) -> str | None:
    """What `--fused` does with a call of a CUDA kernel library: the rewrite it makes, or why it
    keeps the call; None for a call no `--fused` concern knows."""
    from npukit.migrate.codemods import FUSED_CODEMODS

    for codemod in (codemod for codemod in FUSED_CODEMODS if issubclass(codemod, FusedCodemod)):
        plan = codemod.plan(call, facts)
        if plan is not None:
            return f"{rules.FUSED_WOULD_REWRITE} to {plan.about}" if plan.text is not None else \
                f"`npu-migrate --fused` keeps it: {plan.about}"
    return None


class Unmappable(Exception):
    """A call `--fused` leaves as it is; the message says why."""


NOT_LITERAL = object()


def literal(node: cst.BaseExpression | None, facts: FileFacts):
    """The Python value of a literal argument (`0.0`, `(-1, -1)`, `None`, `True`), else NOT_LITERAL."""
    if node is None:
        return NOT_LITERAL
    try:
        return ast.literal_eval(source(node, facts))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return NOT_LITERAL


def source(node: cst.CSTNode, facts: FileFacts) -> str:
    """The node's text in the file, with its own parentheses (outside its syntactic extent) and with
    the other codemods' edits inside it (FileFacts.fused_inner_edits, set while a rewrite is made: a
    `torch.cuda.*` in an argument is migrated in the copy the rewrite makes of it)."""
    text = facts.module.code_for_node(node)
    edits = getattr(facts, "fused_inner_edits", ())
    start, end = facts.span(node) if edits else (0, 0)
    inner = [edit for edit in edits if start <= edit.start and edit.end <= end]
    if not inner:
        return text
    core = facts.positions.text[start:end]
    edited = apply_edits(core, [dataclasses.replace(edit, start=edit.start - start, end=edit.end - start)
                                for edit in inner])
    return text.replace(core, edited, 1)


def is_pure(node: cst.BaseExpression) -> bool:
    """An expression the rewrite may evaluate more than once: a name, an attribute or subscript of
    one (indexed by literals or names), a literal. A call or an operation is not: it may cost or
    change something each time."""
    if isinstance(node, (cst.Name, cst.Integer, cst.Float, cst.SimpleString)):
        return True
    if isinstance(node, cst.Attribute):
        return is_pure(node.value)
    if isinstance(node, cst.UnaryOperation):
        return isinstance(node.expression, (cst.Integer, cst.Float))
    if isinstance(node, cst.Subscript):
        return is_pure(node.value) and all(
            isinstance(element.slice, cst.Index) and is_pure(element.slice.value) for element in node.slice)
    return False


def atomic(node: cst.BaseExpression, facts: FileFacts) -> str:
    """The node's text, parenthesized unless it is a primary (a name, attribute, subscript, call,
    literal or already parenthesized) that an operator or `.attr` after it cannot split."""
    text = source(node, facts)
    primary = (cst.Name, cst.Attribute, cst.Subscript, cst.Call, cst.Integer, cst.Float, cst.SimpleString)
    return text if isinstance(node, primary) or node.lpar else f"({text})"


def bind_arguments(call: cst.Call, parameters: tuple[str, ...], function: str,
                   required: tuple[str, ...]) -> dict[str, cst.BaseExpression]:
    """The call's arguments by the library function's parameter names; Unmappable for `*args`,
    `**kwargs`, a keyword the function does not have, too many positional arguments or a required one
    missing."""
    positional, keywords = split_arguments(call)
    bound: dict[str, cst.BaseExpression] = {}
    for index, arg in enumerate(positional):
        if arg.star:
            raise Unmappable(f"{function}'s arguments are unpacked from a sequence (`*...`): which value goes "
                             "to which parameter cannot be seen")
        if index >= len(parameters):
            raise Unmappable(f"{function} is given {len(positional)} positional arguments, more than the "
                             f"{len(parameters)} parameters npu-migrate knows it has")
        bound[parameters[index]] = arg.value
    for arg in keywords:
        if arg.keyword is None:
            raise Unmappable(f"{function}'s keyword arguments are unpacked (`**kwargs`): their names cannot be seen")
        name = arg.keyword.value
        if name not in parameters:
            raise Unmappable(f"{function} is given `{name}=`, a parameter npu-migrate does not know it to have")
        bound[name] = arg.value
    missing = [name for name in required if name not in bound]
    if missing:
        raise Unmappable(f"{function} is not given {', '.join(missing)}")
    return bound


def require_values(bound: dict[str, cst.BaseExpression], only: dict[str, tuple[tuple, str]], facts: FileFacts) -> None:
    """Unmappable (with the option's reason) when an option of `only` (name -> (the literal values the
    rewrite can do without, why another is kept)) is given another value."""
    for option, (allowed, reason) in only.items():
        if option in bound and literal(bound[option], facts) not in allowed:
            raise Unmappable(reason)


def spell(qualified: str, node: cst.CSTNode, facts: FileFacts) -> str | None:
    """Source text naming `qualified` (a torch or torch_npu name) where `node` is: through torch's
    alias, else through the longest import of the file that leads there (`import torch.nn as nn`:
    `nn.RMSNorm`); torch_npu names through its alias if the file imports it under one. None when the
    file names neither."""
    top, _, rest = qualified.partition(".")
    if top == "torch" and facts.names_torch(node):
        return f"{facts.torch_alias}.{rest}" if rest else facts.torch_alias
    best = None
    for local, bound in facts.bindings.items():
        if bound == "torch" and local == "torch" and top == "torch":
            continue  # the implicit `torch` of the import table: names_torch said no
        if qualified == bound or qualified.startswith(bound + "."):
            if best is None or len(bound) > len(best[1]):
                best = (local, bound)
    if best is not None:
        return best[0] + qualified[len(best[1]):]
    return qualified if top == "torch_npu" else None


def call_text(function: str, arguments: list[str], node: cst.CSTNode, facts: FileFacts, suffix: str = "") -> str:
    """`function(arg, ...)suffix` on one line, or, past MAX_LINE characters or where the original call
    spanned several lines, its arguments filled into lines indented one level below the call's line."""
    one_line = f"{function}({', '.join(arguments)}){suffix}"
    start, end = facts.span(node)
    line, column = facts.line_col(start)
    line_text = facts.positions.line_text(line)
    multi_line = "\n" in facts.positions.text[start:end]
    if column - 1 + len(one_line) <= MAX_LINE and not multi_line:
        return one_line
    newline = facts.module.default_newline
    indent = line_text[:len(line_text) - len(line_text.lstrip(" \t"))] + facts.module.default_indent
    lines, current = [], ""
    for index, argument in enumerate(arguments):
        piece = argument + ("," if index < len(arguments) - 1 else "")
        if current and len(indent) + len(current) + 1 + len(piece) > MAX_LINE:
            lines.append(current)
            current = piece
        else:
            current = f"{current} {piece}" if current else piece
    lines.append(current)
    return f"{function}({newline}" + newline.join(indent + text for text in lines) + f"){suffix}"


def statement_lines(body):
    """(statement line, the block's statements) of every simple statement line of a block, nested
    blocks included."""
    for statement in body:
        if isinstance(statement, cst.SimpleStatementLine):
            yield statement, body
        elif isinstance(statement, cst.BaseCompoundStatement):
            for part in _blocks(statement):
                if isinstance(part, cst.IndentedBlock):
                    yield from statement_lines(part.body)


def _blocks(statement: cst.BaseCompoundStatement):
    """The blocks of a compound statement: its body, its handlers' and cases', else, elif, finally."""
    yield statement.body
    for handler in (*getattr(statement, "handlers", ()), *getattr(statement, "cases", ())):
        yield handler.body
    for name in ("orelse", "finalbody"):
        clause = getattr(statement, name, None)
        if isinstance(clause, cst.If):  # elif
            yield from _blocks(clause)
        elif clause is not None:
            yield clause.body


class ImportRemoval(NpuCodemod):
    """Removes the imports of CUDA kernel libraries no use is left of (rule fused-import)."""

    def remove_imports(self, module: cst.Module, gone: set[int], libraries: set[str]) -> None:
        """Drop the import of each name of `libraries` every read of which the replacements removed
        (`gone`: the ids of those Name nodes), rule fused-import."""
        facts = self.facts
        reads = facts.scopes.reads
        removable = {local for local, qualified in facts.bindings.items()
                     if qualified.split(".")[0] in libraries and reads.get(local)
                     and all(id(name) in gone for name in reads[local])}
        if not removable:
            return
        for line, block in statement_lines(module.body):
            for statement in line.body:
                if isinstance(statement, (cst.Import, cst.ImportFrom)) and not isinstance(statement.names, cst.ImportStar):
                    self._remove_names(statement, line, block, removable, libraries)

    def _remove_names(self, statement: cst.Import | cst.ImportFrom, line: cst.SimpleStatementLine, block,
                      removable: set[str], libraries: set[str]) -> None:
        if isinstance(statement, cst.ImportFrom) and (statement.relative or statement.module is None or
                                                       dotted_name(statement.module).split(".")[0] not in libraries):
            return
        kept_aliases = [alias for alias in statement.names if self._bound_name(alias, statement, libraries) not in removable]
        if len(kept_aliases) == len(statement.names):
            return
        if kept_aliases:
            kept_aliases[-1] = kept_aliases[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            self.replace(statement, statement.with_changes(names=kept_aliases), "fused-import", needs_torch_npu=False)
            return
        self.claim(statement)
        if len(line.body) > 1 or len(block) == 1:
            # shares its line, or is its block's only statement (`try:` around the import): a `pass` keeps it valid
            self.replace_with_text(statement, "pass", "fused-import", needs_torch_npu=False)
            return
        self.remove_line(line, "fused-import", False)

    def remove_line(self, line: cst.SimpleStatementLine, rule: str, needs_torch_npu: bool) -> None:
        """The statement line removed, its indentation and line break with it."""
        start, end = self.facts.span(line)
        text = self.facts.positions.text
        while start > 0 and text[start - 1] in " \t":
            start -= 1
        if end < len(text) and text[end - 1] not in "\r\n":
            end = text.find("\n", end) + 1 or len(text)
        self._record(start, end, "", rule, needs_torch_npu)

    @staticmethod
    def _bound_name(alias: cst.ImportAlias, statement: cst.Import | cst.ImportFrom, libraries: set[str]) -> str | None:
        """The name an import alias binds (`import a.b`: a); None for another library's module."""
        if alias.asname is not None:
            return alias.asname.name.value if isinstance(alias.asname.name, cst.Name) else None
        name = dotted_name(alias.name)
        if isinstance(statement, cst.Import):
            return name.split(".")[0] if name.split(".")[0] in libraries else None
        return name


class FusedCodemod(ImportRemoval):
    """Base of the `--fused` concerns: each call `plan` takes is replaced (rule RULE); what is kept stays
    for ThirdPartyCuda to report with the plan's reason. The names the replacements remove are left in
    the codemod context for FusedImports, which removes the imports no use is left of (several concerns
    may share one import statement); run alone under libcst's tool, a concern removes its own."""

    LIBRARY = ""  # the top-level module of the CUDA library (flash_attn, apex)
    ALSO_REMOVES: tuple[str, ...] = ()  # other top-level modules whose imports the rewrites may leave unused (amp_C)
    RULE = ""
    NEEDS_TORCH_NPU = True  # the rewrites call torch_npu
    WHOLE_FILE = True
    TARGETS: dict[str, str] = {}  # qualified name of a call it takes -> the function's short name
    KEPT: dict[str, str] = {}  # qualified name of a call of the library it never takes -> why (for the report)

    @classmethod
    def plan(cls, call: cst.Call, facts: FileFacts) -> FusedPlan | None:
        """The call's plan, or None when the call is not one of this concern's."""
        qualified = facts.qualname(call.func)
        if qualified in cls.KEPT:
            return kept(cls.KEPT[qualified])
        if qualified not in cls.TARGETS:
            return None
        try:
            return cls.rewrite(call, cls.TARGETS[qualified], facts)
        except Unmappable as kept_for:
            return kept(str(kept_for))

    @classmethod
    def rewrite(cls, call: cst.Call, function: str, facts: FileFacts) -> FusedPlan:
        raise NotImplementedError

    @classmethod
    def candidates(cls, model) -> list:
        """Only under `--fused` (facts.fused), in a file that calls one of TARGETS."""
        if not model.facts.fused or not any(model.qualname(call.func) in cls.TARGETS for call in model.calls):
            return []
        return [model.tree]

    _run_alone = False  # under libcst's tool, where naming the codemod is asking for it

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        self._run_alone = True
        return super().transform_module_impl(tree)

    def visit_Module(self, node: cst.Module) -> None:
        self._planned: list[tuple[cst.Call, FusedPlan]] = []
        if not (self.facts.tree.fused or self._run_alone):
            return
        for call in matchers.findall(node, matchers.Call()):
            plan = self.plan(call, self.facts)
            if plan is not None and plan.text is not None:
                self._planned.append((call, plan))
                self.claim(call)  # before ThirdPartyCuda visits it
                for inner in (inner for part in plan.dropped for inner in matchers.findall(part, matchers.Call())):
                    self.claim(inner)  # a call the replacement does not keep (an xformers mask object)
                for node, _ in plan.edits:
                    self.claim(node)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> None:
        """The rewrites, once every codemod has seen the file: a call in code DualTargetCode keeps for
        CUDA (frozen) is left, and so is the import it needs; the other codemods' edits inside a call
        (a `.cuda()` in an argument) are made in the copy of the arguments the rewrite writes."""
        frozen = self.context.scratch.get(FROZEN_KEY, [])
        edits = self.context.scratch.get(EDITS_KEY, [])
        gone: set[int] = set()  # the names the replacements do not keep
        for call, plan in self._planned:
            start, end = self.facts.span(call)
            if any(low <= start and end <= high for low, high in frozen):
                continue
            inner = [edit for edit in edits if start <= edit.start and edit.end <= end]
            needs_torch_npu = self.NEEDS_TORCH_NPU
            if inner:
                self.facts.fused_inner_edits = sorted(inner, key=lambda edit: (edit.start, edit.end))
                try:
                    replanned = self.plan(call, self.facts)
                    plan = replanned if replanned is not None and replanned.text is not None else plan
                finally:
                    del self.facts.fused_inner_edits
                needs_torch_npu = needs_torch_npu or any(edit.needs_torch_npu for edit in inner)
            if _CUDA_WORD.search(plan.text):  # a CUDA use a later stage (the audit's device flows) migrates in place
                flag = rules.third_party_flag(self.facts.qualname(call.func) or "")
                if flag is not None:
                    self.flag(call, flag, reason=f"{flag.reason}; `npu-migrate --fused` keeps it: an argument holds "
                                                 "CUDA code that is migrated where it stands, not inside the rewrite; "
                                                 "run npu-migrate once without --fused, then with it")
                continue
            self.replace_with_text(call, plan.text, self.RULE, needs_torch_npu=needs_torch_npu)
            for node, text in plan.edits:
                if isinstance(node, cst.SimpleStatementLine) and not text:
                    self.remove_line(node, self.RULE, False)
                else:
                    self.replace_with_text(node, text, self.RULE, needs_torch_npu=False)
            for part in (call.func, *plan.dropped):
                gone.update(id(name) for name in matchers.findall(part, matchers.Name()))
        libraries = {self.LIBRARY, *self.ALSO_REMOVES}
        if self._run_alone:
            self.remove_imports(original_node, gone, libraries)
        else:
            removed = self.context.scratch.setdefault(FUSED_REMOVED_KEY, (set(), set()))
            removed[0].update(gone)
            removed[1].update(libraries)


class FusedImports(ImportRemoval):
    """The imports of flash_attn, xformers, apex and amp_C no use is left of once the `--fused` concerns (before
    it) rewrote their calls: removed (a name of several: that name; an import that is its block's only
    statement: `pass`). Under `npu-migrate --fused`."""

    DESCRIPTION = "imports of flash_attn / xformers / apex / amp_C whose every use --fused rewrote, removed"
    RULES = ("fused-import",)
    WHOLE_FILE = True
    FILES_CONTAINING = ("flash_attn", "xformers", "apex")

    @classmethod
    def candidates(cls, model) -> list:
        from npukit.migrate.codemods import FUSED_CODEMODS

        concerned = any(codemod.candidates(model) for codemod in FUSED_CODEMODS if issubclass(codemod, FusedCodemod))
        return [model.tree] if concerned else []

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> None:
        gone, libraries = self.context.scratch.get(FUSED_REMOVED_KEY, (set(), set()))
        if gone:
            self.remove_imports(original_node, gone, libraries)
