"""R1: stop at step 5, resume to step 12: losses and final weights equal an uninterrupted run bitwise."""

from __future__ import annotations

import pytest
import torch
from faultkit import STEPS, figure, losses
from runner import launch
from safetensors.torch import load_file

pytestmark = pytest.mark.faults


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
    figure("R1 stop at 5, resume to 12", equal_loss_steps="6-12", final_weights_equal=True, ledger_equal=True)
