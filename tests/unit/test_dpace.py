"""D-PACE (``loss.dpace``): its weights against closed forms, the chunked loss with them against an
independent float64 reference that materialises the logits (value and gradient), and the objective
that trains with it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash.loss.dpace import dpace_weights
from dflash.loss.verifier import verifier_loss


def _ref_weights(losses: list[list[float]], sup: list[list[bool]], a: float) -> list[list[float]]:
    """The paper's definition, slot by slot in plain Python (float64)."""
    out = []
    for ls, ss in zip(losses, sup, strict=True):
        c, reach = 1.0, []
        for j, (loss, s) in enumerate(zip(ls, ss, strict=True)):
            if j > 0 and s:
                c *= (1 - a) * math.exp(-loss) + a
            reach.append(c if j > 0 and s else 0.0)
        out.append([sum(reach[j:]) if j > 0 and ss[j] else 0.0 for j in range(len(ls))])
    return out


def test_a_equal_1_counts_the_supervised_slots_to_the_block_end():
    sup = torch.tensor([[False, True, True, True, True], [False, True, False, True, False]])
    w = dpace_weights(torch.rand(2, 5, dtype=torch.float64) * 3, sup, 1.0)
    assert w.tolist() == [[0, 4, 3, 2, 1], [0, 2, 0, 1, 0]]


def test_a_hand_computed_three_slot_block_and_an_unsupervised_slot():
    losses = torch.tensor([[9.0, math.log(2), math.log(4), 0.0]], dtype=torch.float64)
    # q = 0.5, 0.25, 1 -> smoothed 0.75, 0.625, 1 -> C = 0.75, 0.46875, 0.46875
    w = dpace_weights(losses, torch.tensor([[False, True, True, True]]), 0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.6875, 0.9375, 0.46875]], dtype=torch.float64))
    # slot 2 unsupervised: it counts 1 in the product and is left out of the sums
    w = dpace_weights(losses, torch.tensor([[False, True, False, True]]), 0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.5, 0.0, 0.75]], dtype=torch.float64))


def test_weights_equal_the_slot_by_slot_definition_and_need_a_in_range():
    g = torch.Generator().manual_seed(0)
    losses = torch.rand(6, 8, generator=g, dtype=torch.float64) * 4
    sup = torch.rand(6, 8, generator=g) > 0.3
    for a in (0.05, 0.5, 1.0):
        ref = _ref_weights(losses.tolist(), sup.tolist(), a)
        torch.testing.assert_close(dpace_weights(losses, sup, a), torch.tensor(ref, dtype=torch.float64))
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="a must be in"):
            dpace_weights(losses, sup, bad)


BS, G, V, H = 5, 9, 300, 32


def _case(seed: int = 0):
    """R supervised rows of G blocks of BS slots (slot 0 never), their hidden states and labels."""
    g = torch.Generator().manual_seed(seed)
    sup = torch.rand(G, BS, generator=g) > 0.25
    sup[:, 0] = False
    rows = sup.view(-1).nonzero().squeeze(1)
    r = rows.numel()
    w_head = torch.randn(V, H, generator=g, dtype=torch.float64) * (3.0 / H**0.5)
    h_d = torch.randn(r, H, generator=g, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, V, (r,), generator=g)
    return sup, rows, w_head, h_d, labels


def _reweight(sup: torch.Tensor, rows: torch.Tensor, a: float):
    def fn(losses: torch.Tensor) -> torch.Tensor:
        slots = torch.zeros(sup.numel(), dtype=losses.dtype)
        slots[rows] = losses
        return dpace_weights(slots.view(sup.shape), sup, a).view(-1)[rows]

    return fn


def _reference(sup, rows, w_head, h_d, labels, a: float, normalizer: str) -> torch.Tensor:
    """Materialised logits, per-slot CE, the weights by the slot-by-slot definition (detached)."""
    ce = -F.log_softmax(h_d @ w_head.t(), 1).gather(1, labels[:, None]).squeeze(1)
    slots = torch.zeros(sup.numel(), dtype=torch.float64)
    slots[rows] = ce.detach()
    w = torch.tensor(_ref_weights(slots.view(sup.shape).tolist(), sup.tolist(), a)).view(-1)[rows]
    return (w * ce).sum() / (w.sum() if normalizer == "sum" else float(rows.numel()))


@pytest.mark.parametrize("normalizer", ["sum", "count"])
@pytest.mark.parametrize("chunk_size", [4, None])
def test_the_chunked_loss_with_dpace_is_exact_in_value_and_gradient(normalizer, chunk_size):
    sup, rows, w_head, h_d, labels = _case()
    ref = _reference(sup, rows, w_head, h_d, labels, 0.5, normalizer)
    (g_ref,) = torch.autograd.grad(ref, h_d)
    out = verifier_loss(
        h_d,
        None,
        w_head,
        labels,
        torch.ones(rows.numel(), dtype=torch.float64),
        chunk_size=chunk_size,
        reweight=_reweight(sup, rows, 0.5),
        reweight_normalizer=normalizer,
    )
    (g,) = torch.autograd.grad(out.loss, h_d)
    assert abs(out.loss.item() / ref.item() - 1) <= 1e-6
    assert ((g - g_ref).norm() / g_ref.norm()).item() <= 1e-6
    plain = verifier_loss(h_d, None, w_head, labels, torch.ones(rows.numel(), dtype=torch.float64))
    assert abs(plain.loss.item() - out.loss.item()) > 1e-3  # the weights change the loss


def test_a_fixed_normalizer_and_dropped_rows_keep_the_reweighted_loss_exact():
    """The trainer passes normalizer=1 and divides by the global weight sum, which it gets back as
    ``weight_sum``; rows of weight 0 are dropped before the GEMMs and weigh 0 after."""
    sup, rows, w_head, h_d, labels = _case(1)
    base = torch.ones(rows.numel(), dtype=torch.float64)
    base[::5] = 0.0
    sup_kept = sup.clone().view(-1)
    sup_kept[rows[::5]] = False
    sup_kept = sup_kept.view(sup.shape)
    ref = _reference(sup_kept, rows[base > 0], w_head, h_d[base > 0], labels[base > 0], 0.3, "sum")
    out = verifier_loss(
        h_d, None, w_head, labels, base, normalizer=1.0, reweight=_reweight(sup_kept, rows, 0.3)
    )
    assert out.weight_sum is not None
    assert abs(out.loss.item() / out.weight_sum.item() / ref.item() - 1) <= 1e-6
    (g,) = torch.autograd.grad(out.loss, h_d)
    assert g[base == 0].abs().max() == 0
