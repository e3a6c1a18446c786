"""Every launcher in benchmarks/ and gateway/ starts Python children with `sys.executable`, never a
bare `python` from PATH (which, outside an activated venv, is another interpreter without the
project's packages: "No module named 'uvicorn'")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCHERS = {
    "Popen",
    "run",
    "call",
    "check_call",
    "check_output",
    "create_subprocess_exec",
    "execv",
    "execvp",
}
BARE_PYTHON = re.compile(r"^(?:python|python3)(?:\.\d+)?$")


def bare_python_launches(source: str) -> list[int]:
    """Line numbers of launcher calls whose program is a literal `python`/`python3` (argv list or first arg)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name not in LAUNCHERS:
            continue
        first = node.args[0]
        if isinstance(first, ast.List | ast.Tuple) and first.elts:
            first = first.elts[0]
        if (
            isinstance(first, ast.Constant)
            and isinstance(first.value, str)
            and BARE_PYTHON.match(first.value)
        ):
            lines.append(node.lineno)
    return lines


def test_the_check_finds_a_bare_python_launch() -> None:
    code = 'import subprocess, asyncio, sys\nsubprocess.Popen(["python", "-m", "gateway"])\n'
    code += 'asyncio.create_subprocess_exec("python3", "-c", "1")\nsubprocess.run([sys.executable, "-V"])\n'
    assert bare_python_launches(code) == [2, 3]


def test_no_launcher_in_benchmarks_or_gateway_starts_a_bare_python() -> None:
    found = {
        str(path.relative_to(REPO)): lines
        for folder in ("benchmarks", "gateway")
        for path in sorted((REPO / folder).rglob("*.py"))
        if (lines := bare_python_launches(path.read_text(encoding="utf-8")))
    }
    assert found == {}
