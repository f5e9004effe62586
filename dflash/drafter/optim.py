"""AdamW with linear warmup then cosine decay, as in the public DFlash recipes."""

from __future__ import annotations

import math

import torch

from dflash.config import OptimConfig


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the drafter's trainable parameters (fp32 master weights)."""
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )


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


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
    )
