"""An offline text corpus present on every machine: CPython's own standard-library sources.

The tiny target's tokenizer is trained on it and the embedded corpus cuts its prompts from it, so
the embedded default needs no download.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_text_files(max_files: int = 120) -> list[Path]:
    """Sorted CPython standard-library ``.py`` files: an offline text corpus present everywhere."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)
    if not files:
        raise RuntimeError(f"no standard-library sources found under {root}")
    return files[:max_files]
