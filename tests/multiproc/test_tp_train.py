"""The training job with tensor-parallel target replicas (``topology.target_tp=2``) on gloo: launches
of the fast test run (tests/runner.py, in-process ranks with torchrun's environment).

2 replicas of 2 ranks + 1 drafter (5 processes) train the same losses as 2 single-rank targets + 1
drafter (3 processes): the sharded forwards give the hidden states of the whole target up to fp32
rounding, the schedule and the ledger are the same, and such a run resumes on single-rank targets.
A killed rank of a replica (not its sender) is named by the sender's failed collective and the job
ends non-zero; a stop signal to it stops the run after a step, with a checkpoint.
"""

from __future__ import annotations

import json
import re

import pytest
from runner import launch, ledger_steps, no_leftover_processes

from dflash.config import EXIT_STOPPED

pytestmark = pytest.mark.multiproc

STEPS = 10
PLAN = 12
COMMON = [f"train.max_steps={PLAN}", "train.log_every=1", "logging.mode=disabled"]
TP2 = "topology.target_tp=2"


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_steps(a_rows: list[dict], b_rows: list[dict]) -> float:
    """The rows agree step by step (fp32: 1e-5); returns the largest loss difference."""
    assert [r["train/step"] for r in a_rows] == [r["train/step"] for r in b_rows]
    for a, b in zip(a_rows, b_rows, strict=True):
        for key in ("train/loss", "train/loss_ce", "train/acc", "train/tau_hat"):
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=0), (a["train/step"], key, a[key], b[key])
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    return max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(a_rows, b_rows, strict=True))


@pytest.mark.slow  # three launches (5, 3 and 3 ranks)
def test_tp_replicas_train_the_losses_of_single_rank_targets(tmp_path, run_cache):
    """2x2:1 for 10 steps of a 12-step run equals 2:1 (fp32, 1e-5); resumed with single-rank targets
    (``target_tp`` is free in the run contract) it continues the straight 2:1 run."""
    tp = launch(tmp_path / "tp", [*COMMON, TP2, f"train.stop_after_steps={STEPS}"], run_cache, nproc=5)
    assert tp.returncode == 0, tp.output[-4000:]
    whole = launch(tmp_path / "whole", COMMON, run_cache, nproc=3)
    assert whole.returncode == 0, whole.output[-4000:]
    tp_rows, whole_rows = _rows(tp), _rows(whole)
    assert [r["train/step"] for r in tp_rows] == list(range(1, STEPS + 1))
    diff = _assert_same_steps(tp_rows, whole_rows[:STEPS])
    assert tp.ledger() == whole.ledger()[:STEPS]
    # packet g comes from replica g mod 2, sent by its first rank (0 or 2); the others only forward
    for row in tp_rows:
        t = (int(row["train/step"]) - 1) % 2
        assert f"perf/target_{t}/forward_s" in row and f"mem/peak_gib/rank_{2 * t}" in row
        assert "mem/peak_gib/rank_1" not in row and "mem/peak_gib/rank_4" in row
    done = {}  # every rank of a replica ran each of its packets (a replica may work ahead of the stop)
    for rank, what in ((0, "sent"), (1, "forwarded"), (2, "sent"), (3, "forwarded")):
        name = f"target replica {rank // 2}, TP rank {rank % 2} (rank {rank})"
        found = re.search(rf"{re.escape(name)} done: (\d+) packets {what}", tp.rank_log(rank))
        assert found, tp.rank_log(rank)[-2000:]
        done[rank] = int(found[1])
    assert done[0] == done[1] >= STEPS // 2 and done[2] == done[3] >= STEPS // 2, done
    assert "tensor parallel over 2 ranks" in tp.rank_log(1)
    # the balance line prices splits in replicas of 2 ranks (which split is best depends on the timings)
    drafter_log = tp.rank_log(4)
    assert re.search(r"balance .*\d target replicas? x 2 ranks \+ \d drafters?", drafter_log), drafter_log

    resumed = launch(tmp_path / "tp", COMMON, run_cache, nproc=3)  # the same run on 2 single-rank targets
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"at step {STEPS}" in resumed.rank_log(2)
    resumed_diff = _assert_same_steps(_rows(resumed)[STEPS:], whole_rows[STEPS:])
    assert resumed.ledger() == whole.ledger()
    print(
        f"FIGURE 2x2:1 vs 2:1, fp32: max |loss difference| {diff:.3g} over steps 1-{STEPS}, "
        f"{resumed_diff:.3g} over steps {STEPS + 1}-{PLAN} resumed on 2:1; "
        f"{tp.seconds:.1f} s / {whole.seconds:.1f} s / {resumed.seconds:.1f} s"
    )


@pytest.mark.faults
def test_a_killed_tp_rank_is_named_and_ends_the_job(tmp_path, run_cache):
    """SIGKILL rank 1 (replica 0's second rank) at its first packet of step >= 3: rank 0's next
    collective with it fails, and its PeerError names rank 1."""
    run = launch(
        tmp_path / "run",
        [*COMMON, TP2, "train.save_weights=false", "fault.kill_rank=1", "fault.kill_at_step=3"],
        run_cache,
        nproc=5,
    )
    assert run.returncode != 0
    assert run.exits()[(1, 0)]["returncode"] == -9
    log = run.rank_log(0)
    err = [ln for ln in log.splitlines() if ln.startswith("dflash.distributed.links.PeerError")]
    assert err, log[-3000:]
    assert err[-1].startswith("dflash.distributed.links.PeerError: target replica 0, TP rank 0 (rank 0): ")
    assert "target replica 0, TP rank 1 (rank 1)" in err[-1] and "dead or stuck" in err[-1], err[-1]
    assert no_leftover_processes(run)


@pytest.mark.faults
def test_a_stop_signal_to_a_tp_rank_stops_the_run_with_a_checkpoint(tmp_path, run_cache):
    """SIGTERM to rank 1 alone (a preemption of that worker; it sends no packet): the replica's next
    agreement carries its stop request, the sender flags its packet and the drafter stops after
    that step, with a checkpoint."""
    run_dir = tmp_path / "run"
    signal = ["fault.kill_rank=1", "fault.kill_at_step=3", "fault.kill_signal=SIGTERM"]
    run = launch(run_dir, [*COMMON, TP2, *signal], run_cache, nproc=5)
    exits = run.exits()
    assert exits[(4, 0)]["returncode"] == EXIT_STOPPED, (exits, run.output[-3000:])
    stopped = ledger_steps(run_dir)
    assert 3 <= stopped < PLAN and (run_dir / "checkpoints" / f"step_{stopped:08d}" / "COMPLETE").exists()
    assert "target replica 0, TP rank 1 (rank 1): got SIGTERM" in run.rank_log(1)
    assert re.search(rf"stopped at step {stopped} of {PLAN} \(a stop signal of another rank\)", run.output)
