"""Anchors, noise blocks, label positions and the attention masks of DFlash training and decoding.

Shape legend: B rows, S context tokens per row, N blocks per row, bs block size, Q = N * bs.
A row may hold several packed documents; ``doc_ids [B, S]`` numbers them (-1 = padding) and is
derived from the RoPE position ids, which restart at 0 for every document.

Rules (reference spec, dflash_training.md sections 2.2-2.5):
- anchor p is eligible when loss_mask[p] = loss_mask[p+1] = 1 and p+1 is in the same document;
- block n = ``[x_{a_n}, MASK x (bs-1)]`` at positions pos(a_n) + k; slot k predicts the token AT
  a_n + k (same position, no shift); slot 0 is given and never supervised;
- visibility is keyed on the anchor, never on the block index, so overlapping anchors never see
  each other's futures. A padding block (anchor -1) sees only (part of) itself, so no query row is
  ever fully masked.

Which keys the query of slot k of the block at anchor a sees (its position is p = pos(a) + k):
- ``full_attention`` layer: the context of its own document strictly before the anchor (j < a) and
  all bs slots of its own block (bidirectional);
- ``sliding_attention`` layer with window W (``drafter.sliding_window``): the keys at positions
  p-W+1 .. p, W keys counting the query itself, i.e. the context rows a+k-W+1 <= j < a of its
  document and the slots 0..k of its own block (causal inside the block). W >= bs is required.

The sliding rule is the servers' (snapshots read 2026-08; every one applies it to a
``layer_types``/``sliding_window`` config like the one ``dflash.drafter.export`` writes):
- vLLM, vllm-project/vllm:vllm/model_executor/models/qwen3_dflash.py (``_dflash_layer_causal``,
  ``_resolve_layer_attention``): a layer is causal if the top-level ``is_causal`` says so, else if
  ``dflash_config.causal`` says so (each overrides *every* layer), else iff ``layer_types[i] ==
  "sliding_attention"``; a sliding layer gets ``per_layer_sliding_window=W``, which
  vllm/v1/attention/backends/flash_attn.py turns into ``window_size=(W-1, 0)``: keys p-W+1 .. p.
- SGLang, sgl-project/sglang:python/sglang/srt/models/dflash.py (``_get_dflash_layer_attention_params``)
  with python/sglang/srt/speculative/dflash_utils.py (``get_dflash_attention_sliding_window_size``):
  sliding layers are ``AttentionType.DECODER`` (causal) with window_left = W-1 ("HF sliding windows
  include the current token"), full layers ``ENCODER_ONLY`` (bidirectional); no causality key is read.
- SpecForge, sgl-project/SpecForge:specforge/algorithms/common/dflash_family_model.py
  (``create_dflash_sdpa_mask``, ``create_dflash_block_mask``), the training side: sliding layers see
  context j with a+k-(W-1) <= j < a and own-block slots k' <= k. It does not window the block slots,
  which differs from the servers only when W < bs (refused here).
- z-lab reference, z-lab/dflash:dflash/model.py (``Qwen3DFlashAttention``): passes ``sliding_window=W``
  to the transformers attention function with ``is_causal=False``. Flash-attention applies it as
  ``window_size=(W-1, W-1)`` (transformers:modeling_flash_attention_utils.py): the same context edge
  but a bidirectional block; its sdpa/eager paths ignore it (no window at all unless a mask is given).

We follow the servers, where vLLM and SGLang agree and SpecForge trains the same way: causal inside
the window, bidirectional in full layers; the z-lab flash path differs only inside the block.
One predicate (``_allow``) builds the dense training mask, the flex BlockMask and the decoding mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.config import SLIDING_ATTENTION
from dflash.drafter.attention import AttentionMask
from dflash.loss.device import uncounted

SAMPLE_FROM_ANCHOR = False
"""Slot k of the block at anchor a predicts the token at a + k and slot 0 is the anchor's token,
given (module docstring): ``sample_from_anchor=false`` in the engines' and speculators' terms (their
``true`` has slot k predict a + k + 1). Exports write it; both families train it."""


def eligible_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: loss_mask[p] and loss_mask[p+1] and doc[p] == doc[p+1] (last position never)."""
    m = loss_mask.bool()
    out = torch.zeros_like(m)
    out[:, :-1] = m[:, :-1] & m[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    return out


def offered_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, num_anchors: int) -> torch.Tensor:
    """0-dim int64 on the device: the anchors ``sample_anchors`` would draw without ``max_total``
    (per document, its eligible anchors up to ``num_anchors``); no host sync."""
    elig = eligible_anchors(loss_mask, doc_ids).long()
    per_doc = torch.zeros_like(elig).scatter_add_(1, doc_ids.clamp(min=0), elig)
    return per_doc.clamp(max=num_anchors).sum()


def sample_anchors(
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator,
    max_total: int | None = None,
) -> torch.Tensor:
    """Up to ``num_anchors`` eligible anchors per document, uniform without replacement, sorted.

    ``max_total`` caps the anchors of a row (all its documents), subsampling uniformly.
    Returns [B, N] int64 positions, padded with -1 (N = the largest count over rows, >= 1), on the
    inputs' device. The sampling runs on the host (``generator`` is a CPU generator): given device
    tensors it reads them back (two host syncs); the trainer passes its host copies (none).
    """
    B, S = loss_mask.shape
    elig = eligible_anchors(loss_mask, doc_ids).cpu()
    docs = doc_ids.cpu().clamp(min=0)
    keys = torch.rand((B, S), generator=generator, dtype=torch.float64)
    rows: list[torch.Tensor] = []
    for b in range(B):
        cand = elig[b].nonzero().squeeze(1)
        if cand.numel() == 0:
            rows.append(cand)
            continue
        d = docs[b, cand]
        # Sort by (document, random key): the first num_anchors of each document are its sample.
        order = torch.argsort(d.double() * 2.0 + keys[b, cand], stable=True)
        cand, d = cand[order], d[order]
        first = torch.searchsorted(d, d, right=False)
        rank = torch.arange(cand.numel()) - first
        chosen = cand[rank < num_anchors]
        if max_total is not None and chosen.numel() > max_total:
            pick = torch.randperm(chosen.numel(), generator=generator)[:max_total]
            chosen = chosen[pick]
        rows.append(torch.sort(chosen).values)
    width = max(1, max(r.numel() for r in rows))
    out = torch.full((B, width), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : r.numel()] = r
    return out.to(loss_mask.device)


@dataclass
class Blocks:
    """Everything derived from the anchors of one batch.

    block_ids [B, Q]: token ids of the noise blocks; block_positions [B, Q]: RoPE positions;
    label_pos [B, N, bs]: absolute position each slot predicts (clamped into the row);
    label_valid [B, N, bs] bool: slot k >= 1 of a real block, inside the row and the anchor's
    document (the loss mask is applied on top of this).
    """

    anchors: torch.Tensor
    block_ids: torch.Tensor
    block_positions: torch.Tensor
    label_pos: torch.Tensor
    label_valid: torch.Tensor


def make_blocks(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> Blocks:
    """Noise blocks ``[x_a, MASK x (bs-1)]`` at positions pos(a)+k and their label positions."""
    B, _ = input_ids.shape
    N = anchors.shape[1]
    valid = anchors >= 0
    a = anchors.clamp(min=0)
    k = torch.arange(block_size, device=input_ids.device)
    block_ids = torch.full((B, N, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    block_ids[..., 0] = torch.where(valid, input_ids.gather(1, a), mask_token_id)
    block_positions = position_ids.gather(1, a).unsqueeze(-1) + k
    label_pos, label_valid = label_slots(doc_ids, anchors, block_size)
    return Blocks(
        anchors=anchors,
        block_ids=block_ids.view(B, N * block_size),
        block_positions=block_positions.view(B, N * block_size),
        label_pos=label_pos,
        label_valid=label_valid,
    )


def label_slots(
    doc_ids: torch.Tensor, anchors: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Blocks.label_pos`` and ``Blocks.label_valid`` [B, N, bs] of the anchors (no token ids needed:
    what the host computes from its own copies to know the supervised rows before the device does)."""
    B, S = doc_ids.shape
    N = anchors.shape[1]
    valid = anchors >= 0
    a = anchors.clamp(min=0)
    k = torch.arange(block_size, device=anchors.device)
    pos = a.unsqueeze(-1) + k  # [B, N, bs]
    inside = pos < S
    pos_c = pos.clamp(max=S - 1)
    same_doc = doc_ids.gather(1, pos_c.view(B, -1)).view(B, N, block_size) == doc_ids.gather(1, a).unsqueeze(
        -1
    )
    return pos_c, valid.unsqueeze(-1) & inside & same_doc & (k >= 1)


def _allow(q_idx, kv_idx, anchors_flat, q_doc, kv_doc, S: int, block_size: int, window: int | None):
    """The visibility predicate of every mask (tensor or scalar indices; keys ``[context; blocks]``).

    Context index arithmetic equals position arithmetic because a document's rows are contiguous.
    """
    n = q_idx // block_size
    k = q_idx % block_size
    a = anchors_flat[n]
    ctx = (kv_idx < S) & (kv_idx < a) & (kv_doc == q_doc[n])
    own = (kv_idx >= S) & ((kv_idx - S) // block_size == n)
    if window is not None:
        ctx = ctx & (kv_idx >= a + k - (window - 1))
        own = own & ((kv_idx - S) % block_size <= k)
    return ctx | own


def dense_mask(
    anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int, window: int | None = None
) -> AttentionMask:
    """Boolean [B, 1, Q, S + Q] mask (True = attend) for SDPA; ``window`` for a sliding layer."""
    B, S = doc_ids.shape
    N = anchors.shape[1]
    Q = N * block_size
    q_idx = torch.arange(Q, device=anchors.device).view(Q, 1)
    kv_idx = torch.arange(S + Q, device=anchors.device).view(1, S + Q)
    masks = []
    for b in range(B):
        kv_doc = torch.cat([doc_ids[b], torch.full((Q,), -2, device=doc_ids.device, dtype=doc_ids.dtype)])
        q_doc = torch.where(anchors[b] >= 0, doc_ids[b].gather(0, anchors[b].clamp(min=0)), -3)
        masks.append(_allow(q_idx, kv_idx, anchors[b], q_doc, kv_doc[kv_idx], S, block_size, window))
    return AttentionMask(dense=torch.stack(masks).unsqueeze(1))


def flex_mask(
    anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int, window: int | None = None
) -> AttentionMask:
    """Block-sparse ``BlockMask`` for flex_attention (one head dimension: H=None)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, S = doc_ids.shape
    N = anchors.shape[1]
    Q = N * block_size
    pad = torch.full((B, Q), -2, device=doc_ids.device, dtype=doc_ids.dtype)
    kv_doc = torch.cat([doc_ids, pad], dim=1)
    q_doc = torch.where(anchors >= 0, doc_ids.gather(1, anchors.clamp(min=0)), -3)

    def mask_mod(b, h, q_idx, kv_idx):
        return _allow(q_idx, kv_idx, anchors[b], q_doc[b], kv_doc[b, kv_idx], S, block_size, window)

    # compiled on CUDA (no [Q, S + Q] tensor); eager elsewhere, and uncounted by the rehearsal
    with uncounted():
        block_mask = create_block_mask(
            mask_mod, B, None, Q, S + Q, device=anchors.device, _compile=anchors.device.type == "cuda"
        )
    return AttentionMask(block_mask=block_mask)


def decode_mask(num_context: int, num_slots: int, window: int, device: torch.device) -> AttentionMask:
    """[1, 1, Q, n + Q] mask of a decoding call of a sliding layer: one block of Q = ``num_slots``
    slots anchored right after ``num_context`` context rows (the last rows before the anchor)."""
    n, Q = num_context, num_slots
    q_idx = torch.arange(Q, device=device).view(Q, 1)
    kv_idx = torch.arange(n + Q, device=device).view(1, n + Q)
    anchor = torch.tensor([n], device=device)
    doc = torch.zeros(n + Q, dtype=torch.long, device=device)
    allow = _allow(q_idx, kv_idx, anchor, doc[:1], doc[kv_idx], n, Q, window)
    return AttentionMask(dense=allow.view(1, 1, Q, n + Q))


def build_mask(
    anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int, kind: str, window: int | None = None
) -> AttentionMask:
    """kind 'sdpa' (dense) or 'flex' (block-sparse); ``window`` W for a sliding layer."""
    if kind == "flex":
        return flex_mask(anchors, doc_ids, block_size, window)
    if kind == "sdpa":
        return dense_mask(anchors, doc_ids, block_size, window)
    raise ValueError(f"drafter.attention={kind!r}: expected 'sdpa' or 'flex'")


def build_masks(
    anchors: torch.Tensor,
    doc_ids: torch.Tensor,
    block_size: int,
    kind: str,
    layer_types: list[str],
    window: int | None,
) -> dict[str, AttentionMask]:
    """One training mask per attention kind in ``layer_types`` (what ``DFlashDraftModel`` takes)."""
    return {
        t: build_mask(anchors, doc_ids, block_size, kind, window if t == SLIDING_ATTENTION else None)
        for t in sorted(set(layer_types))
    }
