"""Fault injection for the reliability tests (all off by default; ``fault.*`` in the config)."""

from __future__ import annotations

import logging
import os
import signal
import time

import torch

from dflash.config import FaultConfig

log = logging.getLogger(__name__)


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


def nan_loss(cfg: FaultConfig, step: int) -> bool:
    return cfg.nan_at_step is not None and cfg.nan_at_step == step and _armed(cfg)
