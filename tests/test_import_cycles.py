"""No module of SparkCache imports one that imports it, however indirectly: not at the
top, not inside a function (a deferred import that only hides a cycle), not for type
checking. A module may import its own package (a package's ``__init__`` gathers its
modules). The cycles this replaced: the client and ``engine_stats`` (the counters'
record now belongs to the client), ``protocol`` and ``workers.lifecycle``
(``process_gone`` lives in ``shm.segment``), and the soak's control and workload (the
control's process is a module of its own)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The package's directories and the names they install as (pyproject.toml's mapping).
PACKAGES = {"sparkcache": "sparkcache", "workers": "sparkcache.workers",
            "shm": "sparkcache.shm"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST) -> set[str]:
    """Every module named by an absolute import anywhere in ``tree`` (and each name a
    ``from`` import takes, which may be a module)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    files = [p for d in PACKAGES for p in (REPO / d).rglob("*.py")]
    modules = {_module(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(ast.parse(path.read_text()))
                       if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_imports_one_that_imports_it() -> None:
    graph = import_graph()
    assert len(graph) > 100  # every module was read
    assert cycles(graph) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
