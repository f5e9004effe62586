"""The drafter's optimizer (``optim.name``: AdamW, as in the public DFlash recipes, or Muon on the
weight matrices with AdamW on the rest, ``dflash.drafter.muon``) and its schedule: linear warmup
then cosine decay, one multiplier for every parameter group."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash.config import OptimConfig
from dflash.drafter.muon import GROUP_KEY, MuonAdamW, split_matrices


def build_optimizer(
    params: list[torch.nn.Parameter], cfg: OptimConfig, tables: Sequence[torch.nn.Parameter] = ()
) -> torch.optim.Optimizer:
    """The optimizer of ``optim.name`` over the drafter's trainable parameters (fp32 master weights):
    AdamW over all of them (one group), or ``MuonAdamW`` (group 0 AdamW over the norms and the
    token-indexed ``tables``, group 1 Muon over the other 2-D matrices). Build it after
    ``drafter.shard`` has sharded the model (``tables`` are then the sharded parameters)."""
    adamw: dict[str, Any] = dict(
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, **adamw)
    matrices, others = split_matrices(params, tables)
    muon: dict[str, Any] = dict(
        lr=peak_lrs(cfg)[1],
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
        weight_decay=cfg.muon_weight_decay,
        adjust_lr_fn=str(cfg.muon_adjust_lr),
    )
    return MuonAdamW(matrices, others, adamw=adamw, muon=muon)


def peak_lrs(cfg: OptimConfig) -> list[float]:
    """The peak learning rate of each parameter group ``build_optimizer`` makes, in group order."""
    if cfg.name == "adamw":
        return [cfg.lr]
    return [cfg.lr, cfg.muon_lr if cfg.muon_lr is not None else cfg.lr]


def group_lrs(optimizer: torch.optim.Optimizer, lrs: list[float]) -> dict[str, float]:
    """The metrics of the groups' current learning rates ``lrs`` (the scheduler's ``get_last_lr()``):
    ``train/lr`` (AdamW's group) and, with Muon, ``train/lr_muon``."""
    out: dict[str, float] = {}
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        name = group.get(GROUP_KEY, "adamw")
        out["train/lr" if name == "adamw" else f"train/lr_{name}"] = float(lr)
    return out


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at 0-based optimizer step ``step`` of ``total_steps``.

    Linear warmup over ceil(warmup_ratio * total) steps (the first step uses 1/warmup), then cosine
    from 1 down to ``min_lr_ratio`` at the last step.
    """
    warmup = math.ceil(warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total_steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class LrSchedule:
    """The learning-rate multiplier of each 0-based optimizer step: ``lr_factor`` of the run's
    settings, or, once ``replan`` moved it at ``resume_step``, a cosine from ``resume_factor`` there
    down to ``min_lr_ratio`` at the last step. A plain-data object: the scheduler's state saves it in
    every checkpoint, so a resumed run continues the schedule it was on."""

    total_steps: int
    warmup_ratio: float
    min_lr_ratio: float
    resume_step: int = -1
    """>= 0: the step the schedule was re-planned at (a resume with changed settings)."""
    resume_factor: float = 1.0

    def __call__(self, step: int) -> float:
        if self.resume_step < 0 or step < self.resume_step:
            return lr_factor(step, self.total_steps, self.warmup_ratio, self.min_lr_ratio)
        span = max(1, self.total_steps - 1 - self.resume_step)
        progress = min(1.0, (step - self.resume_step) / span)
        low = self.min_lr_ratio
        return low + (self.resume_factor - low) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def replan(self, step: int, factor: float, cfg: OptimConfig, total_steps: int) -> None:
        """Continue from multiplier ``factor`` at ``step`` under new settings: inside the new warmup
        the new schedule as it is; after it, a cosine from ``factor`` to the new ``min_lr_ratio`` at
        the new last step (no jump in the learning rate)."""
        self.total_steps, self.warmup_ratio, self.min_lr_ratio = (
            total_steps,
            cfg.warmup_ratio,
            cfg.min_lr_ratio,
        )
        in_warmup = step < math.ceil(cfg.warmup_ratio * total_steps)
        self.resume_step, self.resume_factor = (-1, 1.0) if in_warmup else (step, factor)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` over an ``LrSchedule`` of the settings (its state saves the schedule)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, LrSchedule(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
    )
