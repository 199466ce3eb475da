"""The import graph of the product packages, read from the source with ast.

Every import counts: module-level and inside functions (an import moved into a function still
binds the two modules together, it only hides the cycle from Python's loader). `from x import y`
counts as an import of x.y when x.y is a module, else of x.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "engines", "billing")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    package = module.split(".")
    if path.name != "__init__.py":
        package.pop()
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _owner(name: str) -> str | None:
    """The product module `name` lands in: itself, or the nearest package above it."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path) -> dict[str, int]:
    """Product modules that `module` imports, each with the first line importing it."""
    targets: dict[str, int] = {}

    def add(name: str | None, line: int) -> None:
        owner = _owner(name) if name else None
        if owner and owner != module:
            targets.setdefault(owner, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            if base is None:
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in MODULES else base, node.lineno)
    return targets


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return [_path_through(set(component)) for component in components]


def _path_through(component: set[str]) -> list[str]:
    """A shortest cycle from the component's first module back to itself, within the component."""
    start = min(component)
    previous = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in GRAPH[node]:
            if target == start:
                cycle = [node]
                while previous[cycle[-1]] is not None:
                    cycle.append(previous[cycle[-1]])
                return [*reversed(cycle), start]
            if target in component and target not in previous:
                previous[target] = node
                queue.append(target)
    raise AssertionError(f"no cycle through {start}")


def _describe(cycle: list[str]) -> str:
    hops = [f"{a} (line {GRAPH[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join([*hops, cycle[-1]])


def test_the_graph_is_read():
    # A parser that found nothing would pass every test below.
    assert len(MODULES) > 80
    assert "billing.ledger.writer" in GRAPH["gateway.serving.admission"]
    assert "engines.base" in GRAPH["engines.backends.hf"]


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, "import cycles:\n" + "\n".join(_describe(cycle) for cycle in cycles)


def _reaching(sources: tuple[str, ...], forbidden: str) -> list[str]:
    return [
        f"{module} imports {target} (line {line})"
        for module, targets in sorted(GRAPH.items())
        if module.split(".")[0] in sources
        for target, line in sorted(targets.items())
        if target.split(".")[0] == forbidden
    ]


def test_engines_and_billing_import_nothing_of_gateway():
    reaching = _reaching(("engines", "billing"), "gateway")
    assert not reaching, "\n".join(reaching)


def test_the_cli_imports_nothing_of_bench():
    offending = []
    for path in sorted((ROOT / "gateway" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            offending += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "bench"]
    assert not offending, "gateway/cli/ imports bench/:\n" + "\n".join(offending)
