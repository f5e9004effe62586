"""Helpers of the fault scenarios: the shared run config, losses and log times, and each scenario's figure."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

import torch
from runner import Launch
from safetensors.torch import load_file
from wandb_reader import read_history

STEPS = ["train.max_steps=12", "train.save_every=4", "drafter.hidden_noise_std=0.05"]
"""The config of the reference run (tests/faults/conftest.py) and of every run compared with it
(with hidden-state noise: a resumed run must draw the same noise to equal it bitwise)."""
SENTINEL = "wandb-key-sentinel-7f3e2a9c1d5b"
"""The WANDB_API_KEY of the reference run; no file it writes may contain it."""
HANG_TIMEOUT_S = 8
"""topology.step_timeout_s of R4's run (a target stops responding)."""
HANG_GRACE_S = 10.0
"""R4's launch: seconds from the SIGTERM to the SIGKILL of a rank that ignores it (torchrun waits 30)."""

_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def losses(run_dir: Path) -> dict[int, float]:
    """train/loss by train/step over every launch that logged into ``run_dir`` (a later launch wins)."""
    return {int(row["train/step"]): row["train/loss"] for row in read_history(run_dir) if "train/loss" in row}


def log_time(log_text: str, needle: str) -> float | None:
    """``time.time()`` of the first log record containing ``needle`` (a traceback line counts for the
    record it belongs to), or None."""
    stamp = None
    for line in log_text.splitlines():
        m = _STAMP.match(line)
        if m:
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if needle in line and stamp is not None:
            return stamp
    return None


def resumed_step(log_text: str) -> int | None:
    """The step of the last "resumed from ... at step N" line of a drafter log."""
    steps = re.findall(r"resumed from \S+ at step (\d+)", log_text)
    return int(steps[-1]) if steps else None


def figure(scenario: str, **values: object) -> None:
    """Print a scenario's measured figure (``pytest -s`` or ``-rP`` shows it)."""
    print(f"FIGURE {scenario}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


def assert_continues_reference(run: Launch, reference: Launch, from_step: int, logged_from: int = 1) -> None:
    """After ``from_step`` the run equals the reference bitwise: per-step losses (W&B, which holds
    exactly the steps ``logged_from``..last), the final exported weights and the ledger (same
    samples in the same steps, none twice, none lost)."""
    ref, got = losses(reference.run_dir), losses(run.run_dir)
    last = max(ref)
    assert sorted(got) == list(range(logged_from, last + 1)), sorted(got)
    assert [got[s] for s in range(from_step + 1, last + 1)] == [
        ref[s] for s in range(from_step + 1, last + 1)
    ]
    a = load_file(str(reference.run_dir / "drafter" / "model.safetensors"))
    b = load_file(str(run.run_dir / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert run.ledger() == reference.ledger()
