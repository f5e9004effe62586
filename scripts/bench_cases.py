"""What the benchmark drivers share (``bench_loss.py``, ``bench_drafter_step.py``): each case in a
process of its own, and the ratios of one case's record to another's."""

from __future__ import annotations

import json
import subprocess
from typing import Any


def run_case(cmd: list[str], timeout: float, label: dict[str, Any]) -> dict[str, Any]:
    """Run one case's process ``cmd``: the last JSON line it prints, or ``label`` with an ``error``
    (its timeout, or its exit status and the last lines of what it wrote)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**label, "error": f"timeout after {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {**label, "error": f"rc={proc.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


def add_ratios(r: dict[str, Any], other: dict[str, Any] | None, name: str, mem_key: str) -> None:
    """``time_vs_<name>`` and ``mem_vs_<name>`` (of the records' ``mem_key``) of ``r`` against
    ``other``, when that ran."""
    if other is None or "error" in other:
        return
    r[f"time_vs_{name}"] = round(r["time_s"] / other["time_s"], 4)
    if other[mem_key] > 0:
        r[f"mem_vs_{name}"] = round(r[mem_key] / other[mem_key], 4)
