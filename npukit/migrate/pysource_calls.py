"""The audit's view of a call's device argument.

(The rules about calls are libcst codemods: npukit.migrate.codemods.)
"""

from __future__ import annotations

import ast

from npukit.migrate import rules


def lacks_device_argument(call: ast.Call, qualified: str, *, starred_may_give_it: bool = True) -> bool:
    """rules.lacks_device_argument for an ast call (the audit's)."""
    return rules.lacks_device_argument(qualified, len(call.args), any(isinstance(a, ast.Starred) for a in call.args),
                                       {k.arg for k in call.keywords}, starred_may_give_it=starred_may_give_it)
