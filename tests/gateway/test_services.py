"""The app's state is one typed `gateway/services.py:Services` (issue 23): every `app.state.X` that
gateway/ reads is one of its fields, and nothing reads it with getattr/hasattr (every field exists
from the start, so a default hides only a misspelt name)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from gateway.services import Services

ROOT = Path(__file__).resolve().parents[2]


def _is_app_state(node: ast.AST) -> bool:
    """`app.state` or `<anything>.app.state` (the per-request `request.state` is another object)."""
    if not (isinstance(node, ast.Attribute) and node.attr == "state"):
        return False
    inner = node.value
    return (isinstance(inner, ast.Attribute) and inner.attr == "app") or (isinstance(inner, ast.Name) and inner.id == "app")


def untyped_reads(source: str) -> list[str]:
    fields = {f.name for f in dataclasses.fields(Services)}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_app_state(node.value) and node.attr not in fields:
            found.append(f"{node.lineno}: app.state.{node.attr} is not a Services field")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and node.args and _is_app_state(node.args[0])):
            found.append(f"{node.lineno}: {node.func.id}(app.state, ...)")
    return found


def test_the_check_sees_both_kinds() -> None:
    assert untyped_reads("def f(request):\n    return getattr(request.app.state, 'read_db', None)\n") == [
        "2: getattr(app.state, ...)"]
    assert untyped_reads("x = app.state.raed_db\ny = request.state.anything\nz = request.app.state.read_db\n") == [
        "1: app.state.raed_db is not a Services field"]


def test_gateway_reads_app_state_only_as_services_fields() -> None:
    found = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        found += [f"{path.relative_to(ROOT)}:{line}" for line in untyped_reads(path.read_text())]
    assert found == []
