"""The drafter-step benchmark runs end to end at a small size: every variant (checkpointed, whole,
chunked) trains the same loss and gradient on the same packet (each in a process of its own), the
ratios are those of the reported figures, and the chunked steps hold less memory than the whole one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from testpaths import REPO

# 256 blocks of 16 slots over 512 tokens, H=64, V=2048: the whole packet's activations (dense SDPA
# over 4,608 keys per block query, the layers' [4096, H] tensors) are several times the
# [rows, V] loss buffers and what the chunks keep (their blocks' share and the context's keys and
# values), so the process peak RSS of the chunked steps is well below the whole step's (about 5x
# at 4 chunks, measured), far beyond the allocator's noise.
SHAPE = ("--hidden", "64", "--vocab", "2048", "--anchors", "256", "--docs", "4", "--layers", "2")
VARIANTS = ["checkpointed", "whole", "chunked_4", "chunked_8"]


@pytest.mark.slow
@pytest.mark.extended
def test_bench_drafter_step_variants_agree_and_chunks_use_less_memory():
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "bench_drafter_step.py"),
        *SHAPE,
        *("--head-dim", "16", "--chunks", "4,8", "--threads", "1", "--repeats", "1", "--warmup", "0"),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    shape = lines[0]["shape"]
    assert shape["blocks"] == 256 and shape["layers_tflop"] > 0 and 0 < shape["loss_share"] < 1
    recs = {r["case"]: r for r in lines[1:]}
    assert list(recs) == VARIANTS
    assert [r.get("error") for r in recs.values()] == [None] * len(VARIANTS)
    ckpt, whole = recs["checkpointed"], recs["whole"]
    assert ckpt["checkpoint"] and not whole["checkpoint"] and recs["chunked_8"]["chunks"] == 8
    for name, r in recs.items():
        assert r["blocks"] == 256 and r["time_s"] > 0 and r["tflop"] > 0, r
        # the same loss and gradient as the checkpointed step (fp32, other summation orders)
        assert r["loss"] == pytest.approx(ckpt["loss"], rel=1e-5), name
        assert r["grad_probe"] == pytest.approx(ckpt["grad_probe"], rel=1e-4), name
        assert r["grad_norm"] == pytest.approx(ckpt["grad_norm"], rel=1e-4), name
        assert r["loss_rel_diff_vs_checkpointed"] == abs(r["loss"] - ckpt["loss"]) / abs(ckpt["loss"])
        assert r["grad_rel_diff_vs_checkpointed"] == abs(r["grad_probe"] - ckpt["grad_probe"]) / abs(
            ckpt["grad_probe"]
        )
        for ref, ref_name in ((ckpt, "checkpointed"), (whole, "whole")):
            assert r[f"time_vs_{ref_name}"] == round(r["time_s"] / ref["time_s"], 4), name
            assert r[f"mem_vs_{ref_name}"] == round(r["peak_extra_gib"] / ref["peak_extra_gib"], 4), name
    for name in ("chunked_4", "chunked_8"):
        assert recs[name]["peak_extra_gib"] < 0.7 * whole["peak_extra_gib"], (recs[name], whole)
        assert recs[name]["tflop"] < whole["tflop"] < ckpt["tflop"]  # dense SDPA: fewer keys per chunk
    print("FIGURE bench_drafter_step " + " | ".join(json.dumps(r) for r in lines))
