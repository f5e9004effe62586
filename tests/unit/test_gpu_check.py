"""dflash.gpu_check (scripts/gpu_check.py): the parts of it only a GPU run would reach (the CPU dry
run, in tests/multiproc/test_gpu_check_dry_run.py, runs everything else): pytest and bench parsing, the
steady-state figures, the time budget and the parts a host's GPU count skips, the judged targets and
their table, the hang guard, the GPU pair of part split (``nvidia-smi topo -m``) and part sigterm's
verdict on a stop and a resume that went wrong."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pytest

from dflash.gpu_check.check import Check, merged
from dflash.gpu_check.figures import loss_figures, pytest_counts, step_figures
from dflash.gpu_check.planner import colocated_anchor_cap, find_gpu_spec
from dflash.gpu_check.procs import Proc, run_proc
from dflash.gpu_check.profiles import PARTS
from dflash.gpu_check.stop import judge_resume, judge_stop
from dflash.gpu_check.table import render
from dflash.gpu_check.topo import farthest_pair, parse_topology


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


def test_budget_one_h200_is_10_minutes_and_unused_time_passes_on(tmp_path, monkeypatch):
    every = ",".join(PARTS)
    chk = _check(tmp_path, parts=every)
    # on 1 GPU the parts of 2+ ranks are skipped (NCCL holds one rank per GPU): 595 s, 10 minutes
    assert (
        chk.plan == ["kernels", "loss", "setup", "target_probe", "colocated", "hybrid"] and chk.total_s == 595
    )
    monkeypatch.setattr(chk, "t0", time.perf_counter())  # the first part starts now
    assert chk.timeout("kernels") == pytest.approx(90, abs=1)
    monkeypatch.setattr(chk, "t0", time.perf_counter() - 40)  # part kernels took 40 of its 90 s
    assert chk.timeout("loss") == pytest.approx(110 + 50, abs=1)
    assert (
        "skipped (1 GPU, NCCL needs one per rank): split (2), tp (3), allreduce (3), fsdp (3), two_targets (3), sigterm (2)"
        in chk.header()
    )
    assert chk.part_allreduce() == {"status": "skipped", "note": "1 GPU: needs 3+", "ran": False}
    assert chk.part_sigterm()["note"] == "1 GPU: needs 2+"
    two = _check(tmp_path, count=2, parts=every)
    assert two.plan[-3:] == ["hybrid", "split", "sigterm"] and two.total_s == 595 + 200 + 300
    eight = _check(tmp_path, count=8, parts=every)
    assert eight.plan[4:] == ["colocated", *PARTS[3:]] and eight.total_s == 595 + 500 + 200 + 3 * 180
    assert _check(tmp_path, dry_run=True).concurrent and not chk.concurrent


def test_a_part_override_replaces_the_base_one_of_its_key():
    base = ["experiment=x", "logging=disabled", "logging.progress_bar=false", "train.save_weights=false"]
    assert merged(base, ["logging=offline", "train.save_weights=true"]) == [
        "experiment=x",
        "logging.progress_bar=false",
        "logging=offline",
        "train.save_weights=true",
    ]


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


def _topology(n: int, cell, nics: int = 1) -> str:
    """``nvidia-smi topo -m``'s matrix for ``n`` GPUs (``cell(i, j)``) and ``nics`` NICs, with its
    affinity columns and legend."""
    cols = [f"GPU{i}" for i in range(n)] + [f"NIC{i}" for i in range(nics)]
    lines = ["\t" + "\t".join(cols) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    for i in range(n):
        cells = [" X " if i == j else cell(min(i, j), max(i, j)) for j in range(n)] + ["PIX"] * nics
        lines.append(
            f"GPU{i}\t" + "\t".join(cells) + f"\t{0 if i < n // 2 else 48}-47\t{int(i >= n // 2)}\t\tN/A"
        )
    lines += [f"NIC{k}\t" + "\t".join(["PIX"] * n + [" X "]) for k in range(nics)]
    return (
        "\n".join(lines)
        + "\n\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect\n"
    )


def _pcie(i: int, j: int) -> str:
    """8 PCIe GPUs: 0-3 on NUMA node 0, 4-7 on node 1, pairs (0,1), (2,3), ... behind one switch."""
    if (i < 4) != (j < 4):
        return "SYS"
    return "PIX" if i // 2 == j // 2 else "NODE"


def test_part_split_runs_on_the_gpu_pair_farthest_apart():
    pcie = _topology(8, _pcie)
    assert parse_topology(pcie)[(0, 7)] == "SYS" and parse_topology(pcie)[(4, 5)] == "PIX"
    assert len(parse_topology(pcie)) == 28  # GPU pairs only: no NIC, no affinity column
    assert farthest_pair(8, None, pcie) == (
        ("0", "7"),
        "SYS, across NUMA nodes (PCIe + the CPUs' interconnect): the farthest pair",
    )
    # the user's CUDA_VISIBLE_DEVICES: the farthest pair among those GPUs (4-7 share NUMA node 1)
    assert farthest_pair(3, "4,5,6", pcie) == (
        ("4", "6"),
        "NODE, across PCIe host bridges of one NUMA node: the farthest pair",
    )
    nvswitch = _topology(8, lambda i, j: "NV18", nics=2)
    assert farthest_pair(8, None, nvswitch) == (("0", "7"), "NV18, NVLink x18: every pair alike")
    # the first and last GPU share a switch: another pair is farther
    odd = _topology(4, lambda i, j: "PIX" if (i, j) == (0, 3) else "SYS")
    assert farthest_pair(4, None, odd)[0] == ("0", "1")
    assert farthest_pair(4, None, None) == (
        ("0", "3"),
        "the first and last GPU (nvidia-smi topo -m unreadable)",
    )
    assert farthest_pair(2, "GPU-1f2e,GPU-9a8b", pcie)[0] == ("GPU-1f2e", "GPU-9a8b")


def _stopped_run(run_dir: Path, steps: int, stopped: int, complete: bool = True) -> None:
    """What a 1 target + 1 drafter run stopped by SIGTERM at step ``stopped`` of ``steps`` leaves."""
    run_dir.mkdir(parents=True)
    (run_dir / "ledger.jsonl").write_text(
        "".join(f'{{"packets": [{s - 1}], "sample_ids": [1], "step": {s}}}\n' for s in range(1, stopped + 1))
    )
    ckpt = run_dir / "checkpoints" / f"step_{stopped:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"x" * 1024)
    if complete:
        (ckpt / "COMPLETE").write_text("{}")
    (run_dir / "rank1.log").write_text(
        "[2026-12-04 14:37:25,281][dflash.train.trainer][WARNING] drafter rank 1: got SIGTERM\n"
        f"saved checkpoint {ckpt} in 0.16s\n"
        f"status         stopped at step {stopped} of {steps} (SIGTERM); relaunch the same command to resume\n"
    )
    _wandb_run(run_dir, "20261204_143717", "29sle0df")


def _wandb_run(run_dir: Path, when: str, run_id: str) -> None:
    d = run_dir / "wandb" / f"offline-run-{when}-{run_id}"
    d.mkdir(parents=True)
    (d / f"run-{run_id}.wandb").write_bytes(b"records")


TORCHRUN_SIGNALLED = (
    "torch.distributed.elastic.multiprocessing.api.SignalException: Process 13660 got signal: 15\n"
)


def test_part_sigterm_passes_a_clean_stop_and_resume_and_names_what_went_wrong(tmp_path):
    run = tmp_path / "run"
    _stopped_run(run, steps=8, stopped=3)
    first = Proc(1, 70.0, "", TORCHRUN_SIGNALLED, signalled_s=64.7)
    res = judge_stop(run, first, steps=8, at=2, drafter_rank=1)
    assert res["problems"] == [] and res["stopped_at_step"] == 3 and res["save_s"] == 0.16
    assert res["stopped_in_s"] == pytest.approx(5.3) and res["checkpoint_gib"] == pytest.approx(0.0, abs=1e-5)
    log_from = len((run / "rank1.log").read_text())
    with open(run / "rank1.log", "a") as f:
        f.write(f"resumed from {run}/checkpoints/step_00000003 at step 3 (packet 3)\n")
    with open(run / "ledger.jsonl", "a") as f:
        f.write("".join(f'{{"packets": [{s - 1}], "sample_ids": [1], "step": {s}}}\n' for s in range(4, 9)))
    _wandb_run(run, "20261204_143815", "29sle0df")
    resumed = judge_resume(run, Proc(0, 60.0, "", ""), 3, 8, 1, 1, log_from)
    assert resumed["problems"] == [] and resumed["ledger_steps"] == "1-8, 8 records"

    # what a bad stop looks like: the run finished first, torchrun SIGKILLed the saving drafter
    # after its grace, the checkpoint never completed
    assert "before its ledger reached step 2" in judge_stop(run, Proc(0, 9.0, "", ""), 8, 2, 1)["problems"][0]
    assert judge_stop(run, first, 8, 2, 1)["problems"] == [  # a second launch's W&B run: not one stop
        "W&B offline runs after the stop: ['offline-run-20261204_143717-29sle0df', "
        "'offline-run-20261204_143815-29sle0df'], expected one"
    ]
    killed = (
        TORCHRUN_SIGNALLED
        + "Unable to shutdown process 14572 via Signals.SIGTERM, forcefully exiting via Signals.SIGKILL\n"
    )
    fresh = tmp_path / "fresh"
    _stopped_run(fresh, steps=8, stopped=3)
    problems = judge_stop(fresh, Proc(1, 100.0, "", killed, signalled_s=60.0), 8, 2, 1)["problems"]
    assert problems == [
        "torchrun SIGKILLed a worker 40.0 s after forwarding SIGTERM (its grace: --shutdown-timeout or "
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s): the stop outlasted it"
    ]
    torn = tmp_path / "torn"
    _stopped_run(torn, steps=8, stopped=3, complete=False)
    assert judge_stop(torn, first, 8, 2, 1)["problems"] == [
        "no complete checkpoint of step 3 (complete: none)"
    ]

    # a relaunch that started over (every step twice from step 1), and one that logged to a new W&B run
    again = tmp_path / "again"
    _stopped_run(again, steps=8, stopped=3)
    with open(again / "ledger.jsonl", "a") as f:
        f.write("".join(f'{{"packets": [{s - 1}], "sample_ids": [1], "step": {s}}}\n' for s in range(1, 9)))
    _wandb_run(again, "20261204_143815", "7fq2kd0a")
    problems = judge_resume(again, Proc(0, 60.0, "", ""), 3, 8, 1, 1, 0)["problems"]
    assert problems[0] == "the relaunch resumed at step None, not 3"
    assert problems[1].startswith("ledger steps [1, 2, 3, 1, 2,") and problems[1].endswith(
        "expected 1-8 once each"
    )
    assert problems[2].startswith(
        "W&B offline runs ['offline-run-20261204_143717-29sle0df', 'offline-run-20261204_143815-7fq2kd0a']"
    )
