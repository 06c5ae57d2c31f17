"""Rules about calls: the device and backend positions of each call.

(The other call rules are libcst codemods: npukit.migrate.codemods.)
"""

from __future__ import annotations

import ast


class CallRules:
    """Mixin for PythonMigrator: the device and backend positions of calls (pysource_devices), argparse."""

    def _handle_calls(self) -> None:
        for call in self.calls:
            func = call.func
            qualified = self.qualname(func)
            method = func.attr if isinstance(func, ast.Attribute) else None
            self._handle_device_sinks(call, qualified, method)
            if method == "add_argument":
                self._handle_argparse(call)
            elif method == "startswith" and self._is_device_like(func.value) and call.args:
                self._rewrite_device_choices(call.args[0], "device-compare")

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
