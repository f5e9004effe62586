"""The library versions dflash was tested with, and a warning when the installed ones differ.

dflash reads transformers internals (tensor/expert-parallel plans, cache classes, linear-attention
kernels), which change between minor releases without a deprecation: a release outside the tested
minors may run and be wrong. ``pyproject.toml`` allows exactly :data:`TESTED_MINORS` (a test checks
it), ``constraints.txt`` locks the newest, and ``make test-latest`` tries the next before it is allowed.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

log = logging.getLogger(__name__)

TESTED_MINORS: dict[str, tuple[str, ...]] = {"transformers": ("5.24", "5.25")}
"""Per library, the minor releases the test suite passed on."""

_warned = False


def minor(v: str) -> str:
    """``"5.25.0"`` -> ``"5.25"`` (a pre-release or local suffix ignored)."""
    parts = v.split("+")[0].split(".")
    return ".".join(parts[:2])


def untested_versions() -> list[str]:
    """One line per installed library whose minor release is not in :data:`TESTED_MINORS`."""
    lines = []
    for name, minors in TESTED_MINORS.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        if minor(installed) not in minors:
            lines.append(
                f"{name} {installed} is installed; dflash was tested with {name} {' and '.join(minors)} "
                f"(it reads {name} internals that change between releases): install the tested versions "
                "with `pip install -c constraints.txt -e .` (make setup), or try this one with "
                f"`make test-latest TRY={name}=={installed}` first"
            )
    return lines


def warn_untested_versions() -> None:
    """Log :func:`untested_versions` once per process (every app calls this at startup)."""
    global _warned
    if _warned:
        return
    _warned = True
    for line in untested_versions():
        log.warning(line)
