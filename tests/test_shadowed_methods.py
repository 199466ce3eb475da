"""No instance attribute of the product's classes hides a method its class inherits: an assignment
`self.name = ...` in a subclass whose base calls `self.name(...)` hands the base a value where it
expects a method. The memory limiter's record of settled holds (`self._settled`, a dict) once hid
`Limiter._settled`, the background settlement's done-callback: every request then gave the event
loop a dict to call. Read from the source (ast), classes resolved by name within the repository."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "engines", "billing")
# Meant: the one method rebound on the instance to a leaner variant of itself.
ALLOWED = {("ScriptClient", "run")}


def _classes() -> dict[str, list[tuple[str, set[str], set[str], list[str]]]]:
    found: dict[str, list[tuple[str, set[str], set[str], list[str]]]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef):
                    continue
                methods = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                assigned = {
                    e.attr
                    for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    for e in ast.walk(t)
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"
                }
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))]
                found.setdefault(node.name, []).append((str(path.relative_to(ROOT)), methods, assigned, bases))
    return found


def _methods(classes: dict[str, list[tuple[str, set[str], set[str], list[str]]]], name: str, seen: frozenset[str] = frozenset()) -> dict[str, str]:
    out: dict[str, str] = {}
    for path, methods, _, bases in classes.get(name, []):
        for m in methods:
            out.setdefault(m, f"{path}:{name}.{m}")
        for base in bases:
            if base not in seen:
                for m, where in _methods(classes, base, seen | {name}).items():
                    out.setdefault(m, where)
    return out


def test_no_instance_attribute_hides_a_method() -> None:
    classes = _classes()
    hidden = []
    for name, definitions in classes.items():
        for path, methods, assigned, _ in definitions:
            visible = _methods(classes, name)
            for attr in sorted(assigned):
                if attr in visible and (name, attr) not in ALLOWED:
                    hidden.append(f"{path}:{name}: self.{attr} hides {visible[attr]}")
    assert not hidden, "\n".join(hidden)

