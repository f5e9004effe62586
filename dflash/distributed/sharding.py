"""Drafter state sharding over the drafter group with torch's FSDP2 (``drafter.shard``).

``shard_drafter`` applies ``torch.distributed.fsdp.fully_shard`` to each decoder layer and to the
model (``fc`` and the norms) on a 1-D device mesh of the drafter group. Weights, gradients and the
AdamW moments built on the sharded parameters are then ``DTensor`` shards (dim 0) over the drafters:

- ``optimizer``: the weights are gathered whole at the first forward of a step and stay whole until
  the end of its backward (``reshard_after_forward=False``, ZeRO-2): gradients and AdamW moments
  are sharded, the whole weights are transient (the weights' all-gather and the gradients'
  reduce-scatter move the bytes of one all-reduce);
- ``full``: the weights are gathered one layer at a time, in forward and again in backward
  (``reshard_after_forward=True``, ZeRO-3): everything is sharded, for one more all-gather.

Gradients: every unit reduce-scatters its gradients during backward (overlapped with it) as a plain
SUM, as ``GradReducer`` does (the trainer divides by the global weight sum): a divide factor of 1
with sum-only collectives. torch's own default averages, and on gloo an average once came out as a
sum (pytorch#162338); the sum is the same on every backend. With several packets per step each
backward reduce-scatters (the sharded gradients accumulate): no whole gradient is ever held.

:class:`ShardedGradReducer` is ``GradReducer``'s counterpart: ``arm()`` before the last packet's
backward, :meth:`ShardedGradReducer.backward` for each backward (a failed collective becomes a
``PeerError`` naming the drafters; :func:`drafter_collectives` does the same for the forward's
all-gathers), ``finish()`` after the last one (a rank that ran no backward in the
step runs a zero one, so that every drafter issues the same collectives). :func:`clip_grad_norm`
clips by the norm of the whole gradient. Checkpoints hold the shards as they are
(``dflash.distributed.sharded_state``); whole tensors are gathered for the periodic eval and the
export (:func:`whole_model`, :func:`gather_weights`; the export's on the leader alone) and loaded
from a checkpoint of whole tensors (:func:`load_full_model_state`, :func:`load_full_optimizer_state`);
they are collectives: every drafter calls them in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from dflash.distributed.links import PeerError, short_error
from dflash.distributed.process_group import DistContext
from dflash.drafter.families import build_drafter
from dflash.drafter.model import DFlashDraftModel

SHARD_MODES = ("none", "optimizer", "full")


def drafter_mesh(group: Any, device: torch.device) -> DeviceMesh:
    """A 1-D device mesh over the ranks of ``group`` (the drafter group)."""
    return DeviceMesh.from_group(group, device.type)


def shard_drafter(model: DFlashDraftModel, mesh: DeviceMesh, mode: str) -> DFlashDraftModel:
    """Shard ``model`` in place over ``mesh`` (module doc) and return it; ``mode`` optimizer or full.
    Build the optimizer after this call, on the sharded parameters."""
    if mode not in SHARD_MODES[1:]:
        raise ValueError(f"drafter.shard={mode!r}: shard_drafter takes optimizer or full")
    reshard = mode == "full"
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        register_fsdp_forward_method(layer, "context_kv")  # the block-chunked step's context pass
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    register_fsdp_forward_method(model, "context_states")
    for unit in model.modules():  # each unit reduces its own gradients
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return model


def unsynced_backward(model: nn.Module, loss: Tensor) -> None:
    """``loss.backward()`` on a model sharded with FSDP2 without its gradient reduce-scatter: each
    parameter keeps its unsharded gradient sum (a whole fp32 copy of the weights) until a backward with
    the sync on, the last chunk's of a packet (``DrafterParallel.partial_backward``)."""
    fsdp = cast(FSDPModule, model)
    fsdp.set_requires_gradient_sync(False)
    try:
        loss.backward()
    finally:
        fsdp.set_requires_gradient_sync(True)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


class ShardedGradReducer:
    """The gradient reduction of a sharded drafter (module doc): ``GradReducer``'s interface."""

    def __init__(self, model: DFlashDraftModel, ctx: DistContext) -> None:
        if not is_sharded(model):
            raise ValueError("ShardedGradReducer needs a model sharded by shard_drafter")
        self.model, self.ctx = model, ctx
        self._backward_ran = False

    def arm(self) -> None:
        """The next backward is the last of the step (its reduce-scatters run during it, as every one's)."""

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()``, its reduce-scatters included; a failed collective is a ``PeerError``."""
        with drafter_collectives(self.ctx, "sharded gradient reduce-scatter"):
            loss.backward()
        self._backward_ran = True

    def finish(self, timeout_s: float) -> None:
        """End the step: a rank that ran no backward runs a zero one (its peers wait on its
        reduce-scatters). Collectives time out after the process group's timeout (``timeout_s`` is
        ``GradReducer``'s; ``set_timeout`` sets the group's)."""
        if not self._backward_ran:
            self.backward(zero_loss(self.model))
        self._backward_ran = False


@contextmanager
def drafter_collectives(ctx: DistContext, what: str = "sharded weights all-gather") -> Iterator[None]:
    """The drafter group's collectives inside (FSDP2's all-gathers in forward, reduce-scatters in
    backward): a failed one is a ``PeerError`` naming this drafter and its peers. A stuck peer fails
    them after the process group's timeout (``dflash.distributed.process_group.set_timeout``)."""
    try:
        yield
    except RuntimeError as e:
        if not _backend_failure(e):
            raise
        topo = ctx.topology
        assert topo is not None
        names = ", ".join(topo.describe(r) for r in topo.drafter_ranks)
        raise PeerError(
            f"{topo.describe(ctx.rank)}: {what} among [{names}] failed ({short_error(e)}); "
            "a drafter is dead or stuck"
        ) from e


BACKEND_MARKS = ("gloo", "NCCL", "Connection reset", "Connection closed", "timed out", "Timeout")
"""How a failed collective reads when the backend raises a plain RuntimeError (gloo's transport does)."""


def _backend_failure(err: RuntimeError) -> bool:
    return isinstance(err, dist.DistError) or any(mark in str(err) for mark in BACKEND_MARKS)


def zero_loss(model: DFlashDraftModel) -> Tensor:
    """A loss of 0 through every layer of ``model`` (one block on one context row): its backward
    gives zero gradients and runs every unit's collectives."""
    arch, p = model.arch, next(model.parameters())
    device = p.to_local().device if isinstance(p, DTensor) else p.device
    noise = torch.zeros(1, arch.block_size, arch.hidden_size, device=device)
    taps = torch.zeros(1, 1, arch.num_taps * arch.hidden_size, device=device)
    pos = torch.arange(arch.block_size + 1, device=device).unsqueeze(0)
    return model(noise, taps, pos[:, :1], pos[:, 1:], None).sum() * 0.0


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """Clip the gradients of ``params`` (sharded or not) by the norm of the whole gradient (an
    all-reduce of the shards' norms when sharded); returns that norm (a tensor: no host sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """:func:`clip_grad_norm_`, the norm as a float (the trainer logs it)."""
    return float(clip_grad_norm_(params, max_norm))


def _like(param: Tensor, whole: Tensor) -> Tensor:
    """A copy of ``whole`` laid out as ``param``: its local shard (every rank holds ``whole``) or whole;
    never a view of the caller's tensor (an optimizer would update it in place)."""
    own = whole.to(param.device, param.dtype, copy=True)
    if isinstance(param, DTensor):
        return distribute_tensor(own, param.device_mesh, param.placements, src_data_rank=None)
    return own


def load_full_model_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load whole tensors (every rank passes the same ``state``) into a sharded or plain model."""
    current = model.state_dict()
    model.load_state_dict({k: _like(current[k], v) for k, v in state.items()})


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an optimizer state with whole tensors (a sharded checkpoint's gathered moments or an unsharded
    optimizer's ``state_dict``) into the optimizer of a sharded or plain model."""
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def own(param: Tensor, v: Any) -> Any:  # a moment laid out as its parameter; the step count copied
        if not isinstance(v, Tensor):
            return v
        return _like(param, v) if v.dim() > 0 else v.clone()

    moments = {i: {k: own(params[int(i)], v) for k, v in s.items()} for i, s in state["state"].items()}
    optimizer.load_state_dict({"state": moments, "param_groups": state["param_groups"]})


def gather_weights(model: nn.Module, into: nn.Module | None) -> None:
    """Copy each whole tensor of ``model``'s state (gathered when sharded, one at a time: a
    collective of every drafter) into the same-named tensor of ``into``; ``into=None``: take part
    in the gathers, keep nothing (only the drafter that keeps ever holds the whole weights)."""
    own = into.state_dict() if into is not None else None
    with torch.no_grad():
        for name, t in model.state_dict().items():
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            if own is not None:
                own[name].copy_(whole)


def whole_model(model: DFlashDraftModel) -> DFlashDraftModel:
    """An unsharded copy of ``model`` on the CPU with its whole weights (host memory: the copy and
    one whole tensor)."""
    out = build_drafter(model.arch)
    gather_weights(model, out)
    return out
