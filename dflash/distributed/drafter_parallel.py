"""How the drafters share one model: replicated (``GradReducer``) or sharded (FSDP2), one interface.

The trainer holds one ``DrafterParallel`` and never branches on ``drafter.shard``:

- :class:`Replicated`: every drafter holds the whole model, optimizer and gradients; with several
  drafters the gradients are summed by ``GradReducer`` (overlapped with the last backward), and the
  replicas' weights can be compared (``check``). One drafter: no collective at all.
- :class:`Sharded`: ``drafter.shard=optimizer|full`` over the drafter group
  (``dflash.distributed.sharding``): the forward's all-gathers and the backward's reduce-scatters are
  collectives of every drafter, checkpoints and the export gather whole tensors (every drafter calls
  ``model_state`` / ``optimizer_state`` / ``whole``, in the same order).

Either way the gradients a step leaves are the plain sum over the drafters (the trainer divides them
by the global weight sum) and a checkpoint holds whole tensors in the unsharded layout, so a run
resumes across shard settings and drafter counts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor

from dflash.distributed.collectives import check_replicas
from dflash.distributed.grad_reducer import GradReducer
from dflash.distributed.process_group import DistContext
from dflash.distributed.sharding import (
    ShardedGradReducer,
    clip_grad_norm,
    drafter_collectives,
    drafter_mesh,
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    shard_drafter,
    whole_model,
)
from dflash.drafter.model import DFlashDraftModel

log = logging.getLogger(__name__)


class DrafterParallel(Protocol):
    """What the trainer asks of the drafters' parallelism (module doc)."""

    sharded: bool

    def forward(self) -> AbstractContextManager[None]:
        """Around each packet's forward (a sharded model gathers its weights inside)."""
        ...

    def arm(self) -> None:
        """The next backward is the step's last."""
        ...

    def backward(self, loss: Tensor) -> None: ...

    def finish(self, timeout_s: float) -> None:
        """After the step's last backward: the gradients are the sum over the drafters."""
        ...

    def clip(self, max_norm: float) -> float:
        """Clip the gradients by the norm of the whole gradient; returns that norm."""
        ...

    def model_state(self) -> dict[str, Tensor]: ...

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    def load(self, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None: ...

    def whole(self) -> DFlashDraftModel:
        """The model with whole weights (the export, the periodic eval)."""
        ...

    def check(self, step: int) -> None:
        """The replicas hold the same weights (a no-op where that cannot differ)."""
        ...


class Replicated:
    """Every drafter holds the whole model (module doc)."""

    sharded = False

    def __init__(self, model: DFlashDraftModel, ctx: DistContext, num_drafters: int) -> None:
        self.model, self.ctx = model, ctx
        self.reducer = GradReducer(list(model.parameters()), ctx) if num_drafters > 1 else None

    def forward(self) -> AbstractContextManager[None]:
        return nullcontext()

    def arm(self) -> None:
        if self.reducer is not None:
            self.reducer.arm()

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def finish(self, timeout_s: float) -> None:
        if self.reducer is not None:
            self.reducer.finish(timeout_s)

    def clip(self, max_norm: float) -> float:
        return clip_grad_norm(list(self.model.parameters()), max_norm)

    def model_state(self) -> dict[str, Tensor]:
        return self.model.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load(self, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
        self.model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    def whole(self) -> DFlashDraftModel:
        return self.model

    def check(self, step: int) -> None:
        if self.reducer is not None:
            check_replicas(self.ctx, self.model, step)


class Sharded:
    """The model sharded over the drafter group with FSDP2 (module doc)."""

    sharded = True

    def __init__(self, model: DFlashDraftModel, ctx: DistContext, mode: str) -> None:
        shard_drafter(model, drafter_mesh(ctx.drafter_group, ctx.device), mode)
        self.model, self.ctx = model, ctx
        self.reducer = ShardedGradReducer(model, ctx)

    @contextmanager
    def _gathering(self) -> Iterator[None]:
        with drafter_collectives(self.ctx):
            yield

    def forward(self) -> AbstractContextManager[None]:
        return self._gathering()

    def arm(self) -> None:
        self.reducer.arm()

    def backward(self, loss: Tensor) -> None:
        self.reducer.backward(loss)

    def finish(self, timeout_s: float) -> None:
        self.reducer.finish(timeout_s)

    def clip(self, max_norm: float) -> float:
        return clip_grad_norm(list(self.model.parameters()), max_norm)

    def model_state(self) -> dict[str, Tensor]:
        return full_model_state(self.model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return full_optimizer_state(optimizer)

    def load(self, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
        load_full_model_state(self.model, model_state)
        load_full_optimizer_state(optimizer, optimizer_state)

    def whole(self) -> DFlashDraftModel:
        return whole_model(self.model).to(self.ctx.device)

    def check(self, step: int) -> None:
        """Each drafter holds its own shard: nothing to compare."""


def drafter_parallel(
    model: DFlashDraftModel, ctx: DistContext, shard: str, num_drafters: int
) -> DrafterParallel:
    """``Sharded`` for ``drafter.shard=optimizer|full`` with several drafters (sharding ``model`` in
    place: build the optimizer afterwards), else ``Replicated`` (one drafter: said once, as the
    setting then has no effect)."""
    if shard != "none" and num_drafters > 1:
        return Sharded(model, ctx, shard)
    if shard != "none":
        log.warning(
            "drafter.shard=%s with one drafter: nothing to shard, the drafter trains unsharded "
            "(add drafters with topology.num_drafters to shard its state)",
            shard,
        )
    return Replicated(model, ctx, num_drafters)
