"""R1: stop at step 5, resume to step 12: losses and final weights equal an uninterrupted run bitwise."""

from __future__ import annotations

import pytest
import torch
from runner import launch
from safetensors.torch import load_file
from wandb_reader import read_history

pytestmark = pytest.mark.faults

STEPS = ["train.max_steps=12", "train.save_every=4"]


def losses(run_dir) -> dict[int, float]:
    out: dict[int, float] = {}
    for row in read_history(run_dir):
        out[int(row["train/step"])] = row["train/loss"]
    return out


@pytest.fixture(scope="session")
def reference(tmp_path_factory, run_cache):
    run = launch(tmp_path_factory.mktemp("ref") / "run", STEPS, run_cache)
    assert run.returncode == 0, run.output[-4000:]
    return run


def test_stop_at_5_resume_to_12_is_bit_exact(tmp_path, run_cache, reference):
    run_dir = tmp_path / "run"
    first = launch(run_dir, [*STEPS, "train.stop_after_steps=5"], run_cache)
    assert first.returncode == 0, first.output[-4000:]
    assert (run_dir / "checkpoints" / "step_00000005" / "COMPLETE").exists()
    second = launch(run_dir, STEPS, run_cache)
    assert second.returncode == 0, second.output[-4000:]
    assert "resumed from" in second.rank_log(2) and "at step 5" in second.rank_log(2)
    ref, got = losses(reference.run_dir), losses(run_dir)
    assert sorted(got) == list(range(1, 13))
    assert [got[s] for s in range(6, 13)] == [ref[s] for s in range(6, 13)]
    a = load_file(str(reference.run_dir / "drafter" / "model.safetensors"))
    b = load_file(str(run_dir / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.ledger() == reference.ledger()  # the same samples in the same steps, none twice
