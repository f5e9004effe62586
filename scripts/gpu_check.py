#!/usr/bin/env python
"""GPU readiness check (``make gpu-check``; ``--help`` for how to run it): the entry point of
``dflash.gpu_check``, importable from this checkout."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dflash.gpu_check.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
