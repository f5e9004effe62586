"""Drafter families: the one record of what differs between DFlash-1 and DFlash2.

A family (:class:`DrafterFamily`) names its model class (the build, the decode hook
``propose``), the ``architectures`` entry and the ``dflash_config`` keys of its served export
(:mod:`dflash.drafter.export` reads and writes them from here), and its parts for the planner and
the rehearsal beyond the shared DFlash-1 stack: extra parameters, FLOPs per block token of each
layer and per supervised row after the norm, and activation bytes. ``drafter.family`` selects one.

Cost parts (the units of :mod:`dflash.plan.costs`: a multiply-add is 2 FLOP; forward + backward
is 3x the forward; only GEMM-like work) of DFlash2, ``K`` taps, ``G = H / group`` groups, ``r``
rank, ``k`` candidates, ``V`` vocabulary:

- per layer and block token: two kernel projections ``2 * 2*H*(2*K*G)`` forward;
  parameters ``2 * (2*K*H + 2*K*G*H)``;
- per supervised row: the candidates' logits (the top-k, a no-grad pass over the vocabulary:
  ``2*H*V``, forward only), the hidden projection ``2*H*r`` and the edge scores ``2*k*r``
  (forward + backward); parameters ``2*V*r + r*H``;
- activations kept for backward: per layer four fp32 ``[Q, H]`` convolution inputs and the
  coefficients ``[Q, 4*K*G]``; per supervised row the gathered successor rows ``k*r`` and the
  query ``r`` in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dflash.drafter.arch import FAMILY_FIELDS, DrafterArch
from dflash.drafter.dflash2 import DFlash2DraftModel
from dflash.drafter.model import DFlashDraftModel


@dataclass(frozen=True)
class DrafterFamily:
    """Everything that differs between drafter families."""

    name: str
    architecture: str
    """``architectures`` of the served ``config.json``."""
    model: type[DFlashDraftModel]
    """The module (build; ``propose`` is its decode hook)."""
    summary: str
    extra_params: Callable[[DrafterArch], int] = lambda a: 0
    """Trainable parameters beyond the DFlash-1 stack."""
    layer_flop_per_token: Callable[[DrafterArch], float] = lambda a: 0.0
    """Forward FLOPs per block token of each layer beyond DFlash-1's."""
    head_flop_per_row: Callable[[DrafterArch], dict[str, float]] = lambda a: {}
    """FLOPs per supervised row after the final norm, by name: ``(forward-only, forward+backward)``
    parts as ``{"no_grad": ..., "trained": ...}`` (the step multiplies ``trained`` by 3)."""
    layer_activation_bytes_per_token: Callable[[DrafterArch], float] = lambda a: 0.0
    """Bytes per block token each layer keeps for backward beyond DFlash-1's."""
    head_activation_bytes_per_row: Callable[[DrafterArch], float] = lambda a: 0.0
    """Bytes per supervised row the head keeps for backward."""

    @property
    def fields(self) -> tuple[str, ...]:
        """Its ``DrafterArch`` fields beyond the shared ones (``dflash_config`` keys of the export)."""
        return FAMILY_FIELDS[self.name]


def _dflash2_params(a: DrafterArch) -> int:
    k, g, h = a.conv_kernel_size, a.conv_groups, a.hidden_size
    per_layer = 2 * (2 * k * h + 2 * k * g * h)
    return a.num_layers * per_layer + 2 * a.vocab_size * a.selector_rank + a.selector_rank * h


FAMILIES: dict[str, DrafterFamily] = {
    f.name: f
    for f in (
        DrafterFamily(
            name="dflash",
            architecture="DFlashDraftModel",
            model=DFlashDraftModel,
            summary="DFlash-1: block diffusion with KV injection, argmax per slot",
        ),
        DrafterFamily(
            name="dflash2",
            architecture="DFlash2DraftModel",
            model=DFlash2DraftModel,
            summary="DFlash2: block-local dynamic convolutions, candidate selector walked as a chain",
            extra_params=_dflash2_params,
            layer_flop_per_token=lambda a: 2 * 2 * a.hidden_size * 2 * a.conv_kernel_size * a.conv_groups,
            head_flop_per_row=lambda a: {
                "no_grad": 2 * a.hidden_size * a.vocab_size,
                "trained": 2 * a.hidden_size * a.selector_rank + 2 * a.selector_top_k * a.selector_rank,
            },
            layer_activation_bytes_per_token=lambda a: (
                4 * 4 * a.hidden_size + 4 * 4 * a.conv_kernel_size * a.conv_groups
            ),
            head_activation_bytes_per_row=lambda a: 4 * (a.selector_top_k + 1) * a.selector_rank,
        ),
    )
}


def family_of(arch: DrafterArch) -> DrafterFamily:
    return FAMILIES[arch.family]


def build_drafter(arch: DrafterArch) -> DFlashDraftModel:
    """A freshly initialised drafter of ``arch``'s family."""
    return family_of(arch).model(arch)


def family_of_architectures(architectures: list[str]) -> DrafterFamily:
    """The family an exported ``config.json`` names (ValueError naming the field)."""
    found = [f for f in FAMILIES.values() if f.architecture in architectures]
    if len(found) != 1:
        known = [f.architecture for f in FAMILIES.values()]
        raise ValueError(f"config.json architectures={architectures} names none of {known}")
    return found[0]
