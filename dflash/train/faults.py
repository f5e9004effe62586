"""Fault injection for the reliability tests (all off by default).

The faults are not part of the run's config (a user never sees them): the test launcher
(``tests/runner.py``) puts them in the environment, ``DFLASH_FAULTS={"kill_rank": 1, ...}`` (JSON
of :class:`FaultConfig`'s fields), and every rank reads them once (:func:`injected`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

FAULTS_ENV = "DFLASH_FAULTS"


@dataclass
class FaultConfig:
    """Fault injection for the reliability tests; every field off by default. Not part of the run's
    config: the test launcher sets :data:`FAULTS_ENV` (``tests/runner.py``)."""

    kill_rank: int | None = field(default=None)
    """SIGKILL this rank at the first step >= ``kill_at_step`` (1-based optimizer step) it works on."""
    kill_at_step: int | None = field(default=None)
    kill_signal: str = field(default="SIGKILL")
    """The signal of ``kill_rank`` (SIGTERM: a preemption of that worker alone)."""
    hang_rank: int | None = field(default=None)
    """This rank stops responding (sleeps forever, alive) at the first step >= ``hang_at_step``."""
    hang_at_step: int | None = field(default=None)
    perturb_rank: int | None = field(default=None)
    """This drafter's weights drift from the other replicas at ``perturb_at_step`` (replica check)."""
    perturb_at_step: int | None = field(default=None)
    nan_at_step: int | None = field(default=None)
    """The drafter's loss becomes NaN at this step."""
    slow_rank: int | None = field(default=None)
    """This drafter spends ``slow_s`` more seconds in step ``slow_at_step``, after it received (and
    ACKed) the step's packets: a first step that compiles."""
    slow_at_step: int | None = field(default=None)
    slow_s: float = field(default=0.0)
    nonfinite_sample_ids: list[int] = field(default_factory=list)
    """Source sample ids whose target hidden states are replaced by NaN (non-finite input)."""
    target_oom_tokens: int | None = field(default=None)
    """A target forward of more than this many tokens raises ``torch.OutOfMemoryError``, as a GPU
    that runs out of memory would (the packet maker then splits it)."""
    only_first_attempt: bool = field(default=True)
    """Inject only in the first torchrun attempt (TORCHELASTIC_RESTART_COUNT == 0)."""


def injected() -> FaultConfig:
    """The faults of :data:`FAULTS_ENV` (none when it is unset), read when a role starts; a
    malformed value is a ``ValueError`` naming the variable and the field."""
    raw = os.environ.get(FAULTS_ENV)
    if not raw:
        return FaultConfig()
    try:
        values = json.loads(raw)
        known = {f.name for f in dataclasses.fields(FaultConfig)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; known: {sorted(known)}")
        return FaultConfig(**values)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{FAULTS_ENV}: {e}") from None


def _armed(cfg: FaultConfig) -> bool:
    return not cfg.only_first_attempt or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


_sent: list[int] = []


def at_step(cfg: FaultConfig, rank: int, step: int) -> None:
    """Kill or hang this rank if the config says so for 1-based optimizer step ``step``.

    Fires at the first step >= ``kill_at_step``/``hang_at_step`` the rank reaches: a target only
    works on the steps of its own packets (with 2 targets, target 1 never sees an odd step).
    """
    if not _armed(cfg):
        return
    if cfg.kill_rank == rank and cfg.kill_at_step is not None and step >= cfg.kill_at_step and not _sent:
        log.warning("fault injection: %s rank %d at step %d", cfg.kill_signal, rank, step)
        _sent.append(step)  # a signal the rank survives (SIGTERM) is sent once
        os.kill(os.getpid(), signal.Signals[cfg.kill_signal])
    if cfg.hang_rank == rank and cfg.hang_at_step is not None and step >= cfg.hang_at_step:
        log.warning("fault injection: rank %d stops responding at step %d", rank, step)
        while True:
            time.sleep(3600)


def slow_step(cfg: FaultConfig, rank: int, step: int) -> None:
    """This drafter spends ``slow_s`` more seconds in step ``slow_at_step`` after receiving (and
    ACKing) its packets, as a first step that compiles does."""
    if cfg.slow_rank == rank and cfg.slow_at_step == step and cfg.slow_s > 0 and _armed(cfg):
        log.warning("fault injection: rank %d spends %gs more in step %d", rank, cfg.slow_s, step)
        time.sleep(cfg.slow_s)


def perturb(cfg: FaultConfig, rank: int, step: int, model: torch.nn.Module) -> None:
    """Add 1e-3 to one weight of this drafter replica at ``perturb_at_step`` (replicas diverge)."""
    if cfg.perturb_rank == rank and cfg.perturb_at_step == step and _armed(cfg):
        log.warning("fault injection: perturbing the drafter weights of rank %d at step %d", rank, step)
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1e-3


def target_oom(cfg: FaultConfig, tokens: int) -> None:
    """Raise ``torch.OutOfMemoryError`` for a forward of more than ``target_oom_tokens`` tokens
    (every attempt: a deterministic shape fails the same way after a restart)."""
    if cfg.target_oom_tokens is not None and tokens > cfg.target_oom_tokens:
        raise torch.OutOfMemoryError(
            f"fault injection: a target forward of {tokens} tokens (target_oom_tokens={cfg.target_oom_tokens})"
        )


def nan_loss(cfg: FaultConfig, step: int) -> bool:
    return cfg.nan_at_step is not None and cfg.nan_at_step == step and _armed(cfg)
