"""How the drafters share one model: replicated (``GradReducer``) or sharded (FSDP2), one interface.

The trainer holds one ``DrafterParallel`` and never branches on ``drafter.shard``:

- :class:`Replicated`: every drafter holds the whole model, optimizer and gradients; with several
  drafters the gradients are summed by ``GradReducer`` (overlapped with the last backward), and the
  replicas' weights can be compared (``check``). One drafter: no collective at all.
- :class:`Sharded`: ``drafter.shard=optimizer|full`` over the drafter group
  (``dflash.distributed.sharding``): the forward's all-gathers and the backward's reduce-scatters are
  collectives of every drafter; a checkpoint holds each drafter's own shard, written by that drafter
  (``dflash.distributed.sharded_state``, DCP: nothing is gathered whole), and the export gathers the
  whole weights on the leader alone (every drafter calls ``checkpoint_state`` / ``export_model`` /
  ``whole``, in the same order).

Either way the gradients a step leaves are the plain sum over the drafters (the trainer divides them
by the global weight sum). A checkpoint of whole tensors (``load``) or of DCP shards
(``load_shards``, resharded on load) goes into either, so a run resumes across shard settings and
drafter counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from dflash.config.resolve import drafter_sharded
from dflash.distributed.collectives import broadcast_text, check_replicas
from dflash.distributed.grad_reducer import GradReducer
from dflash.distributed.process_group import DistContext
from dflash.distributed.sharded_state import read_shards, write_shards
from dflash.distributed.sharding import (
    ShardedGradReducer,
    clip_grad_norm,
    drafter_collectives,
    drafter_mesh,
    gather_weights,
    load_full_model_state,
    load_full_optimizer_state,
    shard_drafter,
    unsynced_backward,
    whole_model,
)
from dflash.drafter.model import DFlashDraftModel

log = logging.getLogger(__name__)


@dataclass
class DrafterState:
    """The drafter's model and optimizer state as a checkpoint takes it (``save_checkpoint``'s
    arguments): whole tensors, which the leader writes, or ``shards``, a collective in which every
    drafter writes its own shard (the leader passes the directory, the others None)."""

    model_state: dict[str, Tensor] | None = None
    optimizer_state: dict[str, Any] | None = None
    shards: Callable[[Path | None], None] | None = None

    def join(self) -> None:
        """A drafter other than the leader, while the leader runs ``save_checkpoint``: its part of
        the save (its shard; nothing for whole tensors)."""
        if self.shards is not None:
            self.shards(None)


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

    def partial_backward(self, loss: Tensor) -> None:
        """A backward that is not a packet's last (a chunk of its blocks): the gradients add up
        locally, nothing is reduced (the packet's last backward reduces the sum)."""
        ...

    def finish(self, timeout_s: float) -> None:
        """After the step's last backward: the gradients are the sum over the drafters."""
        ...

    def clip(self, max_norm: float) -> float:
        """Clip the gradients by the norm of the whole gradient; returns that norm."""
        ...

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> DrafterState:
        """The state a checkpoint holds (every drafter calls it; no copy is made)."""
        ...

    def load(self, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
        """Whole tensors (a checkpoint of format 1): every drafter passes the same."""
        ...

    def load_shards(self, optimizer: torch.optim.Optimizer, state_dir: Path) -> None:
        """DCP shards (format 2), written by any number of drafters, sharded or not."""
        ...

    def whole(self) -> DFlashDraftModel:
        """The model with whole weights on every drafter (the periodic eval)."""
        ...

    def export_model(self, keep: bool) -> DFlashDraftModel | None:
        """The model with whole weights where ``keep`` (the leader, which exports it), else None."""
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

    def partial_backward(self, loss: Tensor) -> None:
        if self.reducer is None:
            loss.backward()
            return
        with self.reducer.held():
            loss.backward()

    def finish(self, timeout_s: float) -> None:
        if self.reducer is not None:
            self.reducer.finish(timeout_s)

    def clip(self, max_norm: float) -> float:
        return clip_grad_norm(list(self.model.parameters()), max_norm)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> DrafterState:
        return DrafterState(self.model.state_dict(), optimizer.state_dict())

    def load(self, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
        self.model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    def load_shards(self, optimizer: torch.optim.Optimizer, state_dir: Path) -> None:
        read_shards(state_dir, self.model, optimizer, group=None)  # each replica reads it whole

    def whole(self) -> DFlashDraftModel:
        return self.model

    def export_model(self, keep: bool) -> DFlashDraftModel | None:
        return self.model if keep else None

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

    def partial_backward(self, loss: Tensor) -> None:
        with drafter_collectives(self.ctx, "sharded weights all-gather in backward"):
            unsynced_backward(self.model, loss)

    def finish(self, timeout_s: float) -> None:
        self.reducer.finish(timeout_s)

    def clip(self, max_norm: float) -> float:
        return clip_grad_norm(list(self.model.parameters()), max_norm)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> DrafterState:
        return DrafterState(shards=partial(self._write_shards, optimizer))

    def _write_shards(self, optimizer: torch.optim.Optimizer, dest: Path | None) -> None:
        """Every drafter: its shard into the leader's ``dest`` (the others pass None)."""
        where = broadcast_text(self.ctx, None if dest is None else str(dest))
        write_shards(Path(where), self.model, optimizer, self.ctx.drafter_group)

    def load(self, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
        load_full_model_state(self.model, model_state)
        load_full_optimizer_state(optimizer, optimizer_state)

    def load_shards(self, optimizer: torch.optim.Optimizer, state_dir: Path) -> None:
        read_shards(state_dir, self.model, optimizer, group=self.ctx.drafter_group)

    def whole(self) -> DFlashDraftModel:
        return whole_model(self.model).to(self.ctx.device)

    def export_model(self, keep: bool) -> DFlashDraftModel | None:
        if keep:
            return whole_model(self.model)
        gather_weights(self.model, into=None)  # the others' part of the leader's gathers
        return None

    def check(self, step: int) -> None:
        """Each drafter holds its own shard: nothing to compare."""


def drafter_parallel(
    model: DFlashDraftModel, ctx: DistContext, shard: str, num_drafters: int
) -> DrafterParallel:
    """``Sharded`` for ``drafter.shard=optimizer|full`` with several drafters (sharding ``model`` in
    place: build the optimizer afterwards), else ``Replicated`` (one drafter: said once, as the
    setting then has no effect)."""
    if drafter_sharded(shard, num_drafters):
        return Sharded(model, ctx, shard)
    if shard != "none":
        log.warning(
            "drafter.shard=%s with one drafter: nothing to shard, the drafter trains unsharded "
            "(add drafters with topology.num_drafters to shard its state)",
            shard,
        )
    return Replicated(model, ctx, num_drafters)
