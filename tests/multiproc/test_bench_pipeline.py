"""scripts/bench_pipeline.py at a tiny size (on GPUs it is the headline benchmark): each split trains
the packets the data plan schedules for its steps, and the ratios are those of its figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from runner import FAST, env_for, prepare_fast
from testpaths import REPO

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.extended]


def test_bench_pipeline_prints_a_line_per_split_and_the_ratios(run_cache):
    cmd = [sys.executable, "scripts/bench_pipeline.py", "--splits", "2:1,1:2", "--steps", "4", "--", *FAST]
    proc = subprocess.run(cmd, cwd=REPO, env=env_for(run_cache), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["split"] for r in lines[:2]] == ["2:1", "1:2"]
    for r in lines[:2]:
        assert r["steps"] == 4 and r["samples_per_s"] > 0 and 0 < r["drafter_busy_frac"] <= 1.0001
        assert r["target_s_per_packet"] > 0 and r["drafter_s_per_packet"] > 0
        assert set(r["peak_mem_gib"]) == {"0", "1", "2"} and all(v > 0 for v in r["peak_mem_gib"].values())
    # The packets each split trained: 4 steps of 1 packet (1 drafter), of 2 packets (2 drafters).
    setup = prepare_fast(run_cache)
    lengths = setup.dataset.lengths()
    tokens = [int(lengths[setup.plan.packet(g)].sum()) for g in range(8)]
    assert [r["tokens_trained"] for r in lines[:2]] == [sum(tokens[:4]), sum(tokens)]
    relative = lines[2]["relative_samples_per_s"]
    assert lines[2]["baseline"] == "2:1" and relative["2:1"] == 1.0
    assert relative["1:2"] == round(lines[1]["samples_per_s"] / lines[0]["samples_per_s"], 3)
    print("FIGURE bench_pipeline " + " | ".join(json.dumps(r) for r in lines))
