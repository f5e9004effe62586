"""The loss benchmark runs end to end at a tiny size and reports what the performance notes rely on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from testpaths import REPO


@pytest.mark.slow
def test_bench_loss_prints_one_line_per_case_with_ratios():
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "bench_loss.py"),
        *("--rows", "96", "--hidden", "16", "--vocab", "600", "--chunks", "32,1000"),
        *("--repeats", "1", "--warmup", "0", "--cases", "limit,chunked,chunked_ce,torch_lce,naive,naive_ce"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    recs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r.get("error") for r in recs] == [None] * len(recs)
    by_case = {(r["case"], r["chunk"]) for r in recs}
    assert by_case == {
        ("limit", 32),
        ("limit", 1000),
        ("chunked", 32),
        ("chunked", 1000),
        ("chunked_ce", 32),
        ("chunked_ce", 1000),
        ("torch_lce", 32),
        ("torch_lce", 1000),
        ("naive", None),
        ("naive_ce", None),
    }
    for r in recs:
        assert r["time_s"] > 0 and r["peak_extra_gb"] >= 0 and r["rows"] == 96
        if r["case"] in ("chunked", "chunked_ce", "torch_lce", "limit"):
            assert r["time_vs_naive"] > 0
        if r["case"] in ("chunked", "naive"):
            assert r["time_vs_limit"] > 0
        if r["case"] == "chunked_ce":
            assert r["time_vs_torch_lce"] > 0 and "mem_vs_torch_lce" in r
