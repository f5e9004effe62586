"""Attention for the drafter: dense-mask SDPA (CPU and fallback) or block-sparse flex_attention (GPU).

Keys are laid out as ``[context (S); blocks (Q)]``. Both paths compute exactly the same function;
the mask rule lives in ``dflash.drafter.blocks`` and is expressed once as a predicate.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F


@dataclass
class AttentionMask:
    """Either a dense boolean mask [B, 1, Q, KV] (True = attend) or a flex ``BlockMask``."""

    dense: torch.Tensor | None = None
    block_mask: object | None = None

    def __post_init__(self) -> None:
        if (self.dense is None) == (self.block_mask is None):
            raise ValueError("AttentionMask needs exactly one of dense / block_mask")


@lru_cache(maxsize=2)
def _flex(device_type: str):
    """Compiled flex_attention on GPU; eager on CPU (forward only there: no CPU backward in torch)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None, scale: float
) -> torch.Tensor:
    """q [B, nh, Q, hd], k/v [B, nkv, KV, hd] -> [B, nh, Q, hd] (GQA handled here)."""
    if mask is not None and mask.block_mask is not None:
        from torch.nn.attention.flex_attention import flex_attention

        # inside a compiled drafter layer the layer's graph compiles flex itself
        flex = flex_attention if torch.compiler.is_compiling() else _flex(q.device.type)
        return flex(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    attn_mask = None if mask is None else mask.dense
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
