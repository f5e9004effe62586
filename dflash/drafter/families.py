"""Drafter families: the one record of what differs between DFlash-1 and the others (``drafter.family``).

A family (:class:`DrafterFamily`) names its model class (the build, the decode hook ``propose``:
DFlash-1 the argmax, DFlash2 the selector chain), the ``architectures`` entry of its served export
(:mod:`dflash.drafter.export` writes and reads it from here; its ``dflash_config`` keys are its
``DrafterArch`` fields, :data:`dflash.drafter.arch.FAMILY_FIELDS`), and its parts for the planner and
the rehearsal beyond the shared DFlash-1 stack (:class:`FamilyCosts`). Pure Python, no torch (the
planner reads the costs): the model class is imported when a drafter is built.

Units of :mod:`dflash.sizing.costs` (a multiply-add is 2 FLOP; only GEMM-like work). DFlash2, with
``K`` taps, ``G = H / conv_group_size`` groups, ``r`` selector rank, ``k`` candidates, ``V`` vocabulary:

- per layer and block token: two kernel projections, ``2 * 2*H*(2*K*G)`` forward (3x with the
  backward); parameters per layer ``2 * (2*K*H + 2*K*G*H)``;
- per supervised row: the candidates' logits for the top-k, a no-grad pass over the vocabulary
  ``2*H*V`` (forward only), and the selector's hidden projection and edge scores ``2*H*r + 2*k*r``
  (3x); parameters ``2*V*r + r*H`` (the codebooks and the projection);
- activations kept for backward: per layer and block token four fp32 convolution inputs ``4*4*H`` and
  the coefficients ``4*4*K*G``; per supervised row the gathered successor rows and the query,
  ``4*(k+1)*r``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash.drafter.arch import DrafterArch
    from dflash.drafter.model import DFlashDraftModel


def _zero(a: DrafterArch) -> float:
    return 0.0


@dataclass(frozen=True)
class FamilyCosts:
    """A family's cost and memory parts beyond DFlash-1's (all 0 for DFlash-1)."""

    extra_params: Callable[[DrafterArch], float] = _zero
    """Trainable parameters."""
    adamw_params: Callable[[DrafterArch], float] = _zero
    """Of those, the ones AdamW keeps even under ``optim=muon`` (not 2-D, or token-indexed tables:
    ``lookup_tables``)."""
    layer_flop_per_token: Callable[[DrafterArch], float] = _zero
    """Forward FLOPs of each layer per block token."""
    head_no_grad_flop_per_row: Callable[[DrafterArch], float] = _zero
    """Forward-only FLOPs per supervised row after the final norm."""
    head_flop_per_row: Callable[[DrafterArch], float] = _zero
    """Forward FLOPs per supervised row after the final norm that also run backward (3x)."""
    layer_activation_bytes_per_token: Callable[[DrafterArch], float] = _zero
    """Bytes each layer keeps for backward per block token."""
    head_activation_bytes_per_row: Callable[[DrafterArch], float] = _zero
    """Bytes the head keeps for backward per supervised row."""


def _dflash2_params(a: DrafterArch) -> float:
    k, g, h = a.conv_kernel_size, a.hidden_size // a.conv_group_size, a.hidden_size
    return (
        a.num_layers * 2 * (2 * k * h + 2 * k * g * h)
        + 2 * a.vocab_size * a.selector_rank
        + a.selector_rank * h
    )


DFLASH2_COSTS = FamilyCosts(
    extra_params=_dflash2_params,
    adamw_params=lambda a: (
        a.num_layers * 2 * 2 * a.conv_kernel_size * a.hidden_size + 2 * a.vocab_size * a.selector_rank
    ),
    layer_flop_per_token=lambda a: (
        2 * 2 * a.hidden_size * 2 * a.conv_kernel_size * (a.hidden_size // a.conv_group_size)
    ),
    head_no_grad_flop_per_row=lambda a: 2 * a.hidden_size * a.vocab_size,
    head_flop_per_row=lambda a: 2 * a.hidden_size * a.selector_rank + 2 * a.selector_top_k * a.selector_rank,
    layer_activation_bytes_per_token=lambda a: (
        4 * 4 * a.hidden_size + 4 * 4 * a.conv_kernel_size * (a.hidden_size // a.conv_group_size)
    ),
    head_activation_bytes_per_row=lambda a: 4 * (a.selector_top_k + 1) * a.selector_rank,
)


@dataclass(frozen=True)
class DrafterFamily:
    """Everything that differs between drafter families."""

    name: str
    """``drafter.family`` (a ``DrafterFamilyName`` of the config)."""
    architecture: str
    """``architectures`` of the served ``config.json``."""
    model: str
    """``module:Class`` of its ``DFlashDraftModel`` subclass (build; ``propose`` is its decode hook),
    imported by :meth:`model_class`."""
    summary: str
    costs: FamilyCosts = field(default_factory=FamilyCosts)
    """Its parameters, FLOPs and activation bytes beyond DFlash-1's (none by default)."""

    def model_class(self) -> type[DFlashDraftModel]:
        module, _, name = self.model.partition(":")
        return getattr(importlib.import_module(module), name)


FAMILIES: dict[str, DrafterFamily] = {
    f.name: f
    for f in (
        DrafterFamily(
            name="dflash",
            architecture="DFlashDraftModel",
            model="dflash.drafter.model:DFlashDraftModel",
            summary="DFlash-1: block diffusion with KV injection, argmax per slot",
        ),
        DrafterFamily(
            name="dflash2",
            architecture="DFlash2DraftModel",
            model="dflash.drafter.dflash2:DFlash2DraftModel",
            summary="DFlash2: block-local dynamic convolutions, candidate selector walked as a chain",
            costs=DFLASH2_COSTS,
        ),
    )
}


def family_of(arch: DrafterArch) -> DrafterFamily:
    return FAMILIES[arch.family]


def family_costs(arch: DrafterArch) -> FamilyCosts:
    """The cost parts of ``arch``'s family."""
    return family_of(arch).costs


def build_drafter(arch: DrafterArch) -> DFlashDraftModel:
    """A freshly initialised drafter of ``arch``'s family."""
    return family_of(arch).model_class()(arch)


def family_of_architectures(architectures: list[str]) -> DrafterFamily:
    """The family an exported ``config.json`` names (ValueError naming the field)."""
    found = [f for f in FAMILIES.values() if f.architecture in architectures]
    if len(found) != 1:
        known = [f.architecture for f in FAMILIES.values()]
        raise ValueError(f"config.json architectures={architectures} names none of {known}")
    return found[0]
