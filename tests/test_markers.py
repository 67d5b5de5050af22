"""A pytest marker on a function that is not a test is silently ignored: ``-m gpu`` then never
selects the test it was meant for (a GPU check once skipped the CUDA-graph routing test so).
Checked on the source of every test file."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _marks(decorator: ast.expr) -> str | None:
    """The marker's name when ``decorator`` is ``pytest.mark.NAME`` or ``pytest.mark.NAME(...)``."""
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "pytest"
    ):
        return node.attr
    return None


def test_markers_sit_only_on_tests() -> None:
    misplaced = []
    checked = 0
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            marks = [m for m in map(_marks, node.decorator_list) if m is not None]
            if not marks:
                continue
            checked += 1
            is_test = node.name.startswith("test_" if not isinstance(node, ast.ClassDef) else "Test")
            if not is_test and marks != ["usefixtures"]:
                misplaced.append(f"{path.relative_to(TESTS)}:{node.lineno} {node.name} ({', '.join(marks)})")
    assert checked > 100  # the walk sees the suite's markers
    assert misplaced == []
