"""The whole pipeline under torchrun: 2 tiny targets + 1 drafter on gloo, metrics read back from W&B."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest
from runner import launch
from wandb_reader import read_wandb_run

pytestmark = pytest.mark.multiproc


def test_two_targets_one_drafter_end_to_end(tmp_path, run_cache):
    run = launch(tmp_path / "run", ["train.max_steps=6", "train.save_every=3"], run_cache)
    assert run.returncode == 0, run.output[-4000:]
    w = read_wandb_run(run.run_dir)
    steps = [row["train/step"] for row in w.history]
    assert steps == [1, 2, 3, 4, 5, 6]
    last = w.history[-1]
    for key in (
        "train/loss",
        "train/loss_ce",
        "train/acc",
        "train/acc_slot_1",
        "train/acc_verifier",
        "train/acc_verifier_slot_1",
        "train/tau_hat",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/step_s",
        "comm/recv_wait_s",
        "mem/peak_gib/rank_2",
    ):
        assert key in last, key
    # each step trains one packet, made by target (step - 1) mod 2: only that target's figures are logged
    for row in w.history:
        t = (int(row["train/step"]) - 1) % 2
        assert f"perf/target_{t}/forward_s" in row and f"mem/peak_gib/rank_{t}" in row
        assert f"perf/target_{1 - t}/forward_s" not in row and f"mem/peak_gib/rank_{1 - t}" not in row
    assert all(row["train/loss"] > 0 for row in w.history) and last["train/tau_hat"] >= 1.0
    assert w.config["topology"]["num_targets"] == 2 and w.config["target"]["name"] == "tiny"
    # one run dir for all ranks: per-rank logs, the resolved config once, checkpoints, the export
    assert {p.name for p in run.run_dir.glob("rank*.log")} == {"rank0.log", "rank1.log", "rank2.log"}
    assert (run.run_dir / "config.yaml").exists()
    assert sorted(p.name for p in (run.run_dir / "checkpoints").glob("step_*")) == [
        "step_00000003",
        "step_00000006",
    ]
    exported = json.loads((run.run_dir / "drafter" / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"]
    # every packet was trained exactly once, in schedule order
    ledger = run.ledger()
    assert [e["step"] for e in ledger] == [1, 2, 3, 4, 5, 6] and [e["packets"] for e in ledger] == [
        [g] for g in range(6)
    ]


def test_numbers_without_wandb(tmp_path, run_cache):
    """logging=disabled: no W&B at all, yet the bar, a line per step in the leader's log, the end
    summary, metrics.jsonl and the curves of python -m dflash.report; files world-readable."""
    run = launch(
        tmp_path / "run", ["train.max_steps=3", "logging=disabled", "logging.progress_bar=true"], run_cache
    )
    assert run.returncode == 0, run.output[-4000:]
    assert "train: 100%" in run.output and "3/3" in run.output  # the progress bar
    log = run.rank_log(2)
    assert all(re.search(rf"step {s}/3  loss [0-9.]+  tau_hat [0-9.]+", log) for s in (1, 2, 3)), log[-2000:]
    assert re.search(r"status +finished: 3 of 3 steps", run.stdout) and "dflash run summary" in log
    assert not (run.run_dir / "wandb").exists()
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/step"] for r in rows] == [1, 2, 3] and all("train/loss" in r for r in rows)
    out = subprocess.run(
        [sys.executable, "-m", "dflash.report", str(run.run_dir)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    page = (run.run_dir / "report.html").read_text()
    assert page.count("<svg") >= 3 and "train/tau_hat" in page and "train/loss" in out.stdout
    mask = os.umask(0)
    os.umask(mask)
    for f in ("drafter/model.safetensors", "checkpoints/step_00000003/model.safetensors", "metrics.jsonl"):
        assert stat.S_IMODE((run.run_dir / f).stat().st_mode) == 0o666 & ~mask, f
