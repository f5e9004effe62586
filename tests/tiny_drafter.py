"""A tiny drafter architecture and one packed batch (two documents, 4 anchors), shared by the
drafter tests on CPU and on CUDA."""

from __future__ import annotations

import torch

from dflash.drafter.arch import DrafterArch
from dflash.drafter.attention import AttentionMask
from dflash.drafter.blocks import build_masks, sample_anchors
from dflash.drafter.model import DFlashDraftModel
from dflash.targets.packing import doc_ids_from_positions

BS = 4
MASK_ID = 119
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
"""A mixed layout whose window (5 keys) is smaller than either document of ``tiny_batch``."""


def tiny_arch(**kw) -> DrafterArch:
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=120,
        target_layer_ids=[1, 3, 5],
        block_size=BS,
        mask_token_id=MASK_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    base.update(kw)
    return DrafterArch(**base)


def tiny_batch(seed: int = 0):
    """``(position_ids, doc_ids, anchors, input_ids, aux_hidden fp64, embedding fp64)`` on CPU."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(14), torch.arange(10)]).unsqueeze(0)
    S = pos.shape[1]
    doc = doc_ids_from_positions(pos)
    mask = torch.ones(1, S, dtype=torch.long)
    mask[0, :3] = 0
    anchors = sample_anchors(mask, doc, 4, g)
    ids = torch.randint(0, 118, (1, S), generator=g)
    aux = torch.randn(1, S, 3 * 64, generator=g, dtype=torch.float64)
    emb = torch.randn(120, 64, generator=g, dtype=torch.float64)
    return pos, doc, anchors, ids, aux, emb


def masks_for(model: DFlashDraftModel, anchors, doc, kind: str = "sdpa") -> dict[str, AttentionMask]:
    """The training masks ``model``'s layer types need."""
    arch = model.arch
    return build_masks(anchors, doc, arch.block_size, kind, arch.layer_types, arch.sliding_window)


CHUNK_BS, CHUNK_V, CHUNK_H = 4, 97, 32
# three packed documents (lengths 13, 8, 19); overlapping blocks, one cut by a document end,
# anchors out of position order and two padding blocks
CHUNK_ANCHORS = [[1, 2, 5, 9, 11, 14, 16, 25, 22, 26, 30, 36, -1, -1]]


def chunk_arch(family: str) -> DrafterArch:
    """A 3-layer drafter (sliding, full, sliding) of ``family`` for the block-chunked step's tests."""
    extra = dict(family="dflash2", conv_kernel_size=3, conv_group_size=8) if family == "dflash2" else {}
    return DrafterArch(
        hidden_size=CHUNK_H,
        intermediate_size=48,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=CHUNK_V,
        target_layer_ids=[0, 1],
        block_size=CHUNK_BS,
        mask_token_id=CHUNK_V - 1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **extra,
    )


def chunk_packet(seed: int = 0) -> dict[str, torch.Tensor]:
    """A packet of three documents for ``chunk_arch``: positions / loss_mask [1, T], ids [T], taps,
    final states and the frozen embedding and head."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(13), torch.arange(8), torch.arange(19)]).unsqueeze(0)
    T = pos.shape[1]
    mask = torch.ones(1, T, dtype=torch.long)
    mask[0, [0, 4, 13, 14, 30]] = 0
    return dict(
        positions=pos,
        loss_mask=mask,
        ids=torch.randint(0, CHUNK_V - 1, (T,), generator=g),
        aux=torch.randn(T, 2 * CHUNK_H, generator=g),
        final=torch.randn(T, CHUNK_H, generator=g),
        embed=torch.randn(CHUNK_V, CHUNK_H, generator=g),
        head=torch.randn(CHUNK_V, CHUNK_H, generator=g) * 0.3,
    )
