"""R1: stop at step 5, resume to step 12: losses and final weights equal an uninterrupted run bitwise."""

from __future__ import annotations

import json

import pytest
from faultkit import STEPS, assert_continues_reference, figure
from runner import launch

pytestmark = pytest.mark.faults


def test_stop_at_5_resume_to_12_is_bit_exact(tmp_path, run_cache, reference):
    run_dir = tmp_path / "run"
    first = launch(run_dir, [*STEPS, "train.stop_after_steps=5"], run_cache)
    assert first.returncode == 0, first.output[-4000:]
    assert (run_dir / "checkpoints" / "step_00000005" / "COMPLETE").exists()
    with open(run_dir / "ledger.jsonl", "a") as fh:  # a torn last line, as a full disk leaves it
        fh.write('{"step": 6, "packets": [')
    second = launch(run_dir, STEPS, run_cache)
    assert second.returncode == 0, second.output[-4000:]
    log = second.rank_log(2)
    assert "resumed from" in log and "at step 5" in log
    assert (
        "ledger.jsonl: kept 5 records up to step 5; took out 0 later step(s), 1 torn last line, 0 damaged line(s)"
        in log
    )
    assert_continues_reference(second, reference, 5)  # the ledger equals the uninterrupted run's
    steps = [json.loads(line)["train/step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # metrics.jsonl: every step once, the resumed timeline
    figure(
        "R1 stop at 5, resume to 12",
        equal_loss_steps="6-12",
        final_weights_equal=True,
        ledger_equal=True,
        torn_ledger_tail="dropped on resume",
    )
