"""dflash.gpu_check (scripts/gpu_check.py): the parts of it only a GPU run would reach (the CPU dry
run, in tests/multiproc/test_gpu_check_dry_run.py, runs everything else): pytest and bench parsing, the
steady-state figures, the time budget, the judged targets and their table, and the hang guard."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pytest

from dflash.gpu_check.check import Check
from dflash.gpu_check.figures import loss_figures, pytest_counts, step_figures
from dflash.gpu_check.planner import colocated_anchor_cap, find_gpu_spec
from dflash.gpu_check.procs import run_proc
from dflash.gpu_check.table import render


def _check(
    tmp_path: Path, *, dry_run: bool = False, parts: str = "kernels,loss,colocated,split", count: int = 1
):
    args = argparse.Namespace(
        dry_run=dry_run,
        gpu=None,
        out=None,
        parts=parts,
        total_budget=None,
        work_dir=str(tmp_path / "work"),
        keep=False,
        serial=False,
    )
    chk = Check(args)
    chk.device = {"cuda": not dry_run, "count": count, "name": "NVIDIA H200", "torch": "2.13.0"}
    chk.gpu, chk.spec = find_gpu_spec("NVIDIA H200", None)
    chk.plan_budget()
    return chk


def test_pytest_counts_from_the_summary_line():
    out = "....s.\nFAILED tests/gpu/test_cuda.py::test_x - boom\n1 failed, 9 passed, 2 skipped, 1 error in 41.20s\n"
    assert pytest_counts(out) == {"passed": 9, "failed": 1, "skipped": 2, "errors": 1}
    assert pytest_counts("sssss\n11 skipped in 6.21s\n")["skipped"] == 11
    assert pytest_counts("") == {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}


def test_find_gpu_spec_from_the_device_name():
    assert find_gpu_spec("NVIDIA H200", None)[0] == "h200"
    name, spec = find_gpu_spec("NVIDIA H100 80GB HBM3", None)
    assert name == "h100" and spec.bf16_tflops == 989
    assert find_gpu_spec("NVIDIA GeForce RTX 4090", None)[0] == "rtx_4090"
    assert find_gpu_spec("NVIDIA H100 PCIe", None)[0] == "h100_pcie"  # the longest match
    assert find_gpu_spec("Tesla V100-SXM2-32GB", None) == (None, None)
    assert find_gpu_spec("NVIDIA GeForce RTX 4090", "b200")[0] == "b200"


def _case(case, chunk, t, tflops, **kw):
    terms = "ce" if case in ("chunked_ce", "naive_ce", "torch_lce", "limit_ce") else "ce+kl"
    return dict(case=case, terms=terms, chunk=chunk, time_s=t, peak_extra_gb=1.0, gemm_tflops=tflops, **kw)


def test_loss_figures_fraction_of_peak_best_chunk_and_naive_oom():
    oom = (
        '  File "bench_loss.py", line 190, in step | zd = (h_d @ w_head.t()).float() | torch.OutOfMemoryError: '
        "CUDA out of memory. Tried to allocate 18.55 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
        + "x"
        * 400
    )
    recs = [
        _case("limit", 2048, 0.16, 750.0),
        _case("chunked", 2048, 0.21, 580.0, time_vs_limit=1.31),
        _case("chunked", 8192, 0.19, 640.0, time_vs_limit=1.19),
        _case("chunked_ce", 2048, 0.14, 570.0),
        {"case": "naive", "chunk": None, "error": oom},
        _case("naive_ce", None, 1.1, 75.0),
    ]
    res = loss_figures(recs, 989.0)
    assert res["status"] == "passed" and res["naive_oom"] == ["naive"]
    assert res["cases"][4]["error"].startswith("torch.OutOfMemoryError: CUDA out of memory.")
    assert res["best_chunked"]["chunk"] == 8192 and res["best_chunked"]["peak_frac"] == pytest.approx(
        0.6471, abs=1e-4
    )
    lce = "rc=1: ImportError: cannot import name 'LinearCrossEntropyOptions' from 'torch.nn'"
    recs.append({"case": "torch_lce", "chunk": 2048, "error": lce})  # a baseline this torch lacks
    res = loss_figures(recs, 989.0)
    assert res["status"] == "passed" and res["baseline_errors"] == [f"torch_lce@2048: {lce}"]
    recs.append({"case": "chunked_ce", "chunk": 8192, "error": "rc=1: RuntimeError: CUDA error"})
    res = loss_figures(recs, 989.0)
    assert res["status"] == "failed" and res["errors"] == ["chunked_ce@8192: rc=1: RuntimeError: CUDA error"]
    assert loss_figures(recs[:1], 989.0)["status"] == "failed"  # no chunked case ran


def _row(step, step_s, **kw):
    row = {
        "train/step": step,
        "train/loss": 5.0,
        "perf/step_s": step_s,
        "perf/tokens_per_s": 16000 / step_s,
        "perf/samples_per_s": 16 / step_s,
        "train/num_blocks": 2048.0,
        "train/supervised_slots": 30000.0,
        "perf/target_s_per_packet": 0.9,
        "perf/drafter_s_per_packet": step_s - 0.9,
        "perf/target_frac": 0.9 / step_s,
        "perf/phase/target_forward_s": 0.9,
        "perf/phase/drafter_forward_s": 0.3,
        "perf/phase/loss_s": 0.2,
        "perf/phase/backward_s": 0.5,
        "perf/phase/reduce_s": 0.0,
        "perf/phase/optimizer_s": 0.05,
        "mem/peak_gib/rank_0": 80.0 + step,
    }
    row.update(kw)
    return row


def test_step_figures_steady_medians_compile_time_and_packet():
    rows = [_row(1, 50.0), _row(2, 2.2), _row(3, 2.0), _row(4, 1.9), _row(5, 2.0), _row(6, 2.1)]
    f = step_figures(rows, warmup=2, packets_per_step=1)
    assert f["steps"] == 6 and f["steady_steps"] == "3-6"
    assert f["step_s"] == pytest.approx(2.0) and f["compile_s"] == pytest.approx(48.0)
    assert f["samples_per_s"] == pytest.approx(8.0) and f["packet"]["tokens"] == pytest.approx(16000.0)
    assert f["packet"]["blocks"] == 2048.0 and f["peak_mem_gib"] == {"0": 86.0}
    assert f["split_s"] == {
        "target_forward_s": 0.9,
        "drafter_forward_backward_s": 0.8,
        "loss_s": 0.2,
        "optimizer_s": 0.05,
    }
    assert f["busy"]["target_frac"] == pytest.approx(0.45)


def test_budget_one_h200_is_8_minutes_and_unused_time_passes_on(tmp_path, monkeypatch):
    chk = _check(tmp_path)
    assert (
        chk.plan == ["kernels", "loss", "setup", "target_probe", "colocated"] and chk.total_s == 475
    )  # no part split on 1 GPU
    assert chk.timeout("kernels") == pytest.approx(90, abs=1)
    monkeypatch.setattr(chk, "t0", time.perf_counter() - 40)  # part kernels took 40 of its 90 s
    assert chk.timeout("loss") == pytest.approx(110 + 50, abs=1)
    two = _check(tmp_path, count=2)
    assert two.plan[-1] == "split" and two.total_s == 675
    assert _check(tmp_path, dry_run=True).concurrent and not chk.concurrent


def test_judged_targets_and_the_table_of_a_gpu_run(tmp_path):
    chk = _check(tmp_path)
    probe = {
        "tokens": 16384,
        "dtype": "bfloat16",
        "weights_gib": 15.26,
        "logits_gib": 4.64,
        "planner_activations_gib": 2.9,
        "headless": {
            "seconds": 0.8,
            "extra_gib": 3.1,
            "largest_tensor": {"shape": [1, 16384, 20480]},
            "vocab_tensors": 0,
        },
        "full": {
            "seconds": 0.9,
            "extra_gib": 5.0,
            "largest_tensor": {"shape": [1, 16384, 151936]},
            "vocab_tensors": 1,
        },
    }
    chk.results = {
        "kernels": {
            "status": "passed",
            "counts": {"passed": 11, "failed": 0, "skipped": 0, "errors": 0},
            "part_s": 50,
        },
        "loss": {
            "status": "passed",
            "best_chunked": {"chunk": 8192, "tflops": 640.0, "peak_frac": 0.6471},
            "cases": [],
        },
        "colocated": {
            **step_figures([_row(1, 50.0), *(_row(s, 2.0) for s in range(2, 31))], 5, 1),
            "status": "passed",
            "mode": "co-located, 1 rank",
            "backend": "nccl",
            "wall_s": 150.0,
            "steps_requested": 30,
            "recompiles": 0,
            "planner": {
                "gpu_spec": "h200",
                "target_tflop_per_packet": 385.9,
                "drafter_tflop_per_packet": 318.2,
                "target_mfu": 0.43,
                "drafter_mfu": 0.35,
                "memory_gib": {"target": 20.2, "drafter": 75.4, "colocated": 89.9},
                "capacity_gib": 127.3,
                "planner_s_per_packet": {"target": 0.976, "drafter": 0.804, "mfu": 0.4},
                "planner_samples_per_s": 8.99,
            },
            "peak_mem_gib_by_role": {"colocated": 91.2},
            "target_probe": probe,
        },
        "split": {"status": "skipped", "note": "1 GPU: needs 2+", "ran": False},
    }
    out = chk.summary(done=True)
    t = out["targets"]
    assert t["loss_bf16_peak_frac"]["met"] is True and t["drafter_mfu"]["met"] is False
    assert t["target_logits_gib"]["value"] == 0.0 and t["target_logits_gib"]["met"] is True
    assert t["colocated_memory_fits"]["met"] is True
    assert out["passed"] is True  # a missed performance target is reported, not a failure
    table = render(out)
    assert "NOT MET" in table and "vocab-sized tensors 0" in table and "gpu check PASSED" in table
    assert "30/30 steps (steady 6-30)" in table and "compile ~48 s, 0 recompiles" in table
    chk.results["colocated"]["status"] = "failed"
    assert chk.summary(done=True)["passed"] is False


def test_a_part_past_its_budget_is_killed_with_its_children(tmp_path):
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    t0 = time.perf_counter()
    proc = run_proc([sys.executable, "-c", code], 3.0, tmp_path, "hang", dict(os.environ))
    assert proc.timed_out and time.perf_counter() - t0 < 30
    grandchild = int(proc.stdout.split()[0])
    for _ in range(50):  # reaped by init once killed
        stat = Path(f"/proc/{grandchild}/stat")
        if not stat.exists() or stat.read_text().split(")")[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {grandchild} survived the budget")


def test_the_colocated_part_trains_at_the_largest_cap_that_fits_the_gpu():
    """The shipped Qwen3-8B experiment (8,192 anchors per packet) fits a co-located H200 with
    checkpointing, not an H100: on an H100 the check trains at the planner's largest cap instead of
    running out of memory, and says so."""
    caps = {}
    for gpu in ("h100", "h200"):
        _, spec = find_gpu_spec(None, gpu)
        caps[gpu] = colocated_anchor_cap(["experiment=qwen3_8b_8gpu", "data.path=embedded"], spec)
    assert caps["h200"] == (8192, 8192)
    cap, shipped = caps["h100"]
    assert shipped == 8192 and 4096 <= cap < 8192 and cap % 64 == 0
