"""The whole pipeline under torchrun: 2 tiny targets + 1 drafter on gloo, metrics read back from W&B."""

from __future__ import annotations

import json

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
        "perf/target_0/forward_s",
        "perf/target_1/forward_s",
        "mem/peak_gib/rank_0",
        "mem/peak_gib/rank_1",
        "mem/peak_gib/rank_2",
    ):
        assert key in last, key
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
