"""The import graph of services/ and shared/ has no cycle: every import counts, at module level or inside a function
(a function-level import that only dodges a cycle is still a cycle), except those under `if TYPE_CHECKING:`, which
never run. Built from the source with `ast`, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("services", "shared")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module under PACKAGES (a package is its __init__)."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except inside `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def _owner(name: str, mods: dict[str, str]) -> str | None:
    """The module `name` names, or the closest enclosing package of ours (a name inside a module: that module)."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports. `from x import y` leads to x.y when that is a module, else to x."""
    mods = module_files()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1 more
                    pkg_parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg_parts = pkg_parts[:len(pkg_parts) - (node.level - 1)]
                    base = ".".join(pkg_parts + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}" if base else a.name
                    targets.append(sub if sub in mods else base)
            for t in targets:
                owner = _owner(t, mods)
                if owner is not None and owner != mod:
                    graph[mod].add(owner)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """One cycle per strongly connected component of more than one module (Tarjan): a closed path from the
    component's first module, and the component's other modules (those the path misses)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:
        path = _path_in(graph, set(comp))
        cycles.append((path, sorted(set(comp) - set(path))))
    return cycles


def _path_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A closed path through a strongly connected component: from its first module back to it (BFS)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(comp)} is not strongly connected")


def test_graph_sees_imports():
    """The graph is not vacuous: known edges, a function-level one and a `from package import module` one."""
    graph = import_graph()
    assert "services.gateway.scheduler" in graph["services.gateway.replicas"]
    assert "shared.config" in graph["services.cli_args"]
    assert "services.local" in graph["services.cli"]  # `from services import local`, inside a function


def test_finder_reports_a_cycle():
    cycles = find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycles == [(["a", "b", "c", "a"], [])]
    assert find_cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}) == [(["a", "b", "a"], ["c"])]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    shown = [" -> ".join(path) + (f" (in one cycle with {', '.join(rest)} too)" if rest else "")
             for path, rest in cycles]
    for line in shown:
        print("import cycle:", line)
    assert not cycles, "import cycles: " + "; ".join(shown)
