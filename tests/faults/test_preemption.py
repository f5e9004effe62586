"""R9: SIGTERM to the job at a random step, like a preemption: every rank stops at one step boundary,
a complete checkpoint exists, every worker exits within 30 s (the targets 0, the drafter
``EXIT_STOPPED``: the run is unfinished), and resuming continues exactly.

The first launch is a real torchrun (``runner.launch(torchrun=True)``), whose process group gets
the signal. torchrun starts each worker in a session of its
own and forwards the SIGTERM to them (torch/distributed/elastic/multiprocessing/api.py ``_close``),
then, by design, re-raises its own ``SignalException`` (agent/server/api.py ``run``,
launcher/api.py keeps the rendezvous open for an elastic restart): torchrun itself exits 1 however
cleanly the workers end. The workers' own exit codes are recorded by tests/rank_exit.py; the
torchrun code is checked to be exactly that documented 1. The resuming launch is in-process.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from faultkit import STEPS, figure, losses, resumed_step
from runner import launch, ledger_steps, no_leftover_processes

from dflash.config import EXIT_STOPPED
from dflash.train.checkpoint import load_checkpoint

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def test_sigterm_at_a_random_step_checkpoints_and_resumes_exactly(tmp_path, run_cache, reference):
    seed = int(os.environ.get("DFLASH_FAULT_SEED", time.time_ns() % 1_000_000))
    at = random.Random(seed).randint(3, 7)  # the stop lands a step or two later, before 12
    run_dir = tmp_path / "run"
    first = launch(
        run_dir, STEPS, run_cache, torchrun=True, record_exits=True, signal_at_step=(at, signal.SIGTERM)
    )
    assert first.signalled_after is not None, first.output[-3000:]
    stopped = ledger_steps(run_dir)
    assert at <= stopped < 12, f"seed {seed}: signalled after step {at}, stopped at {stopped}"
    ckpt = run_dir / "checkpoints" / f"step_{stopped:08d}"
    assert (ckpt / "COMPLETE").exists() and load_checkpoint(ckpt).step == stopped
    exits = first.exits()
    signalled = first.started_at + first.signalled_after
    assert sorted(exits) == [(0, 0), (1, 0), (2, 0)]
    assert [exits[(r, 0)]["returncode"] for r in range(3)] == [0, 0, EXIT_STOPPED], exits
    exit_s = max(e["end"] for e in exits.values()) - signalled
    assert exit_s <= 30
    # torchrun's own, documented exit code after a SIGTERM (see the module docstring)
    assert (
        first.returncode == 1
        and "SignalException: Process" in first.stderr
        and "got signal: 15" in first.stderr
    )

    second = launch(run_dir, STEPS, run_cache)
    assert second.returncode == 0, second.output[-4000:]
    assert resumed_step(second.rank_log(2)) == stopped
    ref, got = losses(reference.run_dir), losses(run_dir)
    assert sorted(got) == list(range(1, 13))
    assert [got[s] for s in range(stopped + 1, 13)] == [ref[s] for s in range(stopped + 1, 13)]
    assert second.ledger() == reference.ledger()
    figure(
        "R9 SIGTERM (preemption)",
        seed=seed,
        signalled_after_step=at,
        checkpoint_step=stopped,
        worker_exit_codes=[exits[(r, 0)]["returncode"] for r in range(3)],
        workers_exit_after_signal_s=round(exit_s, 1),
        torchrun_exit=first.returncode,
        equal_loss_steps=f"{stopped + 1}-12",
    )
    assert no_leftover_processes(first, second)
