"""M drafters are equal data-parallel peers.

2 targets + 2 drafters against 2 targets + 1 drafter with ``optim.grad_accum_steps=2`` over the same
packets (with two samples whose hidden states the targets find non-finite): identical weights,
identical ledgers (every step lists the same packets and samples, from every drafter), identical
skip counts. And the periodic replica check names the step and the drafter whose weights drifted.
"""

from __future__ import annotations

import pytest
import torch
from faultkit import figure
from runner import launch
from safetensors.torch import load_file
from wandb_reader import read_history

pytestmark = pytest.mark.multiproc


def test_two_drafters_equal_one_drafter_with_accumulation(tmp_path, run_cache):
    common = ["train.max_steps=6", "fault.nonfinite_sample_ids=[3,11]", "train.check_replicas_every=2"]
    two = launch(tmp_path / "two", [*common, "topology.num_drafters=2"], run_cache, nproc=4, timeout=400)
    one = launch(tmp_path / "one", [*common, "optim.grad_accum_steps=2"], run_cache, nproc=3, timeout=400)
    assert two.returncode == 0 and one.returncode == 0, (two.output[-3000:], one.output[-3000:])
    a = load_file(str(two.run_dir / "drafter" / "model.safetensors"))
    b = load_file(str(one.run_dir / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert two.ledger() == one.ledger() and [e["packets"] for e in two.ledger()][0] == [0, 1]
    h2, h1 = read_history(two.run_dir)[-1], read_history(one.run_dir)[-1]
    skips = {k: v for k, v in h1.items() if k.startswith("data/skipped/")}
    assert skips and {k: h2[k] for k in skips} == skips and skips["data/skipped/nonfinite_hidden"] > 0
    assert (
        h2["train/loss"] == h1["train/loss"] and "perf/drafter_busy_frac" in h2 and "perf/samples_per_s" in h2
    )
    figure("2 drafters vs 1 x accum 2", weights_equal=True, ledger_equal=True, skips=skips)


def test_drifting_replica_is_named(tmp_path, run_cache):
    run = launch(
        tmp_path / "run",
        [
            "train.max_steps=6",
            "topology.num_drafters=2",
            "train.check_replicas_every=2",
            "fault.perturb_rank=3",
            "fault.perturb_at_step=3",
            "logging.mode=disabled",
        ],
        run_cache,
        nproc=4,
        timeout=300,
    )
    assert run.returncode != 0
    log = run.rank_log(2)
    assert "drafter replicas diverged at step 4: drafter 1 (rank 3) differs from drafter 0 (rank 2)" in log, (
        log[-3000:]
    )
    figure("replica check", error="diverged at step 4: drafter 1 (rank 3) differs from drafter 0 (rank 2)")
