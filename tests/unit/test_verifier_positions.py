"""The verifier's work once per position (``verifier_loss(verifier_index=...)``, what ``dflash_loss``
runs) against the per-row path (each row its own verifier row, as the loss computed it before) and
a float64 materialising reference, on the rows of real blocks: packed documents, overlapping
blocks, a block cut by a document end, padding blocks and weight-0 rows."""

from __future__ import annotations

import pytest
import torch
from test_objective import _setup
from test_verifier_loss import _reference

import dflash.loss.verifier as verifier_module
from dflash.config import LossConfig
from dflash.drafter.blocks import label_slots
from dflash.drafter.objective import dflash_loss, slot_weights, supervised_positions, supervised_slots
from dflash.loss.dpace import dpace_weights
from dflash.loss.verifier import verifier_loss
from dflash.targets.packing import doc_ids_from_positions

BS, V, H = 5, 300, 24
RECIPES = {
    "ce": dict(ce=1.0),
    "ce_kl": dict(ce=1.0, kl=1.0),
    "ce_kl_t2": dict(ce=1.0, kl=0.5, temperature=2.0),
    "verifier_ce": dict(ce=0.0, verifier_ce=1.0),
    "dpace": dict(ce=1.0),
}


def _rows(dtype: torch.dtype, seed: int = 0):
    """Supervised rows of 3 packed documents (lengths 17, 9, 22) with 13 blocks of 5 slots, some
    overlapping, one cut by a document end, 2 padding blocks; 3 rows get weight 0."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(17), torch.arange(9), torch.arange(22)]).unsqueeze(0)
    S = pos.shape[1]
    anchors = torch.tensor([[0, 1, 2, 5, 9, 14, 17, 19, 26, 27, 30, 31, 40, -1, -1]])
    mask = torch.ones(1, S, dtype=torch.long)
    mask[0, [0, 3, 17, 27]] = 0
    docs = doc_ids_from_positions(pos)
    label_pos, valid = label_slots(docs, anchors, BS)
    sup = supervised_slots(label_pos, valid, mask).view(-1)
    index = (label_pos.view(-1) - 1)[sup]  # row order: block after block, as the loss receives them
    r = index.numel()
    w_head = (torch.randn(V, H, generator=g) * (3.0 / H**0.5)).to(dtype)
    final = torch.randn(S, H, generator=g).to(dtype)
    h_d = torch.randn(r, H, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (r,), generator=g)
    weights = slot_weights(BS, 3.0, torch.device("cpu"), dtype).expand(sup.numel() // BS, BS).reshape(-1)[sup]
    weights = weights.clone()
    weights[[4, 11, 30]] = 0
    return h_d, final, w_head, labels, weights, index, sup


def _dpace(sup: torch.Tensor):
    """D-PACE multipliers of the rows (their losses scattered back into their blocks)."""

    def reweight(losses: torch.Tensor) -> torch.Tensor:
        slots = torch.zeros(sup.numel(), dtype=losses.dtype)
        slots[sup] = losses
        return dpace_weights(slots.view(-1, BS), sup.view(-1, BS), 0.4).view(-1)[sup]

    return reweight


def _call(h_d, h_v, w_head, labels, weights, sup, recipe, index=None, chunk_size=None):
    mix = dict(RECIPES[recipe])
    reweight = _dpace(sup) if recipe == "dpace" else None
    return verifier_loss(
        h_d,
        h_v,
        w_head,
        labels,
        weights,
        chunk_size=chunk_size,
        verifier_index=index,
        reweight=reweight,
        **mix,
    )


def _check_against_per_row(recipe: str, chunk_size: int | None) -> None:
    """fp32: per position equals per row (loss, gradient at 1e-6 relative; argmaxes, hits exactly)."""
    h_d, final, w_head, labels, weights, index, sup = _rows(torch.float32)
    per_row = _call(h_d, final[index], w_head, labels, weights, sup, recipe, chunk_size=chunk_size)
    (g_row,) = torch.autograd.grad(per_row.loss, h_d)
    shared = _call(h_d, final, w_head, labels, weights, sup, recipe, index=index, chunk_size=chunk_size)
    (g,) = torch.autograd.grad(shared.loss, h_d)
    torch.testing.assert_close(shared.loss, per_row.loss, rtol=1e-6, atol=0)
    assert (g - g_row).norm() <= 1e-6 * g_row.norm()
    for name in ("verifier_argmax", "drafter_argmax", "verifier_hit", "data_hit"):
        assert torch.equal(getattr(shared.stats, name), getattr(per_row.stats, name)), name
    assert shared.stats.terms.keys() == per_row.stats.terms.keys() >= {"kl", "verifier_ce"}
    for name, value in per_row.stats.terms.items():
        torch.testing.assert_close(shared.stats.terms[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("chunk_size", [7, 16, None])  # 7, 16: positions straddle chunk boundaries
def test_per_position_equals_per_row_in_float32(recipe, chunk_size):
    _check_against_per_row(recipe, chunk_size)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_per_position_equals_a_float64_reference(recipe):
    h_d, final, w_head, labels, weights, index, sup = _rows(torch.float64)
    mix = dict(RECIPES[recipe])
    base = weights
    if recipe == "dpace":  # the multipliers from the reference's own losses, a constant for the gradient
        ce = _reference(h_d, None, w_head, labels, weights, ce=1.0)["ce"]
        base = weights * _dpace(sup)(torch.where(weights > 0, ce, 0.0))
    ref = _reference(h_d, final[index], w_head, labels, base, **mix)
    (g_ref,) = torch.autograd.grad(ref["loss"], h_d)
    out = _call(h_d, final, w_head, labels, weights, sup, recipe, index=index, chunk_size=9)
    (g,) = torch.autograd.grad(out.loss, h_d)
    torch.testing.assert_close(out.loss, ref["loss"], rtol=1e-10, atol=0)
    assert (g - g_ref).norm() <= 1e-10 * g_ref.norm()
    keep = weights > 0
    assert torch.equal(out.stats.verifier_argmax[keep], ref["verifier_argmax"][keep])


def test_a_row_given_another_positions_verifier_row_fails_the_check(monkeypatch):
    """The injected fault: one row of each chunk reads its neighbour position's verifier softmax and
    stats. The float32 comparison with the per-row path catches it."""
    plan = verifier_module._Positions.plan.__func__

    def shifted(cls, index, chunk, device):
        got = plan(cls, index, chunk, device)
        for c, (u0, u1) in enumerate(got.bounds):
            if u1 - u0 > 1:
                row = c * chunk
                got.local[row] = (got.local[row] + 1) % (u1 - u0)
        return got

    _check_against_per_row("ce_kl", 16)  # passes unfaulted
    monkeypatch.setattr(verifier_module._Positions, "plan", classmethod(shifted))
    with pytest.raises(AssertionError):
        _check_against_per_row("ce_kl", 16)
    with pytest.raises(AssertionError):
        _check_against_per_row("ce", 16)  # the CE recipe: its metrics (verifier argmax, KL) change


def test_rows_out_of_position_order_are_sorted_and_their_gradients_go_back():
    h_d, final, w_head, labels, weights, index, sup = _rows(torch.float64)
    perm = torch.randperm(index.numel(), generator=torch.Generator().manual_seed(3))
    mix = dict(ce=0.5, kl=1.0, verifier_ce=0.25)
    ref = _reference(h_d, final[index], w_head, labels, weights, **mix)
    (g_ref,) = torch.autograd.grad(ref["loss"], h_d)
    x = h_d.detach()[perm].requires_grad_()
    out = verifier_loss(x, final, w_head, labels[perm], weights[perm], verifier_index=index[perm], **mix)
    (g,) = torch.autograd.grad(out.loss, x)
    torch.testing.assert_close(out.loss, ref["loss"], rtol=1e-10, atol=0)
    torch.testing.assert_close(g, g_ref[perm], rtol=1e-9, atol=1e-14)
    assert torch.equal(
        out.stats.verifier_argmax[weights[perm] > 0], ref["verifier_argmax"][perm][weights[perm] > 0]
    )


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(verifier_index=torch.zeros(3, dtype=torch.int64)), "verifier_index must be"),
        (dict(verifier_index="index_float"), "integer"),
        (dict(verifier_index="index_high"), r"\[0, P="),
        (dict(verifier_hidden=None, ce=1.0), "verifier_index needs verifier_hidden"),
        (dict(verifier_hidden="final_wide"), "verifier_hidden must be"),
    ],
)
def test_bad_verifier_index_is_named(over, match):
    h_d, final, w_head, labels, weights, index, _ = _rows(torch.float64)
    named = {
        "index_float": index.double(),
        "index_high": torch.full_like(index, final.shape[0]),
        "final_wide": torch.randn(final.shape[0], H + 1, dtype=torch.float64),
    }
    args = dict(verifier_hidden=final, verifier_index=index, kl=1.0)
    args.update({k: named.get(v, v) if isinstance(v, str) else v for k, v in over.items()})
    if args["verifier_hidden"] is None:
        args.pop("kl")
    with pytest.raises(ValueError, match=match):
        verifier_loss(h_d, lm_head_weight=w_head, labels=labels, weights=weights, **args)


def test_dflash_loss_checks_the_hosts_verifier_positions():
    """The trainer's host copy of the rows' positions is asserted against the device's: a packet
    whose host copy disagrees (a host bug) fails instead of training on the wrong rows."""
    model, pos, ids, mask, aux, final, embed, head, anchors = _setup()
    args = (model, aux, final, ids, mask, anchors, embed, head, LossConfig(kl=0.5, chunk_size=5))
    host = supervised_positions(mask, doc_ids_from_positions(pos), anchors, model.block_size)
    good = dflash_loss(*args, position_ids=pos, num_rows=host.numel(), verifier_positions=host)
    plain = dflash_loss(*args, position_ids=pos)
    torch.testing.assert_close(good.loss, plain.loss, rtol=1e-12, atol=0)
    wrong = host.clone()
    wrong[2] += 1
    with pytest.raises(RuntimeError, match="verifier_positions"):
        dflash_loss(*args, position_ids=pos, num_rows=host.numel(), verifier_positions=wrong)
    with pytest.raises(ValueError, match="verifier_positions has"):
        dflash_loss(*args, position_ids=pos, num_rows=host.numel(), verifier_positions=host[1:])
