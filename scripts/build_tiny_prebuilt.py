#!/usr/bin/env python
"""Train the default tiny target (conf/target/tiny.yaml) and ship it: ``dflash/targets/prebuilt/``.

``ensure_tiny_target`` copies that build instead of training the default spec where it runs, so the
embedded default, its corpus and the tests' golden losses are the same on every CPU. Run this only
when the default spec, ``BUILD_VERSION`` or the training code changes on purpose, then regenerate
the golden losses (tests/multiproc/test_train_e2e.py says how) and commit both with the reason.

    python scripts/build_tiny_prebuilt.py            # trains (about a minute on 2 cores), replaces prebuilt/
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from dflash.config import TinyTargetConfig
from dflash.files import atomic_directory
from dflash.targets.tiny import _DONE, PREBUILT_DIR, build_tiny_target


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    spec = TinyTargetConfig()
    with tempfile.TemporaryDirectory() as scratch:
        built = Path(scratch) / "build"
        built.mkdir()
        marker = build_tiny_target(built, spec)
        marker["made_with"] = {
            "command": "python scripts/build_tiny_prebuilt.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
            "cpu": f"{_cpu_name()} ({torch.backends.cpu.get_cpu_capability()})",
        }
        with atomic_directory(PREBUILT_DIR) as tmp:
            for name in marker["files"]:
                shutil.copyfile(built / name, tmp / name)
            (tmp / _DONE).write_text(json.dumps(marker, indent=1) + "\n")
    print(f"shipped tiny target: {PREBUILT_DIR} (final training loss {marker['final_loss']:.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
