"""scripts/bench_checkpoint.py at a small size (2 gloo drafters, FSDP2): a line per method and
drafter, and the measured claim of docs/measured.md: the DCP save adds almost nothing to a drafter's
host memory, the whole-state gather it replaced adds about the whole state on each, and the export
holds the whole weights on the leader alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from testpaths import REPO

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.extended]


def test_the_sharded_save_holds_no_whole_state():
    cmd = [sys.executable, "scripts/bench_checkpoint.py", "--hidden", "1024", "--layers", "3"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {
        (r["method"], r["drafter"]): r
        for r in (json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{"))
    }
    assert set(rows) == {(m, d) for m in ("dcp", "gather", "export") for d in (0, 1)}
    state = rows["dcp", 0]["state_gib"]
    weights = state / 3
    for d in (0, 1):
        assert rows["gather", d]["save_peak_above_gib"] > 0.8 * state, rows["gather", d]
        assert rows["dcp", d]["save_peak_above_gib"] < 0.1 * state, rows["dcp", d]
    assert rows["export", 0]["save_peak_above_gib"] > 0.8 * weights, rows["export", 0]
    assert rows["export", 1]["save_peak_above_gib"] < 0.5 * weights, rows["export", 1]
    print("FIGURE bench_checkpoint " + " | ".join(json.dumps(r) for r in rows.values()))
