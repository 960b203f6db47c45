"""/proc is read in runtime/procstat.py only."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncckpt.runtime import procstat

PACKAGE = Path(__file__).resolve().parents[2] / "asyncckpt"


@pytest.mark.process  # a child process, to see a pid that is gone
def test_mem_available_and_pid_alive_read_this_machine():
    available = procstat.mem_available()
    assert available is None or available > 0
    assert procstat.pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not procstat.pid_alive(child.pid)


def test_no_other_module_names_a_proc_file():
    """String constants naming /proc files (and f-strings building them) appear in
    procstat only; other modules may mention /proc in docstrings and comments."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "procstat.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef,
                                        ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr)
                      and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.startswith("/proc/") and id(node) not in docstrings):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found
