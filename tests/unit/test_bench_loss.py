"""The loss benchmark runs end to end at a small size: every case computes the same loss and gradient
as the naive one of its terms (same seeded inputs, each case in a process of its own), the chunked
loss needs less memory than the naive one, and the ratios are those of the reported figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from testpaths import REPO

ROWS, VOCAB = 512, 4096  # naive: several [512 x 4096] fp32 tensors (8 MB each); chunk 64: 1 MB ones


@pytest.mark.slow
@pytest.mark.extended
def test_bench_loss_cases_agree_with_the_naive_loss_and_use_less_memory():
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "bench_loss.py"),
        *("--rows", str(ROWS), "--hidden", "16", "--vocab", str(VOCAB), "--chunks", f"64,{2 * ROWS}"),
        *("--repeats", "1", "--warmup", "0", "--threads", "1"),
        *("--cases", "limit,chunked,chunked_ce,torch_lce,naive,naive_ce"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    recs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r.get("error") for r in recs] == [None] * len(recs)
    by_case = {(r["case"], r["chunk"]): r for r in recs}
    assert set(by_case) == {
        *(
            (case, chunk)
            for case in ("limit", "chunked", "chunked_ce", "torch_lce")
            for chunk in (64, 2 * ROWS)
        ),
        ("naive", None),
        ("naive_ce", None),
    }
    naive = {"ce+kl": by_case[("naive", None)], "ce": by_case[("naive_ce", None)]}
    assert naive["ce+kl"]["loss"] > naive["ce"]["loss"] > 0  # the KL term adds to the CE
    for (case, chunk), r in by_case.items():
        assert r["rows"] == ROWS and r["time_s"] > 0, r
        if case == "limit":  # the GEMMs alone: no loss, no gradient
            assert "loss" not in r and r["time_vs_naive"] == round(r["time_s"] / naive["ce+kl"]["time_s"], 4)
            continue
        ref = naive[r["terms"]]
        # the same loss and gradient as the naive case of the same terms (fp32, other summation orders)
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5), (case, chunk)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (case, chunk)
        assert r["grad_probe"] == pytest.approx(ref["grad_probe"], rel=1e-4, abs=1e-7), (case, chunk)
        if case in ("chunked", "chunked_ce"):
            assert r["time_vs_naive"] == round(r["time_s"] / ref["time_s"], 4)
            assert r["mem_vs_naive"] == round(r["peak_extra_gb"] / ref["peak_extra_gb"], 4)
            # less memory than the naive loss; at chunk 64 (1/8 of the rows) less than half
            assert r["peak_extra_gb"] < ref["peak_extra_gb"] * (0.5 if chunk == 64 else 1.0), (r, ref)
    for chunk in (64, 2 * ROWS):
        ce, lce = by_case[("chunked_ce", chunk)], by_case[("torch_lce", chunk)]
        assert ce["time_vs_torch_lce"] == round(ce["time_s"] / lce["time_s"], 4)
    best_limit = min(by_case[("limit", c)]["time_s"] for c in (64, 2 * ROWS))
    assert naive["ce+kl"]["time_vs_limit"] == round(naive["ce+kl"]["time_s"] / best_limit, 4)
