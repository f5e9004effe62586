"""The planner's and the rehearsal's parts of each drafter family beyond the DFlash-1 stack (pure
Python, no torch: :mod:`dflash.plan` imports it; :mod:`dflash.drafter.families` holds the rest of
each family's record).

Units of :mod:`dflash.plan.costs` (a multiply-add is 2 FLOP; only GEMM-like work). DFlash2, with
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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash.drafter.arch import DrafterArch


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


FAMILY_COSTS: dict[str, FamilyCosts] = {
    "dflash": FamilyCosts(),
    "dflash2": FamilyCosts(
        extra_params=_dflash2_params,
        adamw_params=lambda a: (
            a.num_layers * 2 * 2 * a.conv_kernel_size * a.hidden_size + 2 * a.vocab_size * a.selector_rank
        ),
        layer_flop_per_token=lambda a: (
            2 * 2 * a.hidden_size * 2 * a.conv_kernel_size * (a.hidden_size // a.conv_group_size)
        ),
        head_no_grad_flop_per_row=lambda a: 2 * a.hidden_size * a.vocab_size,
        head_flop_per_row=lambda a: (
            2 * a.hidden_size * a.selector_rank + 2 * a.selector_top_k * a.selector_rank
        ),
        layer_activation_bytes_per_token=lambda a: (
            4 * 4 * a.hidden_size + 4 * 4 * a.conv_kernel_size * (a.hidden_size // a.conv_group_size)
        ),
        head_activation_bytes_per_row=lambda a: 4 * (a.selector_top_k + 1) * a.selector_rank,
    ),
}


def family_costs(drafter: DrafterArch) -> FamilyCosts:
    """The cost parts of ``drafter``'s family."""
    return FAMILY_COSTS[drafter.family]
