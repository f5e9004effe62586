"""``python scripts/gpu_check.py --dry-run``: every part of the GPU check runs on CPU at tiny sizes
(pytest -m gpu, the loss benchmark, the target probe and a co-located run, a co-located hybrid target,
and over gloo 1 target + 1 drafter, 1 TP=2 target replica + 1 drafter, 1 target + 2 drafters with the
bucketed all-reduce and with FSDP2, 2 targets + 1 drafter, and a run stopped by SIGTERM with W&B
offline and resumed) and ends with one JSON line, so the GPU script cannot rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from runner import env_for
from testpaths import REPO

from dflash.gpu_check.profiles import PARTS

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.extended]


def test_dry_run_exercises_every_part_and_prints_one_json_line(tmp_path, run_cache):
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env_for(run_cache), capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["dry_run"] is True and summary["passed"] is True
    assert "copied from" in summary["setup"]["tokenizer"]  # the cached tiny target's: nothing rebuilt
    parts = summary["parts"]
    assert list(parts) == list(PARTS)
    assert all(p["ran"] for p in parts.values())

    a = parts["kernels"]  # every CUDA test collected and skipped
    assert a["status"] == "skipped" and a["counts"]["skipped"] >= 10 and a["counts"]["failed"] == 0

    _check_loss_part(parts["loss"])
    _check_training_parts(parts, summary["setup"]["token_budget"])

    probe = parts["colocated"]["target_probe"]  # the headless forward makes no logits; model(...) does
    assert probe["status"] == "passed" and probe["headless"]["vocab_tensors"] == 0
    assert probe["full"]["vocab_tensor_shapes"] == [[1, 640, 2112]]

    targets = summary["targets"]
    assert targets["target_logits_gib"] == {**targets["target_logits_gib"], "value": 0.0, "met": True}
    assert [t["met"] for k, t in targets.items() if k != "target_logits_gib"] == [None, None, None]
    _check_stop_and_resume(parts["sigterm"])
    table = proc.stdout
    assert "gpu check PASSED" in table and "1 target + 1 drafter (gloo)" in table
    assert "1 target replica of 2 ranks (TP) + 1 drafter (gloo)" in table
    assert "linear attention ran: torch delta rule one document at a time" in table
    print(
        f"FIGURE gpu_check dry run: {seconds:.1f} s wall, parts {[(k, v['part_s']) for k, v in parts.items()]}"
    )


POSITION = ("per_row", "per_position", "per_row_ce", "per_position_ce")


def _check_loss_part(b: dict) -> None:
    """Part loss: every case ran, and every case computed the loss of the naive case of its terms."""
    assert b["status"] == "passed"
    assert {(c["case"], c["chunk"]) for c in b["cases"]} == {
        *(
            (case, chunk)
            for case in (
                "limit",
                "limit_ce",
                "chunked",
                "chunked_ce",
                "chunked_dpace",
                "torch_lce",
                *POSITION,
            )
            for chunk in (64, 256)
        ),
        ("naive", None),
        ("naive_ce", None),
    }
    assert all(c["time_s"] > 0 and c["tflops"] is not None for c in b["cases"])
    # every case computed the loss and gradient of the naive case of its terms (same seeded inputs);
    # D-PACE weighs the slots otherwise: its two chunk sizes agree with each other
    naive = {c["terms"]: c for c in b["cases"] if c["case"] in ("naive", "naive_ce")}
    dpace = [c for c in b["cases"] if c["case"] == "chunked_dpace"]
    assert dpace[0]["loss"] == pytest.approx(dpace[1]["loss"], rel=1e-5)
    assert dpace[0]["loss"] != pytest.approx(naive["ce"]["loss"], rel=1e-3)
    # the verifier once per position equals it once per row on the same rows of real blocks
    by = {(c["case"], c["chunk"]): c for c in b["cases"]}
    for c in b["cases"]:
        if c["case"].startswith("per_position"):
            ref = by[(c["case"].replace("per_position", "per_row"), c["chunk"])]
            assert c["loss"] == pytest.approx(ref["loss"], rel=1e-5), c
            assert c["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), c
    for c in b["cases"]:
        if not c["case"].startswith(("limit", "per_")) and c["case"] != "chunked_dpace":
            ref = naive[c["terms"]]
            assert c["loss"] == pytest.approx(ref["loss"], rel=1e-5), c
            assert c["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), c
    best = b["best_chunked"]
    assert best["time_s"] == min(c["time_s"] for c in b["cases"] if c["case"] == "chunked")
    assert best["time_vs_naive"] == round(best["time_s"] / naive["ce+kl"]["time_s"], 4)
    lce = [c for c in b["cases"] if c["case"] == "torch_lce" and c["chunk"] == b["best_chunked_ce"]["chunk"]]
    assert b["best_chunked_ce"]["time_vs_torch_lce"] == round(
        b["best_chunked_ce"]["time_s"] / lce[0]["time_s"], 4
    )


def _check_training_parts(parts: dict, token_budget: int) -> None:
    """The training parts: the steady-state figures, the planner's on the measured packet, and what
    must be equal between runs that train the same packets from the same seed."""
    ranks = {"colocated": 1, "hybrid": 1, "split": 2, "tp": 2, "allreduce": 3, "fsdp": 3, "two_targets": 3}
    for name, nranks in ranks.items():  # tp: its sender's and the drafter's
        r = parts[name]
        assert r["status"] == "passed" and r["steps"] == r["steps_requested"] == 4, (name, r)
        assert r["samples_per_s"] > 0 and r["tokens_per_s"] > 0 and r["first_step_s"] > 0
        assert r["packet"]["seqs"] == 4 and 0 < r["packet"]["tokens"] <= token_budget  # per packet
        assert r["packet"]["blocks"] > 0
        assert r["split_s"]["drafter_forward_backward_s"] > 0 and r["split_s"]["loss_s"] > 0
        assert len(r["peak_mem_gib"]) == nranks and r["recompiles"] == 0
        p = r["planner"]
        assert p["target_tflop_per_packet"] > 0 and p["drafter_tflop_per_packet"] > 0
        assert p["target_mfu"] > 0 and p["drafter_mfu"] > 0
        t_plan, d_plan = p["planner_s_per_packet"]["target"], p["planner_s_per_packet"]["drafter"]
        if nranks == 1:  # one rank does both in turn
            packets_per_s = 1 / (t_plan + d_plan)
        else:  # N targets, M drafters: the slower side
            n, m = (2, 1) if name == "two_targets" else (1, 2) if name in ("allreduce", "fsdp") else (1, 1)
            packets_per_s = min(n / t_plan, m / d_plan)
        assert p["planner_samples_per_s"] == pytest.approx(r["packet"]["seqs"] * packets_per_s, rel=1e-3)
    c, d, two = parts["colocated"], parts["split"], parts["two_targets"]
    # co-located (1 rank), 1 target + 1 drafter and 2 targets + 1 drafter train the same packets from
    # the same seed (packet g from target g mod N): equal losses, and the planner prices the same
    # packet the same way
    assert c["final_loss"] == d["final_loss"] == two["final_loss"] and c["packet"] == d["packet"], (c, d)
    for k in ("target_tflop_per_packet", "drafter_tflop_per_packet"):
        assert c["planner"][k] == d["planner"][k]
    assert "target_forward" in parts["colocated"]["phases_s"] and "recv_wait" in parts["split"]["phases_s"]
    assert set(parts["split"]["peak_mem_gib_by_role"]) == {"target", "drafter"}
    assert parts["split"]["gpus"] == "CPU (gloo)"
    tp = parts["tp"]  # a replica's rank computes part of the target's FLOPs and holds part of it
    assert set(tp["peak_mem_gib"]) == {"0", "2"} and set(tp["peak_mem_gib_by_role"]) == {"target", "drafter"}
    p = tp["planner"]
    assert 0 < p["target_rank_tflop_per_packet"] < p["target_tflop_per_packet"]
    assert 0 < p["memory_gib"]["target_rank"] < p["memory_gib"]["target"]
    assert "topology.target_tp=2" in tp["command"] and tp["command"].startswith(
        "torchrun --standalone --nproc_per_node 3"
    )
    # 2 drafters: one step is both drafters' packets; the bucketed all-reduce and FSDP2 apply the
    # same update (the replicas compared every 2 steps; FSDP2's state a shard per drafter)
    a, f = parts["allreduce"], parts["fsdp"]
    assert "drafter.shard=none" in a["command"] and "drafter.shard=full" in f["command"]
    assert a["replicas"].startswith("equal") and a["phases_s"]["reduce"] > 0 and f["phases_s"]["reduce"] > 0
    assert a["final_loss"] == pytest.approx(f["final_loss"], rel=1e-5)
    assert (
        a["planner"]["allreduce_s"] > 0
        and f["planner"]["memory_gib"]["drafter"] < a["planner"]["memory_gib"]["drafter"]
    )
    h = parts["hybrid"]  # Gated DeltaNet layers on CPU: the torch fallback, one document at a time
    assert h["target"].startswith("qwen3_5_text: 8 layers (6 linear attention)")
    assert h["linear_attention"].startswith("torch delta rule one document at a time")
    assert h["planner"]["target_tflop_per_packet"] != c["planner"]["target_tflop_per_packet"]


def _check_stop_and_resume(s: dict) -> None:
    """Part sigterm: SIGTERM to torchrun after step 2 of 8; a complete checkpoint at the step the run
    stopped at, torchrun's exit code after a forwarded signal; the relaunch resumed there and trained
    every later step once; one W&B offline run per launch, of one run id."""
    assert s["status"] == "passed", s
    k = s["stopped_at_step"]
    assert 2 <= k < 8 and s["resumed_at_step"] == k and s["checkpoint_gib"] > 0
    assert s["torchrun_exit"] == 1 and s["resume_exit"] == 0 and s["steps"] == 8
    assert s["ledger_steps"] == "1-8, 8 records"
    assert len(s["wandb"]) == 2 and len({w.rsplit("-", 1)[1] for w in s["wandb"]}) == 1
    assert "logging=offline" in s["command"] and "train.save_weights=true" in s["command"]
