#!/usr/bin/env python3
"""Writes the TensorRT-LLM API contract the `trtllm` backend and its test double are checked against.

    python scripts/trtllm_contract.py SRC COMMIT [--out tests/contracts/trtllm_contract.json]

SRC is a folder holding TensorRT-LLM's Python sources as in the repository (a full checkout, or
only the few files listed in FILES); COMMIT is the commit they were read from, stamped into the
contract. The files are parsed with `ast`, never imported (TensorRT-LLM needs CUDA to import).
What is written is facts about the API (names, signatures, defaults, members, exports), not code.
Run by hand when moving to another TensorRT-LLM version; tests/engines/backends/test_trtllm_contract.py
reads the result.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

# Where each defining file lives; the first path that exists wins (1.x moved sampling params).
FILES: dict[str, tuple[str, ...]] = {
    "sampling": ("tensorrt_llm/executor/params/sampling.py", "tensorrt_llm/sampling_params.py"),
    "result": ("tensorrt_llm/executor/result.py",),
    "llm": ("tensorrt_llm/llmapi/llm.py",),
    "llm_args": ("tensorrt_llm/llmapi/llm_args.py",),
    "executor_utils": ("tensorrt_llm/executor/utils.py",),
    "package": ("tensorrt_llm/__init__.py",),
    "llmapi": ("tensorrt_llm/llmapi/__init__.py",),
}
MODULES = {"package": "tensorrt_llm", "llmapi": "tensorrt_llm.llmapi"}
# The classes the contract describes: (name, file key, kind). kind: dataclass | model | class | enum | exception.
CLASSES = (
    ("SamplingParams", "sampling", "dataclass"),
    ("GuidedDecodingParams", "sampling", "dataclass"),
    ("LogprobMode", "sampling", "enum"),
    ("CompletionOutput", "result", "dataclass"),
    ("GenerationResult", "result", "class"),
    ("RequestOutput", "llm", "class"),
    ("LLM", "llm", "class"),
    ("BaseLlmArgs", "llm_args", "model"),
    ("TorchLlmArgs", "llm_args", "model"),
    ("KvCacheConfig", "llm_args", "model"),
    ("SchedulerConfig", "llm_args", "model"),
    ("CapacitySchedulerPolicy", "llm_args", "enum"),
    ("ContextChunkingPolicy", "llm_args", "enum"),
    ("WaitingQueuePolicy", "llm_args", "enum"),
    ("RequestError", "executor_utils", "exception"),
)
SIGNATURES = (("LLM", "__init__"), ("LLM", "generate_async"))
ITERATION = {"__aiter__", "__anext__", "__await__", "__iter__", "__next__"}


def _expr(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _default(node: ast.AST) -> dict[str, Any]:
    """{"default": literal} when the expression is a literal, else {"default_expr": source}."""
    try:
        return {"default": ast.literal_eval(node)}
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return {"default_expr": ast.unparse(node)}


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return None


def _field(stmt: ast.AnnAssign, kind: str) -> dict[str, Any] | None:
    """One declared field: name, annotation, default (or factory, or required), init, alias."""
    if not isinstance(stmt.target, ast.Name):
        return None
    name = stmt.target.id
    out: dict[str, Any] = {"name": name, "annotation": _expr(stmt.annotation)}
    value = stmt.value
    if name == "model_config" or (isinstance(value, ast.Call) and _call_name(value) == "PrivateAttr"):
        return None  # pydantic configuration and private attributes are not fields
    if value is None:
        out["required"] = True
        return out
    call = _call_name(value)
    if kind == "dataclass" and call == "field" or kind == "model" and call in ("Field", "PydanticField"):
        assert isinstance(value, ast.Call)
        kw = {k.arg: k.value for k in value.keywords if k.arg}
        if "default" in kw:
            out.update(_default(kw["default"]))
        elif value.args:
            first = value.args[0]
            if isinstance(first, ast.Constant) and first.value is Ellipsis:
                out["required"] = True
            else:
                out.update(_default(first))
        elif "default_factory" in kw:
            out["default_factory"] = ast.unparse(kw["default_factory"])
        else:
            out["required"] = True
        if "init" in kw:
            out["init"] = bool(ast.literal_eval(kw["init"]))
        if "alias" in kw:
            out["alias"] = ast.literal_eval(kw["alias"])
        return out
    out.update(_default(value))
    return out


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[dict[str, Any]]:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults: list[ast.AST | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = []
    for arg, default in zip(positional, defaults):
        p: dict[str, Any] = {"name": arg.arg, "kind": "positional_or_keyword"}
        if default is not None:
            p.update(_default(default))
        out.append(p)
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "var_positional"})
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        p = {"name": arg.arg, "kind": "keyword_only"}
        if default is not None:
            p.update(_default(default))
        out.append(p)
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "var_keyword"})
    return out


def _is_property(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def _class_info(cls: ast.ClassDef, kind: str) -> dict[str, Any]:
    info: dict[str, Any] = {"bases": [ast.unparse(b) for b in cls.bases], "fields": [], "properties": [], "methods": {}, "members": {}}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and kind in ("dataclass", "model"):
            f = _field(stmt, kind)
            if f is not None:
                info["fields"].append(f)
        elif isinstance(stmt, ast.Assign) and kind == "enum":
            for target in stmt.targets:
                if isinstance(target, ast.Name) and not target.id.startswith("_"):
                    info["members"][target.id] = ast.literal_eval(stmt.value)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if _is_property(stmt):
                info["properties"].append(stmt.name)
            else:
                info["methods"][stmt.name] = {"params": _params(stmt), "async": isinstance(stmt, ast.AsyncFunctionDef)}
            if stmt.name == "__init__":  # attributes the constructor sets on self
                attrs = sorted({t.attr for n in ast.walk(stmt) if isinstance(n, (ast.Assign, ast.AnnAssign))
                                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"})
                info["instance_attributes"] = [a for a in attrs if not a.startswith("_")]
    return info


class Source:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: dict[str, str] = {}
        self.trees: dict[str, ast.Module] = {}
        for key, candidates in FILES.items():
            for rel in candidates:
                path = root / rel
                if path.is_file():
                    self.paths[key] = rel
                    self.trees[key] = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
                    break
            else:
                raise SystemExit(f"{root}: none of {', '.join(candidates)} exists")
        # Every class of every file, for resolving bases across files.
        self.classes: dict[str, ast.ClassDef] = {}
        for tree in self.trees.values():
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, node)

    def mro(self, name: str) -> list[str]:
        """The class and its bases that are defined in the parsed files, most derived first."""
        order: list[str] = []

        def visit(n: str) -> None:
            cls = self.classes.get(n)
            if cls is None or n in order:
                return
            order.append(n)
            for base in cls.bases:
                visit(ast.unparse(base).split("[")[0].split(".")[-1])

        visit(name)
        return order

    def describe(self, name: str, key: str, kind: str) -> dict[str, Any]:
        chain = self.mro(name)
        if not chain:
            raise SystemExit(f"class {name} not found in {self.paths[key]}")
        merged: dict[str, Any] = {"defined_in": self.paths[key], "kind": kind, "mro": chain}
        fields: dict[str, dict[str, Any]] = {}
        properties: list[str] = []
        methods: dict[str, Any] = {}
        instance_attributes: set[str] = set()
        members: dict[str, Any] = {}
        for cls_name in reversed(chain):  # bases first, derived classes override
            info = _class_info(self.classes[cls_name], kind)
            if cls_name == name:
                merged["bases"] = info["bases"]
            for f in info["fields"]:
                fields.pop(f["name"], None)
                fields[f["name"]] = f
            properties = [p for p in properties if p not in info["properties"]] + info["properties"]
            methods.update(info["methods"])
            instance_attributes.update(info.get("instance_attributes", ()))
            members.update(info["members"])
        if kind in ("dataclass", "model"):
            merged["fields"] = list(fields.values())
        if kind == "enum":
            merged["members"] = members
        else:
            merged["properties"] = properties
            merged["public_methods"] = sorted(m for m in methods if not m.startswith("_") or m in ITERATION)
            if instance_attributes:
                merged["instance_attributes"] = sorted(instance_attributes)
        merged["_methods"] = methods
        return merged

    def exports(self, key: str) -> dict[str, Any]:
        tree = self.trees[key]
        names_all: list[str] = []
        imported: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                names_all = list(ast.literal_eval(node.value))
            elif isinstance(node, ast.ImportFrom):
                imported.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                imported.update(a.asname or a.name.split(".")[0] for a in node.names)
        # A name in __all__ that nothing binds cannot be imported from the module.
        return {"all": names_all, "bound": sorted(imported), "listed_but_unbound": [n for n in names_all if n not in imported]}


def build(root: Path, commit: str) -> dict[str, Any]:
    src = Source(root)
    classes = {name: src.describe(name, key, kind) for name, key, kind in CLASSES}
    signatures = {}
    for cls, method in SIGNATURES:
        found = classes[cls]["_methods"].get(method)
        if found is None:
            raise SystemExit(f"{cls}.{method} not found")
        signatures[f"{cls}.{method}"] = [p for p in found["params"] if p["name"] != "self"]
    for info in classes.values():
        info.pop("_methods")
    # Names imported where they are used but defined in files not parsed here.
    referenced = {}
    for node in ast.walk(src.trees["result"]):
        if isinstance(node, ast.ImportFrom) and node.module == "utils" and node.level == 1:
            referenced.update({a.name: "tensorrt_llm.executor.utils" for a in node.names if a.name == "EngineDeadError"})
    return {
        "source": {"repository": "NVIDIA/TensorRT-LLM", "commit": commit, "files": dict(sorted(src.paths.items()))},
        "generated_by": "scripts/trtllm_contract.py (ast only; no TensorRT-LLM code is kept)",
        "classes": classes,
        "signatures": signatures,
        "exports": {MODULES[k]: src.exports(k) for k in MODULES},
        "referenced_not_parsed": referenced,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="folder with TensorRT-LLM's sources (tensorrt_llm/... inside)")
    parser.add_argument("commit", help="the commit the sources were read from")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/contracts/trtllm_contract.json")
    args = parser.parse_args(argv)
    if len(args.commit) != 40 or any(c not in "0123456789abcdef" for c in args.commit.lower()):
        parser.error("commit must be a full 40-hex-digit commit id")
    contract = build(args.src, args.commit.lower())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(contract, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({len(contract['classes'])} classes) from {args.commit}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
