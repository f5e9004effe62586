"""Part sigterm's verdict from what its two launches left in the run directory: the ledger, the
checkpoints, the drafter's log, the W&B offline runs and torchrun's own output (pure functions of
files and text; no torch)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dflash.gpu_check.procs import Proc

TORCHRUN_SIGNAL_EXIT = 1
"""torchrun's exit code after it forwarded a signal to its workers, however cleanly they ended (it
re-raises its ``SignalException``: torch/distributed/elastic/agent/server/api.py ``run``)."""
TORCHRUN_KILLED = "forcefully exiting via"
"""torchrun's warning when a worker outlived its shutdown grace (``--shutdown-timeout``, default 30 s) and
was SIGKILLed."""


def ledger(run_dir: Path) -> list[dict[str, Any]]:
    """The complete records of ``ledger.jsonl`` (a torn last line, still being written, left out)."""
    path = run_dir / "ledger.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(ln) for ln in lines if ln.endswith("}")]


def last_step(run_dir: Path) -> int:
    """The last step in the ledger (0 before the first)."""
    records = ledger(run_dir)
    return int(records[-1]["step"]) if records else 0


def complete_checkpoints(run_dir: Path) -> dict[int, float]:
    """Step -> GiB of every checkpoint with its COMPLETE marker."""
    out = {}
    for d in sorted((run_dir / "checkpoints").glob("step_*")):
        if (d / "COMPLETE").is_file():
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            out[int(d.name.removeprefix("step_"))] = round(size / 2**30, 3)
    return out


def wandb_offline_runs(run_dir: Path) -> list[str]:
    """The W&B offline runs in the run directory (``wandb/offline-run-<time>-<id>``, one per launch)
    that hold a non-empty ``run-<id>.wandb`` file."""
    runs = []
    for d in sorted((run_dir / "wandb").glob("offline-run-*")):
        if any(f.stat().st_size > 0 for f in d.glob("run-*.wandb")):
            runs.append(d.name)
    return runs


def _log(run_dir: Path, rank: int) -> str:
    path = run_dir / f"rank{rank}.log"
    return path.read_text(errors="replace") if path.is_file() else ""


def judge_stop(run_dir: Path, first: Proc, steps: int, at: int, drafter_rank: int) -> dict[str, Any]:
    """The signalled launch's figures and ``problems`` (empty when it passed): signalled once its
    ledger held step ``at``, it stopped at a step boundary ``k`` (``at <= k < steps``) with a
    complete checkpoint of step ``k`` and said so (the drafter's summary), no worker was SIGKILLed
    by torchrun, torchrun exited with its code after a forwarded signal, and one W&B offline run."""
    problems: list[str] = []
    res: dict[str, Any] = {"steps_requested": steps, "signal_at_step": at}
    if first.signalled_s is None:
        problems.append(f"the run ended (rc {first.rc}) before its ledger reached step {at}: no signal sent")
        return {**res, "problems": problems}
    log = _log(run_dir, drafter_rank)
    res["signalled_after_s"] = round(first.signalled_s, 1)
    res["stopped_in_s"] = round(first.seconds - first.signalled_s, 1)
    res["torchrun_exit"] = first.rc
    stopped = re.findall(r"stopped at step (\d+) of \d+ \(SIGTERM\)", log)
    k = res["stopped_at_step"] = int(stopped[-1]) if stopped else None
    ckpts = complete_checkpoints(run_dir)
    if first.timed_out:
        problems.append("the signalled run did not end within the budget")
    if TORCHRUN_KILLED in first.stderr + first.stdout:
        problems.append(
            f"torchrun SIGKILLed a worker {res['stopped_in_s']} s after forwarding SIGTERM (its grace: "
            "--shutdown-timeout or TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s): the stop outlasted it"
        )
    if first.rc != TORCHRUN_SIGNAL_EXIT or "got signal: 15" not in first.stderr:
        problems.append(
            f"torchrun exited {first.rc}, expected {TORCHRUN_SIGNAL_EXIT} after forwarding SIGTERM"
        )
    if k is None:
        problems.append(f"rank{drafter_rank}.log has no 'stopped at step k of {steps} (SIGTERM)'")
    elif not at <= k < steps:
        problems.append(f"stopped at step {k}, expected between {at} and {steps - 1}")
    elif k not in ckpts:
        problems.append(f"no complete checkpoint of step {k} (complete: {sorted(ckpts) or 'none'})")
    else:
        res["checkpoint_gib"] = ckpts[k]
    saves = re.findall(r"saved checkpoint \S+ in ([\d.]+)s", log)
    if saves:
        res["save_s"] = float(saves[-1])
    res["wandb_after_stop"] = wandb_offline_runs(run_dir)
    if len(res["wandb_after_stop"]) != 1:
        problems.append(f"W&B offline runs after the stop: {res['wandb_after_stop']}, expected one")
    return {**res, "problems": problems}


def judge_resume(
    run_dir: Path,
    second: Proc,
    stopped: int,
    steps: int,
    packets_per_step: int,
    drafter_rank: int,
    log_from: int,
) -> dict[str, Any]:
    """The relaunch's figures and ``problems``: it exited 0 having resumed from step ``stopped``
    (its part of the drafter's log, from character ``log_from``) and trained the rest, so that the
    ledger holds every step 1..``steps`` and every packet exactly once; a second W&B offline run
    of the same run id."""
    problems: list[str] = []
    res: dict[str, Any] = {"resume_exit": second.rc, "resume_wall_s": round(second.seconds, 1)}
    if second.timed_out or second.rc != 0:
        problems.append(
            f"the relaunch {'ran out of its budget' if second.timed_out else f'exited {second.rc}'}"
        )
    resumed = re.findall(r"resumed from \S+ at step (\d+)", _log(run_dir, drafter_rank)[log_from:])
    res["resumed_at_step"] = int(resumed[-1]) if resumed else None
    if res["resumed_at_step"] != stopped:
        problems.append(f"the relaunch resumed at step {res['resumed_at_step']}, not {stopped}")
    records = ledger(run_dir)
    got = [int(r["step"]) for r in records]
    packets = [p for r in records for p in r["packets"]]
    res["ledger_steps"] = f"{got[0]}-{got[-1]}, {len(got)} records" if got else "none"
    if got != list(range(1, steps + 1)):
        problems.append(f"ledger steps {got}, expected 1-{steps} once each")
    elif packets != list(range(steps * packets_per_step)):
        problems.append(f"ledger packets {packets}: some trained twice or never")
    runs = wandb_offline_runs(run_dir)
    res["wandb"] = runs
    if len(runs) != 2 or len({name.rsplit("-", 1)[-1] for name in runs}) != 1:
        problems.append(f"W&B offline runs {runs}: expected one per launch, both of one run id")
    return {**res, "problems": problems}
