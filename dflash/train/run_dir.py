"""One owner per run directory, and what a launch does with the run that is already there.

- ``RunDirLock``: the drafter leader holds an exclusive ``flock`` on ``<run dir>/.dflash.lock``
  for its whole life (the kernel releases it when the process dies, so a crashed run never leaves
  a stale lock). A second launch into the same directory is refused at once, naming the holder.
- ``resume_checkpoint``: what ``train.resume`` asks for, checked before any process group exists:
  ``auto`` takes the newest complete checkpoint that verifies (a damaged one is named and skipped),
  a path takes that checkpoint, ``never`` starts from scratch but refuses a directory that holds
  another run's results unless ``train.overwrite=true``, which moves them aside to
  ``replaced/<time>/`` (nothing is deleted). The checkpoint's run contract is compared with this
  run's (``check_contract``): a different contract is refused unless
  ``train.allow_contract_change=true``; another number of packets per step is refused in any case
  (``FIXED_KEYS``); the number of drafters itself may change (a sharded state is resharded).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from dflash.config import TrainConfig, UserError, contract_defaults
from dflash.files import LockHeld, file_lock
from dflash.train.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    find_resume_checkpoint,
    load_checkpoint,
    tuples_to_lists,
)

log = logging.getLogger(__name__)

LOCK_FILE = ".dflash.lock"
RUN_OUTPUTS = ("checkpoints", "drafter", "ledger.jsonl", "metrics.jsonl", "wandb_run_id")
"""What a run leaves in its directory besides logs and config.yaml (moved aside by train.overwrite)."""
RUN_DIRS = ("checkpoints", "drafter", "wandb", "replaced")
"""Entries of a run directory that the run keeps as directories."""
RUN_FILES = (
    LOCK_FILE,
    "config.yaml",
    "ledger.jsonl",
    "metrics.jsonl",
    "wandb_run_id",
    ".dflash.shared-check",
)
"""Files the run writes in its directory (and the rank logs, ``rank*.log``)."""


def run_dir_problems(run_dir: Path) -> list[str]:
    """What in ``run_dir`` the run would write through or over: a symbolic link among its entries
    (a write would follow it out of the directory, a cleanup would delete through it) and a file
    where the run keeps a directory. Checked on every rank before anything is written there."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    names = [*RUN_FILES, *RUN_DIRS, *(p.name for p in run_dir.glob("rank*.log"))]
    problems = []
    for name in sorted(set(names)):
        path = run_dir / name
        if path.is_symlink():
            problems.append(
                f"{path} is a symbolic link (to {os.readlink(path)}); a run writes only inside its own directory: "
                f"remove the link, or give the run another directory (hydra.run.dir=...)"
            )
        elif name in RUN_DIRS and path.exists() and not path.is_dir():
            problems.append(
                f"{path} is a file where the run keeps its {name}/ directory; move it away, or give the run "
                f"another directory (hydra.run.dir=...)"
            )
    return problems


class RunDirLock:
    """Exclusive, non-blocking lock on a run directory (``dflash.files.file_lock``), with who holds
    it written inside."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._held = ExitStack()

    def acquire(self) -> RunDirLock:
        """Take the lock or raise ``UserError`` naming the directory and the holder."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        holder = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        )
        try:
            self._held.enter_context(file_lock(self.path, blocking=False, holder=holder))
        except LockHeld as e:
            raise UserError(
                f"hydra.run.dir={self.run_dir} is in use by another launch ({e.holder}); wait for it to end, "
                f"or give this launch its own directory (hydra.run.dir=...)",
                scope="here",
            ) from None
        return self

    def release(self) -> None:
        self._held.close()

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def previous_outputs(run_dir: Path) -> list[str]:
    """The run outputs present in ``run_dir`` (names from ``RUN_OUTPUTS``)."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def move_aside(run_dir: Path) -> Path:
    """Move every run output of ``run_dir`` into ``run_dir/replaced/<time>/`` and return that dir."""
    dest = run_dir / "replaced" / time.strftime("%Y%m%d-%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "+")
    dest.mkdir(parents=True)
    for name in previous_outputs(run_dir):
        os.rename(run_dir / name, dest / name)
    log.warning("train.overwrite=true: moved the previous run's outputs of %s to %s", run_dir, dest)
    return dest


def resume_checkpoint(
    run_dir: Path,
    train: TrainConfig,
    contract: dict[str, Any],
    resolve: Any,
    *,
    is_leader: bool,
    num_drafters: int | None = None,
) -> LoadedCheckpoint | None:
    """The checkpoint this launch continues from (None: from scratch), per ``train.resume``.

    ``resolve`` turns a user path into an absolute one; ``num_drafters`` (this launch's) makes the advice
    on a changed ``topology.packets_per_step`` concrete. Only the leader moves files (``overwrite``).
    Raises ``UserError`` (printed by the leader) for a refused directory, a missing or damaged
    checkpoint path and a contract change.
    """
    scope = "here" if is_leader else "quiet"
    loaded: LoadedCheckpoint | None = None
    if train.resume == "never":
        found = previous_outputs(run_dir)
        if found and not train.overwrite:
            raise UserError(
                f"train.resume=never but hydra.run.dir={run_dir} holds another run's outputs ({', '.join(found)}); "
                f"resume it (train.resume=auto), start in a new directory (hydra.run.dir=...), or set "
                f"train.overwrite=true to move them aside to {run_dir}/replaced/",
                scope=scope,
            )
        if found and is_leader:
            move_aside(run_dir)
        return None
    if train.resume == "auto":
        try:
            loaded = find_resume_checkpoint(run_dir / "checkpoints")
        except CheckpointError as e:
            raise UserError(f"train.resume=auto: {e}", scope=scope) from None
    else:
        path = Path(resolve(train.resume))
        if not path.is_dir():
            raise UserError(
                f"train.resume={train.resume}: no such checkpoint directory ({path}); give a step_XXXXXXXX "
                f"directory of a run, or train.resume=auto (the newest of this run dir) or never",
                scope=scope,
            )
        try:
            loaded = load_checkpoint(path)
        except CheckpointError as e:
            raise UserError(f"train.resume={train.resume}: {e}", scope=scope) from None
    if loaded is not None:
        try:
            changes = check_contract(
                loaded.contract,
                contract,
                allow_change=train.allow_contract_change,
                num_drafters=num_drafters,
                run_dir=run_dir,
            )
        except ValueError as e:
            raise UserError(f"resuming from {loaded.path}: {e}", scope=scope) from None
        for c in changes:
            log.warning("resuming with a changed contract (train.allow_contract_change=true): %s", c)
    return loaded


# --------------------------------------------------------------------------------------------
# The run contract


SCHEDULE_KEYS = ("optim.lr", "optim.muon_lr", "optim.warmup_ratio", "optim.min_lr_ratio", "train.num_steps")
"""Contract entries that shape the learning-rate schedule: a resume that changes only these (with
train.allow_contract_change=true) re-plans the rest of the schedule (``DrafterTrainer``)."""


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, Mapping) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def _show(v: Any) -> str:
    if v is _MISSING:
        return "<missing>"
    try:
        return json.dumps(v, sort_keys=True)
    except (TypeError, ValueError):
        return repr(v)


FIXED_KEYS = ("topology.packets_per_step",)
"""Contract entries no resume may change, even with train.allow_contract_change=true: packets are
numbered step x packets_per_step from the start of the run, so after a change the targets (restarting
at the checkpoint's next packet) and the drafters (expecting step x the new packets_per_step) would
disagree on every packet."""


def _packets_per_step_fix(saved: Any, num_drafters: int | None, run_dir: Path | None) -> str:
    """How to resume with the checkpoint's packets per step (only values that keep it), or start anew
    from the run's export when it has one."""
    ways = []
    if isinstance(saved, int) and saved >= 1:
        splits = [d for d in range(1, saved + 1) if saved % d == 0]
        splits.sort(key=lambda d: d != num_drafters)  # this launch's drafters first, when they divide it
        ways = [f"topology.num_drafters={d} optim.grad_accum_steps={saved // d}" for d in splits[:4]]
    export = Path(run_dir) / "drafter" if run_dir is not None else None
    anew = (
        f"; or start a new run (another directory, a new schedule) from its export: drafter.init_from={export}"
        if export is not None and (export / "config.json").is_file()
        else ""
    )
    return (
        "\ntopology.packets_per_step (topology.num_drafters x optim.grad_accum_steps) cannot change on a resume, "
        "even with train.allow_contract_change=true: packets are numbered step x packets_per_step, so the "
        "targets (restarting at the checkpoint's next packet) and the drafters would disagree on every packet. "
        f"Resume with {saved} packets per step ({' or '.join(ways)}, and topology.num_targets for the rest of "
        f"the ranks){anew}."
    )


def check_contract(
    saved: dict,
    current: dict,
    *,
    allow_change: bool,
    num_drafters: int | None = None,
    run_dir: Path | None = None,
) -> list[str]:
    """Differences between the contract saved in a checkpoint and the current run's, as
    ``"field: saved=X current=Y"`` (nested fields dotted); a field the checkpoint predates matches
    when the run leaves it at its default (``contract_defaults``: a new loss term at 0). Raises
    ``ValueError`` naming every changed field unless ``allow_change``; then returns the list for
    the caller to log. A change of a ``FIXED_KEYS`` entry is refused either way, with the values
    that resume (``num_drafters``: this launch's) and the export of ``run_dir`` to start anew from."""
    a = _flatten(tuples_to_lists(saved))
    b = _flatten(tuples_to_lists(current))
    defaults = contract_defaults()
    diffs = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, _MISSING), b.get(key, _MISSING)
        if va is _MISSING and key in defaults and vb == defaults[key]:
            continue
        if va is _MISSING or vb is _MISSING or va != vb:
            diffs.append(f"{key}: saved={_show(va)} current={_show(vb)}")
    fixed = [d for d in diffs if d.split(":", 1)[0] in FIXED_KEYS]
    if fixed:
        raise ValueError(
            "the checkpoint was written by a run with a different contract:\n  "
            + "\n  ".join(diffs)
            + _packets_per_step_fix(a.get(FIXED_KEYS[0]), num_drafters, run_dir)
        )
    optimizers = [a.get("optim.name", defaults["optim.name"]), b.get("optim.name", defaults["optim.name"])]
    if optimizers[0] != optimizers[1]:
        raise ValueError(
            f"optim.name: the checkpoint holds {optimizers[0]}'s state and this run asks for {optimizers[1]}; "
            f"one run cannot switch optimizers (not even with train.allow_contract_change=true): start a new "
            f"run warm-started from this one's weights, drafter.init_from=<run dir>/drafter optim={optimizers[1]}"
        )
    if diffs and not allow_change:
        only_schedule = all(d.split(":", 1)[0] in SCHEDULE_KEYS for d in diffs)
        hint = (
            "\nTo extend (or shorten) the run or change its learning rate, set train.allow_contract_change=true: "
            "the learning rate then continues from the value the run reached down to the new minimum at "
            "the new last step."
            if only_schedule
            else "\nResuming would mix incompatible state. To accept the change on purpose, set "
            "train.allow_contract_change=true (the differences are then logged)."
        )
        raise ValueError(
            "the checkpoint was written by a run with a different contract:\n  " + "\n  ".join(diffs) + hint
        )
    return diffs
