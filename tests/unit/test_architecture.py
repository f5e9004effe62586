"""The package's declared layer order: an import (at module level, inside a function or under
``TYPE_CHECKING``) goes to a module of the same layer or a lower one, and no modules import each
other round in a circle.

Layers, bottom first (:data:`LAYERS`): shared leaves, the config, metrics, then the libraries from
the loss math up to the planner and the eval, the shared app runner (``dflash.cli``), the training
job, and the apps on top (``report``, the GPU and serve checks, and every ``app.py``,
``__main__.py`` and ``data/prepare.py`` inside a library folder). A module no layer names fails the
test: a new package is placed on purpose.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from testpaths import REPO

PACKAGE = REPO / "dflash"
LAYERS: tuple[tuple[str, ...], ...] = (
    ("dflash", "dflash.versions", "dflash.files"),
    ("dflash.config",),
    ("dflash.metrics",),
    ("dflash.loss",),
    ("dflash.data",),
    ("dflash.targets",),
    ("dflash.drafter",),
    ("dflash.distributed",),
    ("dflash.sizing",),
    ("dflash.plan",),
    ("dflash.eval",),
    ("dflash.cli",),
    ("dflash.train",),
    ("dflash.report", "dflash.gpu_check", "dflash.serve_check"),
)
"""Bottom to top. Within a layer imports may go either way, but never round in a circle."""
APPS = len(LAYERS) - 1


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_app(name: str) -> bool:
    """An entry point inside a library folder: it sits with the apps, on top."""
    return name.endswith((".app", ".__main__")) or name == "dflash.data.prepare"


def layer_of(name: str) -> int | None:
    if is_app(name):
        return APPS
    best = None
    for i, group in enumerate(LAYERS):
        for prefix in group:
            inside = name == prefix or (name.startswith(prefix + ".") and prefix != "dflash")
            if inside and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    return None if best is None else best[0]


def imports_of(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import (``from x import y`` counts ``x.y`` and ``x``)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def graph_of(sources: dict[str, str]) -> dict[str, set[tuple[int, str]]]:
    """module -> ``(line, module it imports)`` for the imports of modules in ``sources``."""

    def resolve(target: str) -> str | None:
        while target and target not in sources:
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, set[tuple[int, str]]] = {}
    for name, source in sources.items():
        edges = set()
        for line, target in imports_of(source):
            found = resolve(target) if target.startswith("dflash") else None
            if found is not None and found != name:
                edges.add((line, found))
        graph[name] = edges
    return graph


def upward_imports(graph: dict[str, set[tuple[int, str]]]) -> list[str]:
    bad = []
    for name, edges in sorted(graph.items()):
        here = layer_of(name)
        if here is None:
            bad.append(f"{name}: in no layer of LAYERS")
            continue
        for line, target in sorted(edges):
            there = layer_of(target)
            if there is None or there > here:
                bad.append(f"{name}:{line} imports {target} (layer {there} above {here})")
    return bad


def circles(graph: dict[str, set[tuple[int, str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for _, w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_sources(paths: Iterable[Path], root: Path = REPO) -> dict[str, str]:
    return {module_name(p, root): p.read_text() for p in paths}


def test_imports_follow_the_layer_order_and_never_circle():
    graph = graph_of(package_sources(PACKAGE.rglob("*.py")))
    assert len(graph) > 100, "the walk found too few modules: is the layout as the docstring says?"
    upward = upward_imports(graph)
    assert upward == [], "imports against the layer order:\n" + "\n".join(upward)
    found = circles(graph)
    assert found == [], "import circles (the modules of each):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_training_imports_nothing_of_the_planner():
    """The training job reads the cost and memory models (:mod:`dflash.sizing`), never the planner:
    the planner's search, tables and GPU probe change without touching training, and no training
    rank can run ``plan.gpu=auto``'s probe."""
    graph = graph_of(package_sources(PACKAGE.rglob("*.py")))
    train = {name: edges for name, edges in graph.items() if name.startswith("dflash.train")}
    assert len(train) > 10
    planner = [
        f"{name}:{line} imports {t}"
        for name, edges in train.items()
        for line, t in edges
        if t.startswith("dflash.plan")
    ]
    assert planner == []


def test_the_rules_catch_an_upward_import_and_a_circle():
    """An import inside a function of a library up to the training job, to an app, and a circle of
    two libraries of one layer (even through ``TYPE_CHECKING``)."""
    sources = {
        "dflash.targets.lazy": "def f():\n    from dflash.train.setup import prepare\n    from dflash.eval import app\n",
        "dflash.train.setup": "",
        "dflash.eval.app": "",
        "dflash.plan.a": "from dflash.plan.b import x\n",
        "dflash.plan.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dflash.plan.a import y\n",
    }
    graph = graph_of(sources)
    assert upward_imports(graph) == [
        "dflash.targets.lazy:2 imports dflash.train.setup (layer 12 above 5)",
        "dflash.targets.lazy:3 imports dflash.eval.app (layer 13 above 5)",
    ]
    assert circles(graph) == [["dflash.plan.a", "dflash.plan.b"]]
    assert upward_imports(graph_of({"dflash.newpkg.mod": ""})) == ["dflash.newpkg.mod: in no layer of LAYERS"]
