"""The package layout's one rule: libraries never import the training job or an app.

Library folders are ``targets, drafter, loss, distributed, data, eval, plan``. Their modules, and the
shared leaves ``metrics.py`` and ``files.py``, import no ``dflash.train`` module, not the shared CLI
entry (``dflash.config.cli``) and no app module (an ``app.py``, a ``__main__.py``, ``data/prepare.py``);
the apps inside library folders import no ``dflash.train`` module either. Every import counts,
including the ones inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

from testpaths import REPO

PACKAGE = REPO / "dflash"
LIBRARIES = ("targets", "drafter", "loss", "distributed", "data", "eval", "plan")
LEAVES = ("metrics.py", "files.py")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_app(path: Path) -> bool:
    rel = path.relative_to(PACKAGE).as_posix()
    return path.name in ("app.py", "__main__.py") or rel == "data/prepare.py"


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import in the file (``from x import y`` counts ``x`` and ``x.y``)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _apps() -> set[str]:
    return {_module_name(p) for p in PACKAGE.rglob("*.py") if _is_app(p)}


def _upward(module: str, importer_is_app: bool, apps: set[str]) -> bool:
    if module == "dflash.train" or module.startswith("dflash.train."):
        return True
    if importer_is_app:
        return False
    return module == "dflash.config.cli" or module in apps


def test_libraries_never_import_the_training_job_or_an_app():
    apps = _apps()
    files = [p for lib in LIBRARIES for p in (PACKAGE / lib).rglob("*.py")]
    files += [PACKAGE / leaf for leaf in LEAVES]
    assert len(files) > 50, "the walk found too few library modules: is the layout as the docstring says?"
    bad = [
        f"{p.relative_to(REPO)}:{line} imports {module}"
        for p in files
        for line, module in _imports(p)
        if _upward(module, _is_app(p), apps)
    ]
    assert not bad, "\n".join(bad)


def test_the_rule_catches_an_upward_import(tmp_path):
    """The walk sees an import inside a function, and an app module imported by a library."""
    lib = tmp_path / "lazy.py"
    lib.write_text("def f():\n    from dflash.train.setup import prepare\n    from dflash.eval import app\n")
    found = [m for _, m in _imports(lib) if _upward(m, False, {"dflash.eval.app"})]
    assert found == ["dflash.train.setup", "dflash.train.setup.prepare", "dflash.eval.app"]
