"""A world change that alters the packets per step (2 targets + 1 drafter -> 1 target + 2 drafters) is
refused on resume even with ``train.allow_contract_change=true``, which used to crash every drafter with
``ProtocolError: ... field g expected 12, got 6`` (the targets restart at the checkpoint's next packet,
the drafters expected step x the new packets per step); the refusal names values that resume."""

from __future__ import annotations

import pytest
from runner import launch, no_leftover_processes

from dflash.config import EXIT_USER_ERROR

pytestmark = pytest.mark.faults

QUICK = ["train.max_steps=6", "train.save_every=2", "logging.mode=disabled"]


def test_a_change_of_packets_per_step_is_refused_with_values_that_resume(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    first = launch(run_dir, [*QUICK, "train.stop_after_steps=2"], run_cache)  # 2 targets + 1 drafter
    assert first.returncode == 0, first.output[-3000:]
    split = ["topology.num_targets=1", "topology.num_drafters=2"]
    changed = launch(run_dir, [*QUICK, *split, "train.allow_contract_change=true"], run_cache)
    assert changed.returncode != 0
    out = changed.output
    assert (
        "topology.packets_per_step: saved=1 current=2" in out
        and "even with train.allow_contract_change=true" in out
    )
    assert "topology.num_drafters=1 optim.grad_accum_steps=1" in out
    assert "Traceback" not in out and "ProtocolError" not in out, out[-3000:]
    assert changed.returncodes[1] == EXIT_USER_ERROR, changed.returncodes  # the drafter leader refuses
    resumed = launch(run_dir, [*QUICK, "topology.num_targets=2", "topology.num_drafters=1"], run_cache)
    assert resumed.returncode == 0, resumed.output[-3000:]  # the values the refusal names resume
    assert no_leftover_processes(first, changed, resumed)
