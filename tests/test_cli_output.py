"""Output people read: help without fake value types, tables that stay whole when piped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("command", ["npu-run", "npu-compare", "npu-migrate", "npu-profile"])
def test_help_shows_no_value_type_for_flags(command):
    result = subprocess.run([str(BIN / command), "--help"], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    assert result.returncode == 0
    assert "<bool>" not in result.stdout and "<list[str]>" not in result.stdout
    assert "--help" in result.stdout


def test_a_piped_table_is_not_wrapped_at_80_columns(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    code = ("from npukit.console import make_console; from rich.table import Table\n"
            "t = Table(); [t.add_column(c) for c in ('name', 'dtype', 'cosine', 'message')]\n"
            "t.add_row('Module.layers.0.attention.Linear.forward.0.output.0', 'bfloat16', '0.999', "
            "'cosine 0.9991, relative L2 0.0123')\nmake_console().print(t)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    rows = [line for line in result.stdout.splitlines() if "Module.layers" in line]
    assert len(rows) == 1 and "relative L2 0.0123" in rows[0]  # one line per row
