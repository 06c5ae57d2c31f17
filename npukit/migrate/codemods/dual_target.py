"""Code that already chooses between CUDA and an NPU: kept as it is."""

from __future__ import annotations

import ast

import libcst as cst

from npukit.migrate.codemods.base import NpuCodemod
from npukit.migrate.rules import Flag

_IS_AVAILABLE = "torch.cuda.is_available"
_HOLDS_STATEMENTS = (cst.BaseSuite, cst.BaseCompoundStatement, cst.Else, cst.ExceptHandler, cst.ExceptStarHandler,
                     cst.Finally, cst.MatchCase)


class DualTargetCode(NpuCodemod):
    """An if/elif chain one of whose tests names the NPU (`if torch.cuda.is_available(): ...
    elif torch.npu.is_available(): ...`) keeps each branch whose test asks for CUDA exactly as it is;
    so does a conditional expression (`"cuda" if torch.cuda.is_available() else "npu"`). Each is
    reported (info, nothing to do). Inside npu-migrate no rule edits the kept code: the span from such a
    test to the end of its branch, or the whole expression, is frozen."""

    DESCRIPTION = "CUDA branches of code that already has an NPU branch kept as they are"
    FILES_CONTAINING = ("npu",)

    @classmethod
    def concerns(cls, code: str) -> bool:
        return "npu" in code and "is_available" in code

    @classmethod
    def candidates(cls, model) -> list:
        def asks_for_cuda(test: ast.AST) -> bool:
            return any(isinstance(sub, ast.Attribute) and model.qualname(sub) == _IS_AVAILABLE for sub in ast.walk(test))

        found = []
        for node in model.ifs:
            tests = [node.test]
            while len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
                node = node.orelse[0]
                tests.append(node.test)
            if len(tests) > 1 and any("npu" in model.pos.segment(test) for test in tests) and \
                    any(asks_for_cuda(test) for test in tests):
                found.append(node)
        return found + [node for node in model.conditionals
                        if "npu" in model.pos.segment(node) and asks_for_cuda(node.test)]

    def visit_Module(self, node: cst.Module) -> None:
        self.kept: set[cst.If] = set()

    def visit_If(self, node: cst.If) -> None:
        chain = [node]  # the if and its elifs (an else holding nothing but an if continues it, as for ast)
        while True:
            following = chain[-1].orelse
            if isinstance(following, cst.Else) and isinstance(following.body, cst.IndentedBlock) and \
                    len(following.body.body) == 1 and isinstance(following.body.body[0], cst.If):
                following = following.body.body[0]
            if not isinstance(following, cst.If):
                break
            chain.append(following)
        if len(chain) < 2 or not any("npu" in self.facts.module.code_for_node(branch.test) for branch in chain):
            return
        for branch in chain:
            if branch in self.kept:  # an elif chain inside an else is also a chain of its own
                continue
            self.kept.add(branch)
            for attribute in self._is_available_references(branch.test):
                end = self._end_of_last_statement(branch.body)
                self.flag(attribute, Flag("dual-target", "info", "this if/elif already has an NPU branch; the CUDA branch was kept",
                                          "nothing to do"), end_line=self.facts.line_col(end)[0])
                self.freeze(self.facts.span(branch.test)[0], end)

    def visit_IfExp(self, node: cst.IfExp) -> None:
        if "npu" in self.facts.module.code_for_node(node) and self._is_available_references(node.test):
            start, end = self.facts.span(node)
            self.flag(node, Flag("dual-target", "info", "this expression already has an NPU choice; its CUDA choice was kept",
                                 "nothing to do"), end_line=self.facts.line_col(end)[0])
            self.freeze(start, end)

    def _is_available_references(self, test: cst.BaseExpression) -> list[cst.Attribute]:
        found: list[cst.Attribute] = []

        class Collector(cst.CSTVisitor):
            def visit_Attribute(inner, node: cst.Attribute) -> None:  # noqa: N805 (closes over self)
                if self.facts.qualname(node) == _IS_AVAILABLE:
                    found.append(node)

        test.visit(Collector())
        return found

    def _end_of_last_statement(self, block: cst.BaseSuite) -> int:
        """Where the block's last statement ends, as ast counts it: after its last token, before any
        semicolon, comment, line break or comment lines closing the block."""
        node: cst.CSTNode = block
        while not isinstance(node, cst.BaseSmallStatement):
            if isinstance(node, (cst.SimpleStatementLine, cst.SimpleStatementSuite, cst.IndentedBlock)):
                node = node.body[-1]
            else:
                node = [child for child in node.children if isinstance(child, _HOLDS_STATEMENTS)][-1]
        return self.facts.span(node)[1]
