"""A drafter rank's memory levers, resolved once before its model is built.

``drafter.block_chunks=null`` and ``drafter.activation_checkpointing=auto`` are decided by the
planner's memory model (:mod:`dflash.sizing.fit`) on this rank's own device: the packets of the
config's data (:func:`dflash.sizing.inputs.model_inputs`, which reads no ``plan.gpu``, so ``auto``
probes nothing on a training rank) against the device's memory minus ``plan.reserved_gib``. The
trainer then makes every drafter agree (the largest count, checkpointing if any needs it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash.config import Config
from dflash.sizing.fit import decide_block_chunks, decide_checkpointing, device_capacity_gib
from dflash.sizing.inputs import model_inputs


@dataclass(frozen=True)
class Levers:
    """This rank's block chunks and checkpointing, and the log lines saying why."""

    block_chunks: int
    checkpoint: bool
    reasons: tuple[str, ...]


def resolve_levers(cfg: Config, device: torch.device, world_size: int) -> Levers:
    """``drafter.block_chunks`` and ``drafter.activation_checkpointing`` for a drafter on ``device``
    (set values as they are; on a CPU, whose memory is not planned: one chunk, no checkpointing
    for ``auto``)."""
    d = cfg.drafter
    capacity = device_capacity_gib(device, cfg.plan.reserved_gib)
    auto_chunks, auto_ckpt = d.block_chunks is None, d.activation_checkpointing == "auto"
    if not math.isfinite(capacity) or not (auto_chunks or auto_ckpt):
        return Levers(d.block_chunks or 1, d.activation_checkpointing == "layers", ())
    inputs = model_inputs(cfg)
    chunking = decide_block_chunks(cfg, inputs, capacity, world_size=world_size)
    checkpointing = decide_checkpointing(
        cfg, inputs, capacity, world_size=world_size, block_chunks=chunking.chunks
    )
    return Levers(chunking.chunks, checkpointing.checkpoint, (chunking.reason, checkpointing.reason))
