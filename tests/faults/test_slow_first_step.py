"""R: a drafter whose first step outlasts 2 x ``topology.step_timeout_s`` after it has received and
ACKed that step's packets (a first step that compiles does) is waited for: a target keeps
``topology.init_timeout_s`` until the drafter's ACKs say it has finished a step, then waits twice
``step_timeout_s``."""

from __future__ import annotations

import pytest
from faultkit import figure, log_time
from runner import launch, ledger_steps, no_leftover_processes

pytestmark = pytest.mark.faults

STEP_TIMEOUT_S = 3
SLOW_S = 8  # > 2 x STEP_TIMEOUT_S: what a target waits for a drafter once its first step is over


@pytest.mark.slow  # one launch with an 8 s stall
def test_slow_first_step_is_waited_for(tmp_path, run_cache):
    run = launch(
        tmp_path / "run",
        [
            "train.max_steps=8",
            "logging.mode=disabled",
            f"topology.step_timeout_s={STEP_TIMEOUT_S}",
            "fault.slow_rank=2",
            "fault.slow_at_step=1",
            f"fault.slow_s={SLOW_S}",
        ],
        run_cache,
    )
    assert run.returncode == 0, run.output[-4000:]
    drafter = run.rank_log(2)
    stalled = log_time(drafter, f"spends {SLOW_S:g}s more in step 1")
    assert stalled is not None, drafter[-2000:]
    assert ledger_steps(run.run_dir) == 8
    relaxed = log_time(
        run.rank_log(0),
        f"drafter 0 (rank 2) finished a step: target 0 (rank 0) waits at most {2 * STEP_TIMEOUT_S}s",
    )
    assert relaxed is not None and relaxed > stalled + SLOW_S - 1, run.rank_log(0)[-2000:]
    assert all("PeerError" not in run.rank_log(r) for r in range(3))
    figure(
        "slow first step",
        step_timeout_s=STEP_TIMEOUT_S,
        first_step_extra_s=SLOW_S,
        target_relaxed_after_stall_s=round(relaxed - stalled, 1),
        exit_code=run.returncode,
        steps=ledger_steps(run.run_dir),
        total_s=round(run.seconds, 1),
    )
    assert no_leftover_processes(run)
