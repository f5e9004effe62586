"""D-PACE slot weights (arXiv 2605.18810): acceptance-aware, detached weights of a block's slots.

A drafted block is accepted up to its first miss, so a slot only matters when every slot before it
is accepted. With ``q_j = exp(-l_j)`` (``l_j`` the slot's loss, a cross-entropy: the model's
probability of the right token) and ``a`` in (0, 1]:

    q~_j = (1 - a) q_j + a            (an unsupervised slot counts 1: it neither stops nor adds)
    C_j  = prod_{i <= j} q~_i          (the chance the block gets that far, smoothed by a)
    w_j  = sum_{m >= j, m supervised} C_m

``w_j`` is the expected accepted length that slot ``j`` takes part in. The anchor slot (0) and every
unsupervised slot weigh 0. ``a = 1`` gives ``w_j`` = the supervised slots from ``j`` to the block's
end. The weights are constants for the gradient (computed without grad).
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def dpace_weights(losses: Tensor, supervised: Tensor, a: float) -> Tensor:
    """``[G, bs]`` D-PACE weights of ``G`` blocks of ``bs`` slots.

    ``losses`` ``[G, bs]`` float (any value where not supervised), ``supervised`` ``[G, bs]`` bool
    (slot 0, the anchor, is never supervised), ``a`` in (0, 1]. Computed in float64 and returned in
    ``losses``' dtype."""
    if not 0.0 < a <= 1.0:
        raise ValueError(f"D-PACE's a must be in (0, 1], got {a}")
    if losses.shape != supervised.shape or losses.dim() != 2:
        raise ValueError(
            f"losses {tuple(losses.shape)} and supervised {tuple(supervised.shape)} must be [G, bs]"
        )
    sup = supervised.clone()
    sup[:, 0] = False
    q = torch.exp(-losses.double().clamp_min(0))
    smoothed = torch.where(sup, (1 - a) * q + a, torch.ones_like(q))
    reach = torch.cumprod(smoothed, dim=1) * sup
    tail = reach.flip(1).cumsum(1).flip(1)  # sum over m >= j
    return (tail * sup).to(losses.dtype)
