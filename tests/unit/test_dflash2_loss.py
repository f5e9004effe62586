"""DFlash2's selector loss and metrics in dflash_loss against a naive reference: full logits, explicit
loops over blocks and slots, the selector chain walked one slot at a time."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash.config import LossConfig
from dflash.drafter.arch import DrafterArch
from dflash.drafter.blocks import build_masks, make_blocks
from dflash.drafter.families import build_drafter
from dflash.drafter.objective import SELECTOR_SUMS, dflash_loss, prefix_accept, selector_coefficient
from dflash.targets.packing import doc_ids_from_positions

BS, V, H, K = 4, 60, 32, 5


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    arch = DrafterArch(
        hidden_size=H,
        intermediate_size=48,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        vocab_size=V,
        target_layer_ids=[0, 1],
        block_size=BS,
        mask_token_id=V - 1,
        family="dflash2",
        conv_group_size=8,
        selector_rank=6,
        selector_top_k=K,
    )
    model = build_drafter(arch).double()
    with torch.no_grad():  # off the identity init: edges and convolutions matter
        for m in model.family_modules():
            for p in m.parameters():
                p.add_(0.3 * torch.randn_like(p))
    pos = torch.cat([torch.arange(11), torch.arange(9)]).unsqueeze(0)
    S = pos.shape[1]
    ids = torch.randint(0, V - 1, (1, S))
    mask = torch.ones(1, S, dtype=torch.long)
    mask[0, [0, 1, 6, 11]] = 0
    aux = torch.randn(1, S, 2 * H, dtype=torch.float64)
    final = torch.randn(1, S, H, dtype=torch.float64)
    embed = torch.randn(V, H, dtype=torch.float64)
    head = torch.randn(V, H, dtype=torch.float64) * 0.3
    anchors = torch.tensor([[2, 3, 7, 9, 13, 17, -1]])
    _verifier_follows_the_chains(model, pos, ids, aux, final, embed, head, anchors)
    return model, pos, ids, mask, aux, final, embed, head, anchors


@torch.no_grad()
def _verifier_follows_the_chains(model, pos, ids, aux, final, embed, head, anchors) -> None:
    """Point the verifier rows (which the drafter never reads) at the chains' picks, block after block,
    so that chains run past slot 1 (overlapping blocks overwrite each other: some chains break)."""
    doc = doc_ids_from_positions(pos)
    blocks = make_blocks(ids, pos, doc, anchors, BS, V - 1)
    masks = build_masks(anchors, doc, BS, "sdpa", model.arch.layer_types, None)
    hidden = model(embed[blocks.block_ids], aux, pos, blocks.block_positions, masks)[0]
    for n, a in enumerate(anchors[0].tolist()):
        if a < 0:
            continue
        picks = model.propose(hidden[None, n * BS + 1 : (n + 1) * BS], ids[0, a : a + 1], head)[0]
        for k, tok in enumerate(picks.tolist(), start=1):
            if a + k < ids.shape[1]:
                final[0, a + k - 1] = 10 * head[tok]


def _naive(model, pos, ids, mask, aux, final, embed, head, anchors, cfg: LossConfig):
    """(selector loss sum, weight sum, recall, hits, chain tau vs data, chain tau vs verifier, unary tau
    vs verifier), from full logits and one-slot-at-a-time loops."""
    doc = doc_ids_from_positions(pos)
    blocks = make_blocks(ids, pos, doc, anchors, BS, V - 1)
    masks = build_masks(anchors, doc, BS, "sdpa", model.arch.layer_types, None)
    hidden = model(embed[blocks.block_ids], aux, pos, blocks.block_positions, masks)[0]
    sel = model.candidate_selector
    decay = torch.exp(-(torch.arange(BS, dtype=torch.float64) - 1) / cfg.gamma)
    loss = hidden.new_zeros(())
    weight = rows = recall = hits = 0.0
    taus_d, taus_v, taus_u = [], [], []
    for n, a in enumerate(anchors[0].tolist()):
        if a < 0:
            continue
        chain_d = chain_v = unary_v = True
        td = tv = tu = 1
        prev_chain_d, prev_chain_v = ids[0, a], ids[0, a]
        for k in range(1, BS):
            p = a + k
            ok = p < ids.shape[1] and doc[0, p] == doc[0, a] and mask[0, p] == 1
            if not ok:
                chain_d = chain_v = unary_v = False
                continue
            h = hidden[n * BS + k]
            logits = (h @ head.T).detach()
            verifier = int((final[0, p - 1] @ head.T).argmax())
            label = verifier if cfg.selector_label == "verifier" else int(ids[0, p])
            unary, cands = logits.topk(K)
            cands, unary = cands.clone(), unary.clone()
            present = bool((cands == label).any())
            rows += 1
            recall += present
            w = float(decay[k]) if cfg.selector_weighting == "base" else 1.0
            if not present and cfg.selector_missing == "inject":
                cands[-1], unary[-1] = label, logits[label]
            if present or cfg.selector_missing == "inject":
                u = sel.hidden_projection(h) * sel.predecessor_codebook[ids[0, p - 1]]
                scores = unary + sel.successor_codebook[cands] @ u
                idx = int((cands == label).nonzero()[0])
                loss = loss + w * (torch.logsumexp(scores, 0) - scores[idx])
                weight += w
            with torch.no_grad():  # the chain, walked with its own picks
                real_u, real_c = logits.topk(K)

                def pick(prev, h=h, real_u=real_u, real_c=real_c):
                    u = sel.hidden_projection(h) * sel.predecessor_codebook[prev]
                    return int(real_c[(real_u + sel.successor_codebook[real_c] @ u).argmax()])

                tf = pick(ids[0, p - 1])
                hits += tf == label
                prev_chain_d, prev_chain_v = pick(prev_chain_d), pick(prev_chain_v)
                chain_d = chain_d and prev_chain_d == int(ids[0, p])
                chain_v = chain_v and prev_chain_v == verifier
                unary_v = unary_v and int(logits.argmax()) == verifier
                td, tv, tu = td + chain_d, tv + chain_v, tu + unary_v
        taus_d.append(td)
        taus_v.append(tv)
        taus_u.append(tu)
    return loss, weight, rows, recall, hits, taus_d, taus_v, taus_u


def _run(setup, cfg, scale):
    model, pos, ids, mask, aux, final, embed, head, anchors = setup
    return dflash_loss(
        model, aux, final, ids, mask, anchors, embed, head, cfg, position_ids=pos, selector_scale=scale
    )


@pytest.mark.parametrize(
    "label,missing,weighting",
    [("data", "exclude", "base"), ("data", "inject", "uniform"), ("verifier", "inject", "base")],
)
def test_selector_loss_gradient_and_chain_metrics_equal_a_naive_reference(label, missing, weighting):
    setup = _setup()
    model = setup[0]
    cfg = LossConfig(selector_label=label, selector_missing=missing, selector_weighting=weighting)
    out = _run(setup, cfg, 0.7)
    alone = _run(setup, dataclasses.replace(cfg, ce=0.0), 0.7)  # the selector term alone (ce=0)
    naive_loss, weight, rows, recall, hits, taus_d, taus_v, taus_u = _naive(*setup, cfg)
    # the selector term is 0.7 * its weighted sum / the base loss's weight sum
    expected = 0.7 * naive_loss / out.weight_sum
    torch.testing.assert_close(alone.loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.loss - _run(setup, cfg, 0.0).loss, expected, rtol=1e-10, atol=1e-14)
    params = [p for p in model.parameters() if p.requires_grad]
    g_out = torch.autograd.grad(alone.loss, params, allow_unused=True)
    g_ref = torch.autograd.grad(expected, params, allow_unused=True)
    for a, b in zip(g_out, g_ref, strict=True):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-15)
    assert any(b is not None and b.abs().sum() > 0 for b in g_ref[-3:])  # the selector learns
    sums = dict(zip(SELECTOR_SUMS, out.selector_sums.tolist(), strict=True))
    assert (sums["rows"], sums["recall"], sums["hit"]) == (rows, recall, hits)
    assert sums["weight"] == pytest.approx(weight)
    assert 0 < recall < rows if label == "data" else recall == rows  # the verifier follows the chains
    # tau_hat of DFlash2 is its chain's: the walk with its own picks == the teacher-forced prefix
    assert out.tau_sum.item() == sum(taus_d) and out.tau_verifier_sum.item() == sum(taus_v)
    assert out.inv_tau_verifier_sum.item() == pytest.approx(sum(1 / t for t in taus_v))
    assert sums["inv_tau_unary"] == pytest.approx(sum(1 / t for t in taus_u))
    assert max(taus_v) > 1 or max(taus_d) > 1


def test_selector_coefficient_warms_up_linearly():
    cfg = LossConfig(selector=0.5, selector_warmup_steps=4)
    assert [selector_coefficient(cfg, s) for s in range(6)] == [0.125, 0.25, 0.375, 0.5, 0.5, 0.5]
    assert selector_coefficient(LossConfig(selector=0.5), 0) == 0.5


def test_prefix_accept_is_the_chain_acceptance():
    hits = torch.tensor([[False, True, True, False], [False, False, True, True]])
    assert prefix_accept(hits).tolist() == [3, 1]
