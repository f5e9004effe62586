"""Stops that always save first, and say what they are.

- SIGTERM while the drafter leader runs a long periodic eval: the eval is aborted, the checkpoint is
  written within seconds (not after the eval, which here takes minutes), every rank exits.
- SIGHUP (a closed terminal) is handled like SIGTERM: a checkpoint, then exit.
- SIGTERM to the target alone: the target asks the drafter to stop; a checkpoint, then exit.
- A run stopped before its last step by a signal to one worker says so in its summary and exits
  with ``EXIT_STOPPED`` (75), never 0; a stop asked for with ``train.stop_after_steps`` exits 0
  (tests/faults/test_resume.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from faultkit import figure
from ranks import RANK_SERVER_ENV, rank_server
from runner import env_for, exits_dir, launch, ledger_steps, no_leftover_processes, torchrun_cmd
from testpaths import REPO

from dflash.config import EXIT_STOPPED
from dflash.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.faults

TWO = ["topology.num_targets=1", "train.max_steps=12", "train.save_every=100", "logging.mode=disabled"]


def test_sigterm_during_a_long_eval_checkpoints_within_seconds(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    first = launch(run_dir, [*TWO, "train.stop_after_steps=1"], run_cache, nproc=2)
    assert first.returncode == 0, first.output[-3000:]
    # Resumed at step 1 (no step-0 eval); the eval after step 2 decodes 4 x 1500 tokens: minutes.
    long_eval = [
        "eval.every=2",
        "eval.num_prompts=4",
        "eval.max_new_tokens=1500",
        "data.num_eval_prompts=4",
        "eval.max_share=null",  # no time budget: the eval would run for minutes
    ]
    # Signalled once the eval runs: a stop requested before it skips the eval (the other way to save first).
    run = launch(
        run_dir,
        [*TWO, *long_eval],
        run_cache,
        nproc=2,
        signal_at_log=(1, "eval at step 2 started", signal.SIGTERM),
    )
    exits = run.exits()
    signalled = run.started_at + run.signalled_after
    ckpt = run_dir / "checkpoints" / "step_00000002"
    assert load_checkpoint(ckpt).step == 2, run.output[-3000:]
    saved_s = (ckpt / "COMPLETE").stat().st_mtime - signalled
    log = run.rank_log(1)
    assert "eval at step 2 aborted: a stop was requested" in log and "eval at step 2:" not in log, log[-3000:]
    assert exits[(1, 0)]["returncode"] == EXIT_STOPPED and exits[(0, 0)]["returncode"] == 0, exits
    assert saved_s < 15 and max(e["end"] for e in exits.values()) - signalled < 20
    assert ledger_steps(run_dir) == 2
    figure("stop during a long eval", signal_to_checkpoint_s=round(saved_s, 2), drafter_exit=EXIT_STOPPED)
    assert no_leftover_processes(first, run)


def test_sighup_stops_with_a_checkpoint(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    run = launch(run_dir, TWO, run_cache, nproc=2, signal_at_step=(3, signal.SIGHUP))
    stopped = ledger_steps(run_dir)
    assert 3 <= stopped < 12, run.output[-3000:]
    assert load_checkpoint(run_dir / "checkpoints" / f"step_{stopped:08d}").step == stopped
    exits = run.exits()
    assert exits[(1, 0)]["returncode"] == EXIT_STOPPED, exits
    assert "got SIGHUP; stopping with a checkpoint" in run.rank_log(1)
    figure("SIGHUP", stopped_at_step=stopped, drafter_exit=exits[(1, 0)]["returncode"])


def test_sigterm_to_one_worker_is_an_unfinished_run(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    run = launch(
        run_dir,
        [*TWO, "fault.kill_rank=1", "fault.kill_at_step=3", "fault.kill_signal=SIGTERM"],
        run_cache,
        nproc=2,
    )
    exits = run.exits()
    assert run.returncode != 0 and exits[(1, 0)]["returncode"] == EXIT_STOPPED, (exits, run.output[-3000:])
    assert re.search(
        r"status +stopped at step 3 of 12 \(SIGTERM\); relaunch the same command to resume", run.output
    )
    assert "not exported (the run did not finish)" in run.output and not (run_dir / "drafter").exists()
    resumed = launch(run_dir, TWO, run_cache, nproc=2)
    assert resumed.returncode == 0 and re.search(r"status +finished: 12 of 12 steps", resumed.output)
    figure("SIGTERM to the drafter alone", drafter_exit=EXIT_STOPPED, launch_exit=run.returncode)


def test_sigterm_to_the_target_alone_stops_the_run_with_a_checkpoint(tmp_path, run_cache):
    """The drafter gets no signal: it stops at a step boundary because the target asked it to."""
    run_dir = tmp_path / "run"
    run = launch(run_dir, TWO, run_cache, nproc=2, signal_at_step=(3, signal.SIGTERM), signal_ranks=[0])
    stopped = ledger_steps(run_dir)
    assert 3 <= stopped < 12, run.output[-3000:]
    assert load_checkpoint(run_dir / "checkpoints" / f"step_{stopped:08d}").step == stopped
    exits = run.exits()
    assert [s for s, _ in exits[(0, 0)]["signals"]][:1] == [signal.SIGTERM] and exits[(1, 0)]["signals"] == []
    assert run.returncodes == {0: 0, 1: EXIT_STOPPED}, run.output[-3000:]
    assert "target 0 (rank 0): got SIGTERM; asking the drafters to stop at the next step" in run.rank_log(0)
    assert re.search(rf"status +stopped at step {stopped} of 12", run.output), run.output[-3000:]
    figure("SIGTERM to the target alone", stopped_at_step=stopped, exit_codes=run.returncodes)
    assert no_leftover_processes(run)


def test_ctrl_c_after_the_terminal_pipe_closed_still_checkpoints(tmp_path, run_cache):
    """``torchrun ... | head -c 400`` with the progress bar on: the reader goes away after a few
    lines, so every later write to the console hits a closed pipe (``tee`` killed by the same
    Ctrl-C, or a closed ssh session). Ctrl-C (SIGINT to the foreground process group) must still
    write the checkpoint: the drafter stops at a step boundary and exits ``EXIT_STOPPED``."""
    run_dir = tmp_path / "run"
    env = env_for(
        run_cache,
        {
            RANK_SERVER_ENV: rank_server(),
            "DFLASH_RANK_EXIT_FORWARD": "1",
            "DFLASH_RANK_EXIT_DIR": str(exits_dir(run_dir)),
        },
    )
    cmd = torchrun_cmd(run_dir, [*TWO, "logging.progress_bar=true"], nproc=2)
    shell = f"{shlex.join(cmd)} 2>&1 | head -c 400 >/dev/null"
    proc = subprocess.Popen(["bash", "-c", shell], cwd=REPO, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while ledger_steps(run_dir) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and ledger_steps(run_dir) >= 3, "the run ended or stalled before step 3"
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stopped = ledger_steps(run_dir)
    assert 3 <= stopped < 12
    assert load_checkpoint(run_dir / "checkpoints" / f"step_{stopped:08d}").step == stopped
    exits = {
        r["rank"]: r for r in map(json.loads, map(Path.read_text, exits_dir(run_dir).glob("rank*.json")))
    }
    assert exits[1]["returncode"] == EXIT_STOPPED and exits[0]["returncode"] == 0, exits
    log = (run_dir / "rank1.log").read_text()
    assert "got SIGINT; stopping with a checkpoint" in log and "BrokenPipeError" not in log, log[-3000:]
    figure("Ctrl-C under a closed pipe", stopped_at_step=stopped, drafter_exit=exits[1]["returncode"])
    assert no_leftover_processes(run_dir)
