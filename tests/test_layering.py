"""The layering README describes is the layering the code has.

Every import in ``src/corral`` (at module level, inside functions and under
``TYPE_CHECKING`` alike) is read with :mod:`ast`, and two things must hold:

- no import runs from a lower layer to a higher one (a layer may import its
  own and every layer below it);
- no two packages import each other, directly or through others (a package is
  a folder of ``src/corral``, or a module directly in it).  An import under
  ``if TYPE_CHECKING:`` loads nothing, so it counts for the layers but not here.

Run it alone with ``.venv/bin/pytest -q tests/test_layering.py``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = SRC / "corral"

#: bottom to top; a module's layer is that of its first name below ``corral``
LAYERS: list[tuple[str, set[str]]] = [
    ("spec/errors", {"spec", "errors", "secrets", "netrules", "progress"}),
    ("host/egress", {"host", "egress"}),
    ("tiers/images", {"tiers", "images"}),
    ("lifecycle", {"sandbox", "commands", "lifecycle", "surface", "transport", "owner_link", "owner_backend", "local_transport", "local_backend", "http_transport", "http_streams", "async_sandbox", "async_http", "pool", "registry", "interpreter", "execution", "client", "ports", "cluster", "snapshots", "parked"}),
    ("surfaces", {"cli", "server", "mcp_server", "mcp_limits", "host_checks", "__init__"}),
]
#: code that runs inside a sandbox, not on the host: it imports nothing of Corral
INSIDE = {"kernel"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _nodes(tree: ast.AST, type_only: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every node, and whether it sits under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(tree):
        guarded = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
        yield child, type_only
        if guarded:
            assert isinstance(child, ast.If)
            for stmt in child.body:
                yield stmt, True
                yield from _nodes(stmt, True)
            for stmt in child.orelse:
                yield stmt, type_only
                yield from _nodes(stmt, type_only)
        else:
            yield from _nodes(child, type_only)


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[int, str, bool]]:
    """(line, module, type only) for every module of Corral that ``name`` imports."""
    package = name if is_package(path) else name.rpartition(".")[0]
    for node, type_only in _nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("corral"):
                    yield node.lineno, alias.name, type_only
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("corral"):
                continue
            for alias in node.names:  # ``from pkg import module`` imports the module
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if sub in known else target, type_only


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer(name: str) -> int:
    for index, (_, tops) in enumerate(LAYERS):
        if top(name) in tops:
            return index
    raise AssertionError(f"{name} is in no layer: add {top(name)!r} to LAYERS in {__file__}")


def unit(name: str, known: dict[str, Path]) -> str:
    """The package a module belongs to (a module directly in ``corral`` is its own)."""
    if name == "corral" or known[name].parent == ROOT:
        return name
    return name if is_package(known[name]) else name.rpartition(".")[0]


def graph() -> dict[str, list[tuple[int, str, bool]]]:
    known = modules()
    return {name: sorted(set(imports(name, path, known))) for name, path in known.items()}


def test_no_import_runs_up_the_layers() -> None:
    wrong = []
    for name, targets in graph().items():
        if top(name) in INSIDE:
            wrong += [f"{name}:{line} imports {target} (it runs inside the sandbox)" for line, target, _ in targets]
            continue
        for line, target, _ in targets:
            if top(target) in INSIDE or layer(target) > layer(name):
                wrong.append(f"{name}:{line} ({LAYERS[layer(name)][0]}) imports {target}"
                             f" ({LAYERS[layer(target)][0] if top(target) not in INSIDE else 'inside'})")
    assert not wrong, "imports from a lower layer to a higher one:\n" + "\n".join(wrong)


def package_cycles() -> list[list[str]]:
    known = modules()
    edges: dict[str, set[str]] = {}
    for name, targets in graph().items():
        for _, target, type_only in targets:
            if type_only:
                continue
            a, b = unit(name, known), unit(target, known)
            if a != b:
                edges.setdefault(a, set()).add(b)
    # Tarjan's strongly connected components: any of two or more packages is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted({unit(name, known) for name in known}):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_between_packages() -> None:
    cycles = package_cycles()
    assert not cycles, "packages that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_server_routes_do_not_import_the_app() -> None:
    """``server/app.py`` assembles the routers; nothing in ``server/`` but its ``__init__`` imports it back."""
    wrong = [f"{name}:{line}" for name, targets in graph().items()
             if name.startswith("corral.server.") and name != "corral.server.app"
             for line, target, _ in targets if target == "corral.server.app"]
    assert not wrong, "import corral.server.app: " + ", ".join(wrong)


if __name__ == "__main__":  # a report: python tests/test_layering.py
    g = graph()
    print(f"{len(g)} modules, {sum(len(t) for t in g.values())} imports of Corral modules")
    print("package cycles:", package_cycles() or "none")
