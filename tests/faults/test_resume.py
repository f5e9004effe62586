"""R1: stop at step 5, resume to step 12: losses and final weights equal an uninterrupted run bitwise."""

from __future__ import annotations

import pytest
from faultkit import STEPS, assert_continues_reference, figure
from runner import launch

pytestmark = pytest.mark.faults


def test_stop_at_5_resume_to_12_is_bit_exact(tmp_path, run_cache, reference):
    run_dir = tmp_path / "run"
    first = launch(run_dir, [*STEPS, "train.stop_after_steps=5"], run_cache)
    assert first.returncode == 0, first.output[-4000:]
    assert (run_dir / "checkpoints" / "step_00000005" / "COMPLETE").exists()
    second = launch(run_dir, STEPS, run_cache)
    assert second.returncode == 0, second.output[-4000:]
    assert "resumed from" in second.rank_log(2) and "at step 5" in second.rank_log(2)
    assert_continues_reference(second, reference, 5)
    figure("R1 stop at 5, resume to 12", equal_loss_steps="6-12", final_weights_equal=True, ledger_equal=True)
