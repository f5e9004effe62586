"""dflash_loss against a per-block naive reference (full logits, explicit loops)."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.config import LossConfig
from dflash.drafter.arch import DrafterArch
from dflash.drafter.blocks import build_masks, make_blocks
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.objective import dflash_loss, prefix_accept
from dflash.targets.packing import doc_ids_from_positions

BS, V, H = 4, 60, 32


def _setup(**layout):
    torch.manual_seed(0)
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
        **layout,
    )
    model = DFlashDraftModel(arch).double()
    pos = torch.cat([torch.arange(11), torch.arange(9)]).unsqueeze(0)
    S = pos.shape[1]
    ids = torch.randint(0, V - 1, (1, S))
    mask = torch.ones(1, S, dtype=torch.long)
    mask[0, [0, 1, 6, 11]] = 0
    aux = torch.randn(1, S, 2 * H, dtype=torch.float64)
    final = torch.randn(1, S, H, dtype=torch.float64)
    embed = torch.randn(V, H, dtype=torch.float64)
    head = torch.randn(V, H, dtype=torch.float64) * 0.3
    anchors = torch.tensor([[2, 3, 7, 9, 13, 17, -1]])  # overlapping blocks, one near a document end, padding
    return model, pos, ids, mask, aux, final, embed, head, anchors


def _drafter_hidden(model, pos, ids, doc, anchors, embed, aux):
    """The drafter's final hidden of every block slot, [1, N * BS, H] (SDPA masks)."""
    blocks = make_blocks(ids, pos, doc, anchors, BS, V - 1)
    return model(
        embed[blocks.block_ids],
        aux,
        pos,
        blocks.block_positions,
        build_masks(anchors, doc, BS, "sdpa", model.arch.layer_types, model.arch.sliding_window),
    )


@pytest.mark.parametrize(
    "layout",
    [{}, dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)],
    ids=["full", "mixed"],
)
def test_loss_terms_stats_and_tau_equal_a_naive_reference(layout):
    model, pos, ids, mask, aux, final, embed, head, anchors = _setup(**layout)
    cfg = LossConfig(ce=1.0, kl=0.5, verifier_ce=0.25, temperature=2.0, gamma=3.0, chunk_size=5)
    out = dflash_loss(model, aux, final, ids, mask, anchors, embed, head, cfg, position_ids=pos)

    doc = doc_ids_from_positions(pos)
    hidden = _drafter_hidden(model, pos, ids, doc, anchors, embed, aux)
    num = den = 0.0
    taus, taus_v = [], []
    slot_hits = [0] * BS
    for n, a in enumerate(anchors[0].tolist()):
        hits, hits_v = [False] * BS, [False] * BS
        for k in range(1, BS):
            p = a + k
            if a < 0 or p >= ids.shape[1] or doc[0, p] != doc[0, a] or not mask[0, p]:
                continue
            w = math.exp(-(k - 1) / cfg.gamma)
            z = head @ hidden[0, n * BS + k]
            zv = head @ final[0, p - 1]  # the verifier row of slot k is position a + k - 1
            logq = torch.log_softmax(z, -1)
            ce = -logq[ids[0, p]]
            vce = -logq[zv.argmax()]
            pT, logqT = torch.softmax(zv / cfg.temperature, -1), torch.log_softmax(z / cfg.temperature, -1)
            kl = cfg.temperature**2 * (pT * (pT.log() - logqT)).sum()
            num += w * (cfg.ce * ce + cfg.kl * kl + cfg.verifier_ce * vce)
            den += w
            hits[k] = bool(z.argmax() == ids[0, p])
            hits_v[k] = bool(z.argmax() == zv.argmax())
            slot_hits[k] += hits[k]
        if a >= 0:
            taus.append(int(prefix_accept(torch.tensor(hits))))
            taus_v.append(int(prefix_accept(torch.tensor(hits_v))))
    ref = num / den
    torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=0)
    torch.testing.assert_close(out.weight_sum, torch.tensor(den, dtype=torch.float64), rtol=1e-12, atol=0)
    assert out.slot_hit.tolist() == [float(h) for h in slot_hits]
    assert (
        float(out.num_blocks) == 6
        and float(out.tau_sum) == sum(taus)
        and float(out.tau_verifier_sum) == sum(taus_v)
    )
    assert math.isclose(float(out.inv_tau_verifier_sum), sum(1 / t for t in taus_v), rel_tol=1e-12)
    g_out = torch.autograd.grad(out.loss, list(model.parameters()))
    g_ref = torch.autograd.grad(ref, list(model.parameters()))
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("normalizer", ["sum", "count"])
def test_dpace_weights_each_block_by_its_own_losses_as_a_naive_reference_does(normalizer):
    """loss.dpace: per block, q_k = exp(-CE_k) of the supervised slots, C_k = prod (1-a) q_i + a,
    w_k = sum_{m>=k} C_m (detached), the loss sum w CE / sum w (or / the slot count), no decay."""
    model, pos, ids, mask, aux, final, embed, head, anchors = _setup()
    a = 0.4
    cfg = LossConfig(dpace=a, dpace_normalizer=normalizer, chunk_size=5)
    out = dflash_loss(model, aux, final, ids, mask, anchors, embed, head, cfg, position_ids=pos)
    doc = doc_ids_from_positions(pos)
    hidden = _drafter_hidden(model, pos, ids, doc, anchors, embed, aux)
    num, den, count = 0.0, 0.0, 0
    for n, anchor in enumerate(anchors[0].tolist()):
        ces, reach = {}, 1.0
        for k in range(1, BS):
            p = anchor + k
            if anchor < 0 or p >= ids.shape[1] or doc[0, p] != doc[0, anchor] or not mask[0, p]:
                continue
            ces[k] = -torch.log_softmax(head @ hidden[0, n * BS + k], -1)[ids[0, p]]
        c = {}
        for k in range(1, BS):
            if k in ces:
                reach *= (1 - a) * math.exp(-float(ces[k].detach())) + a
                c[k] = reach
        for k, ce in ces.items():
            w = sum(v for m, v in c.items() if m >= k)
            num, den, count = num + w * ce, den + w, count + 1
    ref = num / (den if normalizer == "sum" else count)
    torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=0)
    assert float(out.base_weight_sum) == count == float(out.slot_count.sum())
    assert math.isclose(float(out.weight_sum), den if normalizer == "sum" else count, rel_tol=1e-12)
    g_out = torch.autograd.grad(out.loss, list(model.parameters()))
    g_ref = torch.autograd.grad(ref, list(model.parameters()))
    for x, y in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-8, atol=1e-12)


def test_prefix_accept_counts_the_leading_run_of_hits():
    hits = torch.tensor(
        [[False, True, True, False, True], [True, False, True, True, True], [False, True, True, True, True]]
    )
    assert prefix_accept(hits).tolist() == [3, 1, 5]  # slot 0 is the given token and is ignored


@pytest.mark.parametrize(
    "layout",
    [{}, dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)],
    ids=["full", "mixed"],
)
def test_layer_checkpointing_gives_the_same_loss_and_gradients(layout):
    """drafter.activation_checkpointing=layers: each layer recomputes its forward in backward; the loss
    and every gradient equal the plain step's (fp32, to 1e-6), and the layers do run twice."""
    model, pos, ids, mask, aux, final, embed, head, anchors = _setup(**layout)
    model = model.float()
    cfg = LossConfig(ce=1.0, kl=0.5, chunk_size=5)
    runs = []
    for checkpoint in (False, True):
        model.zero_grad(set_to_none=True)
        model.checkpoint_layers = checkpoint
        calls = []
        hook = model.layers[0].register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        out = dflash_loss(
            model,
            aux.float(),
            final.float(),
            ids,
            mask,
            anchors,
            embed.float(),
            head.float(),
            cfg,
            position_ids=pos,
        )
        out.loss.backward()
        hook.remove()
        runs.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)))
    (loss, grads, calls), (loss_ck, grads_ck, calls_ck) = runs
    assert (calls, calls_ck) == (1, 2)
    torch.testing.assert_close(loss_ck, loss, rtol=0, atol=1e-6)
    assert grads.keys() == grads_ck.keys() and all(g.abs().sum() > 0 for g in grads.values())
    for name in grads:
        torch.testing.assert_close(grads_ck[name], grads[name], rtol=0, atol=1e-6, msg=name)
