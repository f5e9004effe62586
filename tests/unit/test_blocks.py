"""Anchor, block, label and mask rules of DFlash training (reference spec sections 2.2-2.4), sliding-window
layers included."""

from __future__ import annotations

import pytest
import torch

from dflash.drafter.blocks import (
    build_mask,
    dense_mask,
    eligible_anchors,
    make_blocks,
    sample_anchors,
)
from dflash.targets.packing import doc_ids_from_positions

BS = 4


def _packed(lens: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)


def test_doc_ids_follow_position_restarts():
    pos = _packed([3, 2, 4])
    assert doc_ids_from_positions(pos).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]


def test_eligible_anchor_needs_two_supervised_tokens_in_one_document():
    pos = _packed([4, 4])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1]])
    elig = eligible_anchors(mask, doc_ids_from_positions(pos))
    # p=3 -> p+1=4 crosses into document 1; p=5 -> 6 is unsupervised; p=7 is last.
    assert elig.tolist() == [[False, True, True, False, True, False, False, False]]


def test_sampling_is_without_replacement_sorted_capped_and_seeded():
    pos = _packed([40, 30])
    mask = torch.ones(1, 70, dtype=torch.long)
    doc = doc_ids_from_positions(pos)
    a1 = sample_anchors(mask, doc, 5, torch.Generator().manual_seed(3))
    a2 = sample_anchors(mask, doc, 5, torch.Generator().manual_seed(3))
    assert torch.equal(a1, a2)
    row = a1[0][a1[0] >= 0]
    assert row.numel() == 10 and torch.equal(row, row.sort().values) and row.unique().numel() == 10
    assert int((row < 40).sum()) == 5  # num_anchors is per document
    capped = sample_anchors(mask, doc, 5, torch.Generator().manual_seed(3), max_total=7)
    assert int((capped >= 0).sum()) == 7
    other = sample_anchors(mask, doc, 5, torch.Generator().manual_seed(4))
    assert not torch.equal(a1, other)


def test_rows_without_eligible_anchor_are_padded():
    mask = torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1]])
    pos = torch.arange(4).expand(2, 4)
    a = sample_anchors(mask, doc_ids_from_positions(pos), 8, torch.Generator().manual_seed(0))
    assert a[0].tolist() == [-1, -1, -1]
    assert sorted(a[1].tolist()) == [0, 1, 2]


def test_block_tokens_positions_and_same_position_labels():
    ids = torch.arange(100, 112).unsqueeze(0)
    pos = _packed([8, 4])
    doc = doc_ids_from_positions(pos)
    anchors = torch.tensor([[2, 3, 6, 9, -1]])
    b = make_blocks(ids, pos, doc, anchors, BS, mask_token_id=7)
    blocks = b.block_ids.view(5, BS)
    assert blocks[:, 0].tolist() == [102, 103, 106, 109, 7]
    assert (blocks[:, 1:] == 7).all()
    assert b.block_positions.view(5, BS)[3].tolist() == [1, 2, 3, 4]  # anchor 9 is position 1 of document 1
    # slot k predicts the token AT anchor + k (no shift)
    assert ids[0, b.label_pos[0, 0]].tolist() == [102, 103, 104, 105]
    valid = b.label_valid[0].tolist()
    assert valid[0] == [False, True, True, True]
    assert valid[2] == [False, True, False, False]  # 6 -> 7 ok, 8 is in the next document
    assert valid[3] == [False, True, True, False]  # 9 -> 10, 11; 12 is past the row
    assert valid[4] == [False] * BS  # padding block


def test_mask_context_strictly_before_anchor_and_own_block_only():
    S = 10
    pos = torch.arange(S).unsqueeze(0)
    doc = doc_ids_from_positions(pos)
    anchors = torch.tensor([[3, 4, 8]])  # blocks 0 and 1 overlap in absolute positions
    m = dense_mask(anchors, doc, BS).dense[0, 0]
    for n, a in enumerate(anchors[0].tolist()):
        for k in range(BS):
            q = n * BS + k
            ctx = m[q, :S].nonzero().squeeze(1).tolist()
            assert ctx == list(range(a)), "context must be exactly [0, anchor)"
            blk = (m[q, S:].nonzero().squeeze(1) // BS).unique().tolist()
            assert blk == [n], "a block sees its own slots only"
            assert m[q, S + n * BS : S + (n + 1) * BS].all(), "bidirectional within the block"
    # Block 1 (anchor 4) must not see block 0's slots although they cover positions 3..6,
    # and block 0 must not see context position 4 (its own slot 1 predicts it).
    assert not m[BS : 2 * BS, S : S + BS].any()
    assert not m[:BS, 4].any()


def test_mask_respects_documents_and_padding_blocks_see_only_themselves():
    pos = _packed([5, 5])
    doc = doc_ids_from_positions(pos)
    anchors = torch.tensor([[2, 7, -1]])
    m = dense_mask(anchors, doc, BS).dense[0, 0]
    S = 10
    assert m[BS, :S].nonzero().squeeze(1).tolist() == [5, 6]  # document 1 starts at 5
    pad = m[2 * BS :, :]
    assert not pad[:, :S].any() and pad[:, S + 2 * BS :].all()


def test_static_shape_padding_does_not_change_the_objective():
    from dflash.config import LossConfig
    from dflash.drafter.arch import DrafterArch
    from dflash.drafter.model import DFlashDraftModel
    from dflash.drafter.objective import dflash_loss

    torch.manual_seed(0)
    arch = DrafterArch(
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        vocab_size=50,
        target_layer_ids=[0, 1],
        block_size=BS,
        mask_token_id=49,
    )
    model = DFlashDraftModel(arch).double()
    S = 14
    pos = _packed([8, 6])
    ids = torch.randint(0, 48, (1, S))
    mask = torch.ones(1, S, dtype=torch.long)
    anchors = sample_anchors(mask, doc_ids_from_positions(pos), 3, torch.Generator().manual_seed(1))
    aux, final = torch.randn(1, S, 64, dtype=torch.float64), torch.randn(1, S, 32, dtype=torch.float64)
    emb = torch.randn(50, 32, dtype=torch.float64)
    args = (model, aux, final, ids, mask, anchors, emb, emb)
    plain = dflash_loss(*args, LossConfig(), position_ids=pos)
    padded = dflash_loss(*args, LossConfig(), position_ids=pos, static_shape=(20, anchors.shape[1] + 3))
    assert torch.allclose(plain.loss, padded.loss, rtol=1e-12, atol=0)
    assert torch.equal(plain.slot_hit, padded.slot_hit) and plain.num_blocks == padded.num_blocks
    gp = torch.autograd.grad(plain.loss, list(model.parameters()))
    gq = torch.autograd.grad(padded.loss, list(model.parameters()))
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-14) for a, b in zip(gp, gq, strict=True))


# ------------------------------------------------------------------------------ sliding-window layers


def _naive_sliding_allow(pos, doc, anchors, window):
    """Per-query reference of the sliding rule in positions: the query at p = pos(a) + k sees the keys
    of its document at positions p-W+1 .. p that are context before the anchor or slots <= k of its
    own block."""
    S = pos.shape[1]
    N = anchors.shape[1]
    out = torch.zeros(N * BS, S + N * BS, dtype=torch.bool)
    for n, a in enumerate(anchors[0].tolist()):
        for k in range(BS):
            q = n * BS + k
            for k2 in range(k + 1):  # own block, causal (the window >= BS never cuts it)
                out[q, S + n * BS + k2] = True
            if a < 0:
                continue
            p = int(pos[0, a]) + k
            for j in range(a):
                if doc[0, j] == doc[0, a] and p - window + 1 <= int(pos[0, j]):
                    out[q, j] = True
    return out


@pytest.mark.parametrize("window", [4, 5, 9])
def test_sliding_mask_equals_a_naive_per_query_reference_and_stays_in_its_window(window):
    pos = _packed([13, 9])
    doc = doc_ids_from_positions(pos)
    anchors = torch.tensor([[0, 3, 4, 9, 11, 14, 19, -1]])  # overlaps, a document start, padding
    S = pos.shape[1]
    m = dense_mask(anchors, doc, BS, window).dense[0, 0]
    assert torch.equal(m, _naive_sliding_allow(pos, doc, anchors, window))
    full = dense_mask(anchors, doc, BS).dense[0, 0]
    assert not (m & ~full).any(), "a sliding layer sees a subset of what a full layer sees"
    cut = 0
    for n, a in enumerate(anchors[0].tolist()):
        if a < 0:
            continue
        for k in range(BS):
            p = int(pos[0, a]) + k
            keys = m[n * BS + k].nonzero().squeeze(1)
            key_pos = torch.where(keys < S, pos[0, keys.clamp(max=S - 1)], pos[0, a] + (keys - S) % BS)
            assert len(keys) <= window and bool(((key_pos > p - window) & (key_pos <= p)).all())
            cut += int(full[n * BS + k, :S].sum() > m[n * BS + k, :S].sum())
    assert cut > 0, "the window must cut some context in this batch"


@pytest.mark.parametrize("window", [None, 5])
def test_flex_block_mask_materialises_to_the_dense_mask(window):
    """The BlockMask's mask_mod, evaluated element by element, is the dense mask (one rule, two kernels;
    the forward outputs are compared in test_drafter_model, forward only: no flex backward on CPU)."""
    from torch.nn.attention.flex_attention import create_mask

    pos = _packed([13, 9])
    doc = doc_ids_from_positions(pos)
    anchors = torch.tensor([[0, 3, 4, 9, 11, 14, 19, -1]])
    dense = dense_mask(anchors, doc, BS, window).dense
    bm = build_mask(anchors, doc, BS, "flex", window).block_mask
    assert torch.equal(create_mask(bm.mask_mod, 1, None, *dense.shape[-2:], device="cpu"), dense)


def test_decode_mask_is_the_training_rule_for_one_block_after_the_context():
    from dflash.drafter.blocks import decode_mask

    n, W = 7, 5
    m = decode_mask(n, BS, W, torch.device("cpu")).dense[0, 0]
    doc = torch.zeros(1, n + 1, dtype=torch.long)
    train = dense_mask(torch.tensor([[n]]), doc, BS, W).dense[0, 0]  # anchor n of an (n+1)-token row
    assert torch.equal(m[:, :n], train[:, :n]) and torch.equal(m[:, n:], train[:, n + 1 :])
    assert m[:, :n].sum(1).tolist() == [W - 1, W - 2, W - 3, W - 4]
