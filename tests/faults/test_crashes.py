"""R2: a target killed mid-run is survived with one torchrun restart, exactly (real torchrun). R3: a
killed drafter ends every target non-zero within 30 s, each naming the drafter. R4: a target that
stops responding is reported within topology.step_timeout_s (+30 s) by the drafter waiting on it,
and the drafter's report is the launch's root cause. R3 and R4 are in-process launches (a rank's
failure gets the others SIGTERM, as under torchrun)."""

from __future__ import annotations

from collections import Counter

import pytest
from faultkit import HANG_GRACE_S, HANG_TIMEOUT_S, assert_continues_reference, figure, log_time, resumed_step
from runner import launch, no_leftover_processes

pytestmark = pytest.mark.faults


@pytest.mark.slow
def test_killed_target_is_survived_with_one_restart(killed_target_run, reference):
    run = killed_target_run
    assert run.returncode == 0, run.output[-4000:]
    exits = run.exits()
    assert exits[(1, 0)]["returncode"] == -9  # the injected SIGKILL, first attempt only
    assert sorted(a for (_, a) in exits) == [0, 0, 0, 1, 1, 1]  # exactly one restart of all 3 ranks
    assert all(exits[(r, 1)]["returncode"] == 0 for r in range(3))
    log = run.rank_log(2)
    resumed = resumed_step(log)
    assert resumed in (4, 8), log[-3000:]
    assert_continues_reference(run, reference, resumed)
    ledger = run.ledger()
    trained = Counter(i for e in ledger for i in e["sample_ids"])
    assert trained == Counter(i for e in reference.ledger() for i in e["sample_ids"])
    restart_s = exits[(0, 1)]["start"] - exits[(1, 0)]["end"]
    figure(
        "R2 target SIGKILL, --max-restarts=1",
        exit_code=run.returncode,
        restarts=1,
        killed_at_step=10,
        resumed_from_step=resumed,
        equal_loss_steps=f"{resumed + 1}-12",
        duplicates=0,
        lost=0,
        restart_after_s=round(restart_s, 1),
        total_s=round(run.seconds, 1),
    )
    assert no_leftover_processes(run)


def test_killed_drafter_ends_every_target_naming_it(tmp_path, run_cache):
    run = launch(
        tmp_path / "run",
        ["train.max_steps=12", "logging.mode=disabled", "fault.kill_rank=2", "fault.kill_at_step=4"],
        run_cache,
    )
    assert run.returncode != 0
    exits = run.exits()
    assert exits[(2, 0)]["returncode"] == -9
    died = exits[(2, 0)]["end"]
    killed = log_time(run.rank_log(2), "fault injection: SIGKILL rank 2")  # same clock as the targets' logs
    within, detected = {}, {}
    for t in (0, 1):
        assert exits[(t, 0)]["returncode"] != 0
        within[t] = round(exits[(t, 0)]["end"] - died, 2)
        assert within[t] <= 30
        log = run.rank_log(t)
        failed_at = log_time(log, f"rank {t} failed")
        assert failed_at is not None, log[-2000:]
        detected[t] = round(failed_at - killed, 3)
        err = [ln for ln in log.splitlines() if ln.startswith("dflash.distributed.links.PeerError")]
        assert err and f"target {t} (rank {t})" in err[-1] and "drafter 0 (rank 2)" in err[-1], log[-2000:]
    figure(
        "R3 drafter SIGKILL, --max-restarts=0",
        target_exit_codes=[exits[(t, 0)]["returncode"] for t in (0, 1)],
        target_error_after_drafter_kill_s=detected,
        target_exit_after_drafter_death_s=within,
        launch_exit=run.returncode,
        error=err[-1],
    )
    assert no_leftover_processes(run)


def test_hung_target_is_reported_by_the_drafter(hung_target_run):
    run = hung_target_run.result()
    timeout_s = HANG_TIMEOUT_S
    assert run.returncode != 0
    hung = log_time(run.rank_log(0), "stops responding")
    assert hung is not None
    drafter_log = run.rank_log(2)
    detected = log_time(drafter_log, "rank 2 failed")
    err = [ln for ln in drafter_log.splitlines() if ln.startswith("dflash.distributed.links.PeerError")]
    assert detected is not None and err, drafter_log[-2000:]
    # names the stuck rank, its role and the operation
    assert "no packet header from target 0 (rank 0)" in err[-1] and "(recv header)" in err[-1]
    assert f"within {timeout_s}s" in err[-1] and "the target is dead or stuck" in err[-1]
    # The root cause (the first failure, with the error file torchrun reports it from) is the
    # drafter's report, not a peer blaming the drafter: no other rank failed before it.
    others = [log_time(run.rank_log(r), f"rank {r} failed") for r in (0, 1)]
    assert all(t is None or t >= detected for t in others), (detected, others)
    root = run.error_file(2)
    assert root is not None and "target 0 (rank 0)" in root["message"]["message"], root
    exits = run.exits()
    detection_s = detected - hung
    ended_s = run.started_at + run.seconds - hung
    assert detection_s <= timeout_s + 30
    # The hung rank ignores SIGTERM like a stuck one: the launch SIGKILLs it after its grace.
    assert exits[(0, 0)]["returncode"] == -9 and ended_s <= timeout_s + 30 + HANG_GRACE_S, exits
    figure(
        "R4 hung target",
        step_timeout_s=timeout_s,
        detection_s=round(detection_s, 1),
        job_end_after_hang_s=round(ended_s, 1),
        exit_code=run.returncode,
        error=err[-1],
    )
    assert no_leftover_processes(run)
