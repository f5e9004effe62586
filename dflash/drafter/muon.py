"""Muon on the drafter's weight matrices and AdamW on the rest, as one ``torch.optim.Optimizer``.

:class:`MuonAdamW` drives ``torch.optim.AdamW`` and :class:`Muon` (``torch.optim.Muon``) over one
list of parameter groups (group 0 AdamW, group 1 Muon, each tagged ``"optimizer"``) and one state,
so that the schedule (one ``LambdaLR``), ``zero_grad``, the checkpoint (one ``state_dict`` in the
standard layout: states keyed by parameter index, which ``dflash.distributed.sharding`` gathers and
loads whole) and the trainer see a single optimizer, as with AdamW alone.

Sharded matrices (``drafter.shard``, FSDP2: each parameter a ``DTensor`` of dim-0 shards). torch's
Muon runs its Newton-Schulz iteration on a ``DTensor`` as DTensor ops: a few collectives per
iteration and per matrix, and bf16 products of the shards summed across ranks in bf16, which differ
from the whole matrix's (measured on 2 gloo ranks: up to 1.6% of an update). :class:`Muon` instead
gathers each matrix's update whole (one all-gather of the matrix per step, the bytes of the weights'
own all-gather), orthogonalises it with torch's own function on every rank and keeps its rows: the
momentum and the update are elementwise on the shards, so a sharded step equals the unsharded one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

GROUP_KEY = "optimizer"
"""The param-group key naming the algorithm that updates the group (``adamw`` or ``muon``)."""


def is_muon_matrix(param: Tensor) -> bool:
    """Muon updates 2-D matrices with both sides > 1 (a ``[1, N]`` row is a vector to it)."""
    return param.ndim == 2 and min(param.shape) > 1


def split_matrices(
    params: Iterable[nn.Parameter], tables: Iterable[nn.Parameter] = ()
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(matrices, others)`` of the trainable ``params``, in their order (:func:`is_muon_matrix`);
    ``tables`` (token-indexed rows, ``DFlashDraftModel.lookup_tables``) go to ``others``."""
    trainable = [p for p in params if p.requires_grad]
    skip = {id(t) for t in tables}
    muon = [p for p in trainable if is_muon_matrix(p) and id(p) not in skip]
    chosen = {id(p) for p in muon}
    return muon, [p for p in trainable if id(p) not in chosen]


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz iteration sees the whole matrix of a sharded
    parameter (module doc); plain tensors take torch's own step."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if not any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            for param, grad, buf in zip(params, grads, bufs, strict=True):
                _sharded_muon_update(param, grad, buf, group)
        return loss


def _sharded_muon_update(param: Tensor, grad: Tensor, buf: Tensor, group: dict[str, Any]) -> None:
    """torch 2.13's ``_single_tensor_muon`` for one parameter, the orthogonalisation on the whole
    matrix (``tests/unit/test_muon.py`` holds it to torch's step bitwise)."""
    lr, momentum = float(group["lr"]), group["momentum"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
    whole = update.full_tensor() if isinstance(update, DTensor) else update
    ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
    if isinstance(param, DTensor):  # this rank's rows of the whole result (no communication)
        ortho = distribute_tensor(ortho, param.device_mesh, param.placements, src_data_rank=None)
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))


class MuonAdamW(torch.optim.Optimizer):
    """AdamW over ``others`` (group 0) and :class:`Muon` over ``matrices`` (group 1) as one
    optimizer (module doc). ``adamw`` and ``muon`` are the keyword arguments of each."""

    def __init__(
        self,
        matrices: list[nn.Parameter],
        others: list[nn.Parameter],
        *,
        adamw: dict[str, Any],
        muon: dict[str, Any],
    ) -> None:
        self._adamw = torch.optim.AdamW(others, **adamw)
        self._muon = Muon(matrices, **muon)
        groups = [*self._adamw.param_groups, *self._muon.param_groups]
        for group, name in zip(groups, ("adamw", "muon"), strict=True):
            group[GROUP_KEY] = name
        super().__init__(groups, {})
        self._link()

    def _link(self) -> None:
        """The parts update the groups and the state of this optimizer (the same objects)."""
        self._adamw.param_groups = [g for g in self.param_groups if g[GROUP_KEY] == "adamw"]
        self._muon.param_groups = [g for g in self.param_groups if g[GROUP_KEY] == "muon"]
        self._adamw.state = self._muon.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._adamw.step()
        self._muon.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()  # torch replaces the group dicts and the state
