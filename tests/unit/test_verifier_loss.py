"""Chunked verifier-logit loss (dflash.loss.verifier) against a materialising reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.loss.kernels import block_math, block_math_exp2, max_argmax, position_math, position_math_exp2
from dflash.loss.verifier import VerifierLossOutput, default_chunk_size, verifier_loss
from dflash.loss.workspace import release_workspace

R, V, H = 37, 1000, 64


def _inputs(dtype=torch.float64, seed=0, r=R, v=V, h=H, logit_std=3.0, zero_rows=(3, 4, 5, 6, 7, 8, 20)):
    g = torch.Generator().manual_seed(seed)
    w_head = (torch.randn(v, h, generator=g) * (logit_std / h**0.5)).to(dtype)
    h_d = torch.randn(r, h, generator=g).to(dtype).requires_grad_()
    h_v = torch.randn(r, h, generator=g).to(dtype)
    labels = torch.randint(0, v, (r,), generator=g)
    weights = torch.rand(r, generator=g).to(dtype) + 0.1
    weights[list(zero_rows)] = 0
    return h_d, h_v, w_head, labels, weights


def _reference(h_d, h_v, w_head, labels, weights, ce=1.0, kl=0.0, verifier_ce=0.0, temperature=1.0):
    """Full logits, log_softmax and autograd (the materialising path)."""
    zd = h_d @ w_head.t()
    logq = F.log_softmax(zd, 1)
    per_row = ce * -logq.gather(1, labels.clamp(0, w_head.shape[0] - 1)[:, None]).squeeze(1)
    out = {
        "ce": -logq.gather(1, labels.clamp(0, w_head.shape[0] - 1)[:, None]).squeeze(1).detach(),
        "drafter_argmax": zd.argmax(1),
    }
    if h_v is not None:
        zv = h_v @ w_head.t()
        av = zv.argmax(1)
        t = temperature
        logp_t = F.log_softmax(zv / t, 1)
        kl_r = t * t * (logp_t.exp() * (logp_t - F.log_softmax(zd / t, 1))).sum(1)
        vce_r = -logq.gather(1, av[:, None]).squeeze(1)
        per_row = per_row + kl * kl_r + verifier_ce * vce_r
        out.update(kl=kl_r.detach(), verifier_ce=vce_r.detach(), verifier_argmax=av)
    out["loss"] = (weights * per_row).sum() / weights.sum()
    return out


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


MIXES = [
    dict(ce=1.0),
    dict(ce=0.0, kl=1.0),
    dict(ce=0.0, verifier_ce=1.0),
    dict(ce=1.0, kl=1.0),
    dict(ce=0.3, kl=0.7, verifier_ce=0.5),
    dict(ce=0.3, kl=0.7, verifier_ce=0.5, temperature=2.5),
    dict(ce=0.0, kl=1.3, temperature=0.6),
    dict(ce=0.0, kl=1.0, verifier_ce=0.4, temperature=1.7),
]


@pytest.mark.parametrize("mix", MIXES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("chunk_size", [1, 7, R, 100, None])
def test_float64_matches_reference(mix, chunk_size):
    h_d, h_v, w_head, labels, weights = _inputs()
    ref = _reference(h_d, h_v, w_head, labels, weights, **mix)
    (g_ref,) = torch.autograd.grad(ref["loss"] * 3.7, h_d)
    out = verifier_loss(h_d, h_v, w_head, labels, weights, chunk_size=chunk_size, **mix)
    assert isinstance(out, VerifierLossOutput)
    assert out.loss.dtype == torch.float64 and out.loss.dim() == 0
    (g,) = torch.autograd.grad(out.loss * 3.7, h_d)
    assert abs(out.loss.item() - ref["loss"].item()) <= 1e-9 * abs(ref["loss"].item())
    assert _rel(g, g_ref) <= 1e-9
    assert g[weights == 0].abs().max() == 0


def test_float64_row_blocks_and_all_zero_chunk():
    h_d, h_v, w_head, labels, weights = _inputs(zero_rows=range(8, 24))  # rows 8..23: whole chunks of 8
    mix = dict(ce=0.5, kl=1.0, verifier_ce=0.25, temperature=1.5)
    ref = _reference(h_d, h_v, w_head, labels, weights, **mix)
    (g_ref,) = torch.autograd.grad(ref["loss"], h_d)
    for chunk_size, row_block in [(8, 1), (8, 3), (5, 2), (1000, 1000)]:
        out = verifier_loss(
            h_d, h_v, w_head, labels, weights, chunk_size=chunk_size, row_block=row_block, **mix
        )
        (g,) = torch.autograd.grad(out.loss, h_d)
        assert abs(out.loss.item() - ref["loss"].item()) <= 1e-9 * abs(ref["loss"].item())
        assert _rel(g, g_ref) <= 1e-9


def test_independent_of_chunk_size():
    h_d, h_v, w_head, labels, weights = _inputs()
    mix = dict(ce=1.0, kl=0.5, verifier_ce=0.2, temperature=1.3)
    outs = []
    for cs in (1, 2, 7, 16, R, 1000):
        o = verifier_loss(h_d, h_v, w_head, labels, weights, chunk_size=cs, **mix)
        (g,) = torch.autograd.grad(o.loss, h_d)
        outs.append((o, g))
    o0, g0 = outs[0]
    for o, g in outs[1:]:
        assert abs(o.loss.item() - o0.loss.item()) <= 1e-12 * abs(o0.loss.item())
        assert _rel(g, g0) <= 1e-12
        assert torch.equal(o.stats.drafter_argmax, o0.stats.drafter_argmax)
        assert torch.equal(o.stats.verifier_argmax, o0.stats.verifier_argmax)
        assert torch.allclose(o.stats.terms["kl"], o0.stats.terms["kl"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "mix", [dict(ce=1.0), dict(ce=1.0, kl=1.0), dict(ce=0.2, kl=1.0, verifier_ce=0.3, temperature=2.0)]
)
@pytest.mark.parametrize("chunk_size", [5, None])
def test_float32_matches_float64_reference(mix, chunk_size):
    h_d, h_v, w_head, labels, weights = _inputs(dtype=torch.float32)
    h64 = h_d.detach().double().requires_grad_()
    ref = _reference(h64, h_v.double(), w_head.double(), labels, weights.double(), **mix)
    (g_ref,) = torch.autograd.grad(ref["loss"], h64)
    out = verifier_loss(h_d, h_v, w_head, labels, weights, chunk_size=chunk_size, **mix)
    assert out.loss.dtype == torch.float32
    (g,) = torch.autograd.grad(out.loss, h_d)
    assert g.dtype == torch.float32
    assert abs(out.loss.item() - ref["loss"].item()) <= 1e-5 * abs(ref["loss"].item())
    assert _rel(g.double(), g_ref) <= 1e-5


def test_float32_large_logits_match_reference():
    """Logit std ~30: row maxima outside the no-shift range of the exp2 path."""
    h_d, h_v, w_head, labels, weights = _inputs(dtype=torch.float32, logit_std=30.0)
    h64 = h_d.detach().double().requires_grad_()
    mix = dict(ce=1.0, kl=1.0, verifier_ce=0.5)
    ref = _reference(h64, h_v.double(), w_head.double(), labels, weights.double(), **mix)
    (g_ref,) = torch.autograd.grad(ref["loss"], h64)
    out = verifier_loss(h_d, h_v, w_head, labels, weights, chunk_size=5, **mix)
    (g,) = torch.autograd.grad(out.loss, h_d)
    assert abs(out.loss.item() - ref["loss"].item()) <= 1e-5 * abs(ref["loss"].item())
    assert _rel(g.double(), g_ref) <= 1e-5


def test_bf16_smoke_large_logits():
    """bf16 inputs with logit std ~30 (``rand`` inputs hide bf16 logit rounding, Liger #1432)."""
    h_d, h_v, w_head, labels, weights = _inputs(
        dtype=torch.float32, r=24, v=512, h=32, logit_std=30.0, zero_rows=(2,)
    )
    hb, vb, wb = h_d.detach().bfloat16().requires_grad_(), h_v.bfloat16(), w_head.bfloat16()
    mix = dict(ce=1.0, kl=1.0, verifier_ce=0.5)
    # reference: fp64 math on the bf16-rounded inputs
    h64 = hb.detach().double().requires_grad_()
    ref = _reference(h64, vb.double(), wb.double(), labels, weights.double(), **mix)
    (g_ref,) = torch.autograd.grad(ref["loss"], h64)
    out = verifier_loss(hb, vb, wb, labels, weights, chunk_size=7, **mix)
    assert out.loss.dtype == torch.float32
    (g,) = torch.autograd.grad(out.loss, hb)
    assert g.dtype == torch.bfloat16
    assert abs(out.loss.item() - ref["loss"].item()) <= 1e-4 * abs(ref["loss"].item())
    assert _rel(g.double(), g_ref) <= 1e-2  # bf16 rounding of dh itself
    keep = weights > 0
    assert torch.equal(out.stats.verifier_argmax[keep], ref["verifier_argmax"][keep])


def test_grad_output_and_backward_through_graph():
    h_d, h_v, w_head, labels, weights = _inputs()
    mix = dict(ce=1.0, kl=0.5)
    ref = _reference(h_d, h_v, w_head, labels, weights, **mix)
    (g_ref,) = torch.autograd.grad((ref["loss"] * 3.7 + 1.0) ** 2, h_d)
    x = h_d.detach().clone().requires_grad_()
    hd_graph = x * 1.0  # non-leaf input
    out = verifier_loss(hd_graph, h_v, w_head, labels, weights, chunk_size=6, **mix)
    ((out.loss * 3.7 + 1.0) ** 2).backward()
    assert _rel(x.grad, g_ref) <= 1e-9


def test_stats_match_reference():
    h_d, h_v, w_head, labels, weights = _inputs()
    labels[0] = (h_d[0] @ w_head.t()).argmax()  # one guaranteed data hit
    for temperature in (1.0, 2.0):
        mix = dict(ce=1.0, kl=1.0, verifier_ce=0.5, temperature=temperature)
        ref = _reference(h_d, h_v, w_head, labels, weights, **mix)
        out = verifier_loss(h_d, h_v, w_head, labels, weights, chunk_size=6, **mix)
        st = out.stats
        keep = weights > 0
        assert st.drafter_argmax.dtype == torch.int64 and st.drafter_argmax.shape == (R,)
        assert torch.equal(st.drafter_argmax[keep], ref["drafter_argmax"][keep])
        assert torch.equal(st.verifier_argmax[keep], ref["verifier_argmax"][keep])
        assert (st.drafter_argmax[~keep] == -1).all() and (st.verifier_argmax[~keep] == -1).all()
        assert torch.equal(st.data_hit, keep & (ref["drafter_argmax"] == labels))
        assert torch.equal(st.verifier_hit, keep & (ref["drafter_argmax"] == ref["verifier_argmax"]))
        assert st.data_hit[0]
        assert st.data_hit.dtype == torch.bool and st.verifier_hit.dtype == torch.bool
        for name in ("kl", "ce", "verifier_ce"):
            val = st.terms[name]
            assert not val.requires_grad
            torch.testing.assert_close(val[keep], ref[name][keep], rtol=1e-9, atol=1e-12)
            assert (val[~keep] == 0).all()
            wmean = (weights * ref[name]).sum() / weights.sum()
            torch.testing.assert_close(out.terms[name], wmean, rtol=1e-9, atol=1e-12)
        assert out.weight_sum.item() == pytest.approx(weights.sum().item())


def test_kl_stat_computed_when_kl_coefficient_is_zero():
    h_d, h_v, w_head, labels, weights = _inputs()
    ref = _reference(h_d, h_v, w_head, labels, weights, ce=1.0, kl=0.0, temperature=1.5)
    out = verifier_loss(h_d, h_v, w_head, labels, weights, ce=1.0, temperature=1.5)
    keep = weights > 0
    torch.testing.assert_close(out.stats.terms["kl"][keep], ref["kl"][keep], rtol=1e-9, atol=1e-12)
    assert abs(out.loss.item() - ref["loss"].item()) <= 1e-9 * abs(ref["loss"].item())


def test_kl_only_at_temperature_has_no_ce_stats():
    h_d, h_v, w_head, labels, weights = _inputs()
    out = verifier_loss(h_d, h_v, w_head, labels, weights, ce=0.0, kl=1.0, temperature=2.0)
    assert set(out.stats.terms) == {"kl"} and set(out.terms) == {"kl"}


def test_without_verifier_hidden():
    h_d, h_v, w_head, labels, weights = _inputs()
    ref = _reference(h_d, None, w_head, labels, weights, ce=0.8)
    (g_ref,) = torch.autograd.grad(ref["loss"], h_d)
    out = verifier_loss(h_d, None, w_head, labels, weights, ce=0.8, chunk_size=10)
    (g,) = torch.autograd.grad(out.loss, h_d)
    assert abs(out.loss.item() - ref["loss"].item()) <= 1e-9 * abs(ref["loss"].item())
    assert _rel(g, g_ref) <= 1e-9
    st = out.stats
    assert st.verifier_argmax is None and st.verifier_hit is None
    assert set(st.terms) == {"ce"} and set(out.terms) == {"ce"}
    keep = weights > 0
    assert torch.equal(st.drafter_argmax[keep], ref["drafter_argmax"][keep])


def test_all_weights_zero_gives_zero_loss_and_grad():
    h_d, h_v, w_head, labels, weights = _inputs()
    weights = torch.zeros_like(weights)
    out = verifier_loss(h_d, h_v, w_head, labels, weights, ce=1.0, kl=1.0)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert h_d.grad is not None and h_d.grad.abs().max() == 0
    assert (out.stats.drafter_argmax == -1).all() and not out.stats.data_hit.any()


def test_all_coefficients_zero():
    h_d, h_v, w_head, labels, weights = _inputs()
    out = verifier_loss(h_d, h_v, w_head, labels, weights, ce=0.0)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert h_d.grad.abs().max() == 0


def test_ignored_labels_on_zero_weight_rows_and_int32_labels():
    h_d, h_v, w_head, labels, weights = _inputs()
    ref = _reference(h_d, h_v, w_head, labels, weights, ce=1.0, kl=1.0)
    labels = labels.clone()
    labels[weights == 0] = -100
    out = verifier_loss(h_d, h_v, w_head, labels.int(), weights, ce=1.0, kl=1.0)
    assert abs(out.loss.item() - ref["loss"].item()) <= 1e-9 * abs(ref["loss"].item())
    assert not out.stats.data_hit[weights == 0].any()


def test_no_grad_mode():
    h_d, h_v, w_head, labels, weights = _inputs()
    ref = _reference(h_d, h_v, w_head, labels, weights, ce=1.0, kl=1.0)
    with torch.no_grad():
        out = verifier_loss(h_d, h_v, w_head, labels, weights, ce=1.0, kl=1.0, chunk_size=8)
    assert not out.loss.requires_grad
    assert abs(out.loss.item() - ref["loss"].item()) <= 1e-9 * abs(ref["loss"].item())
    out2 = verifier_loss(h_d.detach(), h_v, w_head, labels, weights, ce=1.0, kl=1.0)
    assert not out2.loss.requires_grad


def test_autocast_does_not_lower_precision():
    h_d, h_v, w_head, labels, weights = _inputs(dtype=torch.float32)
    ref = verifier_loss(h_d, h_v, w_head, labels, weights, ce=1.0, kl=1.0)
    (g_ref,) = torch.autograd.grad(ref.loss, h_d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = verifier_loss(h_d, h_v, w_head, labels, weights, ce=1.0, kl=1.0)
    (g,) = torch.autograd.grad(out.loss, h_d)
    assert out.loss.dtype == torch.float32
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-6 * abs(ref.loss.item())
    assert _rel(g, g_ref) <= 1e-6


def test_double_backward_raises():
    h_d, h_v, w_head, labels, weights = _inputs()
    out = verifier_loss(h_d, h_v, w_head, labels, weights, ce=1.0, kl=1.0)
    (g,) = torch.autograd.grad(out.loss, h_d, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_gradcheck_float64():
    h_d, h_v, w_head, labels, weights = _inputs(r=6, v=23, h=5, zero_rows=(1,))
    x = h_d.detach().requires_grad_()

    def fn(inp):
        return verifier_loss(
            inp, h_v, w_head, labels, weights, ce=0.7, kl=1.1, verifier_ce=0.3, temperature=1.4, chunk_size=4
        ).loss

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_max_argmax_blocked_matches_argmax():
    g = torch.Generator().manual_seed(1)
    for v in (5, 128, 255, 256, 1000, 1025, 4096 + 77):
        z = torch.randn(9, v, generator=g)
        z[0, -1] = 100.0  # max in the tail
        z[1, :] = 1.0  # all tied: first index
        z[2, 3] = z[2, v // 2] = z[2].max() + 1  # tie across blocks
        m, a = max_argmax(z)
        torch.testing.assert_close(m, z.amax(1), rtol=0, atol=0)
        assert torch.equal(a, z.argmax(1)), v


@pytest.mark.parametrize("offset", [0.0, 1000.0, -1000.0])  # +-1000: the max-shifted exp2 branch
@pytest.mark.parametrize("with_verifier", [True, False])
def test_exp2_block_matches_softmax_block(with_verifier, offset):
    """The CPU T = 1 path (base-2 logits, unnormalised exp2) against the general softmax path, both
    stages: the verifier positions, then rows reading them (gathered: rows share positions)."""
    g = torch.Generator().manual_seed(2)
    zv = torch.randn(4, 777, generator=g, dtype=torch.float64) * 4 + offset
    zd = torch.randn(6, 777, generator=g, dtype=torch.float64) * 4 + offset
    local = torch.tensor([0, 0, 1, 2, 2, 3])
    coef = dict(q1=0.5 + (0.25 if with_verifier else 0.0), kl=1.0 if with_verifier else 0.0)
    l2e = 1 / torch.log(torch.tensor(2.0, dtype=torch.float64))
    zv1, zd1, zv2, zd2 = zv.clone(), zd.clone(), zv * l2e, zd * l2e
    sc1, sc2 = torch.empty_like(zd), torch.empty_like(zd)
    pos1, pos2, pv1, pv2 = None, None, None, None
    if with_verifier:
        pos1 = tuple(x[local] for x in position_math(zv1, sc1[:4], 1.0))
        pos2 = tuple(x[local] for x in position_math_exp2(zv2, sc2[:4]))
        pv1, pv2 = zv1[local], zv2[local]
        torch.testing.assert_close(pv2, pv1, rtol=1e-12, atol=1e-14)  # the same verifier softmax
        assert torch.equal(pos1[0], pos2[0])
        torch.testing.assert_close(pos2[1], pos1[1] * l2e, rtol=1e-12, atol=1e-12)  # base-2 lse
    _, ad, lse, zav, kl_r, s = block_math(pv1, zd1, sc1, pos1, coef["q1"], coef["kl"], 1.0, True)
    ad2, lse2, zav2, kl2, s2, sd = block_math_exp2(pv2, zd2, sc2, pos2, coef["q1"], coef["kl"], True)
    assert torch.equal(ad, ad2) and s == s2
    torch.testing.assert_close(lse2, lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(zd2 / sd[:, None], zd1, rtol=1e-12, atol=1e-14)  # G'' / s_d == G'
    if with_verifier:
        torch.testing.assert_close(zav2, zav, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(kl2, kl_r, rtol=1e-10, atol=1e-12)


def test_workspace_reuse_between_calls():
    import dflash.loss.workspace as ws

    release_workspace()
    mix = dict(ce=1.0, kl=1.0)
    for r, v, keep in [
        (37, 1000, True),
        (20, 700, True),
        (37, 1000, True),
        (30, 1500, True),
        (37, 1000, False),
    ]:
        h_d, h_v, w_head, labels, weights = _inputs(r=r, v=v, zero_rows=(1,))
        ref = _reference(h_d, h_v, w_head, labels, weights, **mix)
        (g_ref,) = torch.autograd.grad(ref["loss"], h_d)
        out = verifier_loss(h_d, h_v, w_head, labels, weights, chunk_size=8, keep_workspace=keep, **mix)
        (g,) = torch.autograd.grad(out.loss, h_d)
        assert abs(out.loss.item() - ref["loss"].item()) <= 1e-9 * abs(ref["loss"].item())
        assert _rel(g, g_ref) <= 1e-9
    assert len(ws._WS_CACHE) == 1  # the largest workspace (fp64) is kept
    (kept,) = ws._WS_CACHE.values()
    assert kept.numel() >= (2 * 8 + 8) * 1500
    release_workspace()
    assert not ws._WS_CACHE


def test_default_chunk_size():
    assert default_chunk_size(151936, 2.0, True) == 1760
    assert default_chunk_size(151936, 2.0, False) == 3520
    assert default_chunk_size(151936, 1.0, True) == 880
    assert default_chunk_size(10, 2.0, True) == 8192
    assert default_chunk_size(10**9, 0.001, True) == 16
    for v in (1000, 32000, 151936, 248320):
        c = default_chunk_size(v, 0.5)
        assert c % 16 == 0 and 16 <= c <= 8192
    h_d, h_v, w_head, labels, weights = _inputs(r=40, zero_rows=())
    out = verifier_loss(h_d, h_v, w_head, labels, weights, kl=1.0, mem_budget_gib=16 * 2 * V * 8 / 2**30)
    assert out.chunk_size == 16  # from the budget (fp32-sized rows), not a fixed number
    out = verifier_loss(h_d, h_v, w_head, labels, weights, kl=1.0)
    assert out.chunk_size == 40  # clamped to the rows


def _bad(**over):
    h_d, h_v, w_head, labels, weights = _inputs()
    args = dict(
        drafter_hidden=h_d,
        verifier_hidden=h_v,
        lm_head_weight=w_head,
        labels=labels,
        weights=weights,
        ce=1.0,
        kl=1.0,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(drafter_hidden=torch.randn(R, H + 1, dtype=torch.float64)), "lm_head_weight"),
        (dict(drafter_hidden=torch.randn(R, H, 1, dtype=torch.float64)), "drafter_hidden"),
        (dict(verifier_hidden=torch.randn(R + 1, H, dtype=torch.float64)), "verifier_hidden"),
        (dict(verifier_hidden=torch.randn(R, H, dtype=torch.float64, requires_grad=True)), "verifier_hidden"),
        (dict(lm_head_weight=torch.randn(V, H, dtype=torch.float64, requires_grad=True)), "lm_head_weight"),
        (dict(lm_head_weight=torch.randn(V, H + 2, dtype=torch.float64)), "lm_head_weight"),
        (dict(labels=torch.zeros(R + 1, dtype=torch.int64)), "labels"),
        (dict(labels=torch.zeros(R)), "labels"),
        (dict(labels=torch.full((R,), V, dtype=torch.int64)), "labels"),
        (dict(labels=torch.full((R,), -1, dtype=torch.int64)), "labels"),
        (dict(weights=torch.ones(R - 1, dtype=torch.float64)), "weights"),
        (dict(weights=-torch.ones(R, dtype=torch.float64)), "weights"),
        (dict(weights=torch.full((R,), float("nan"), dtype=torch.float64)), "weights"),
        (dict(weights=torch.full((R,), float("inf"), dtype=torch.float64)), "weights"),
        (dict(weights=torch.ones(R, dtype=torch.int64)), "weights"),
        (dict(ce=-1.0), "ce"),
        (dict(kl=-0.5), "kl"),
        (dict(verifier_ce=float("nan")), "verifier_ce"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(chunk_size=2.5), "chunk_size"),
        (dict(mem_budget_gib=0), "mem_budget_gib"),
        (dict(verifier_hidden=None), "verifier_hidden"),
        (dict(verifier_hidden=None, kl=0.0, verifier_ce=1.0), "verifier_hidden"),
        (dict(dpace=1.0), "unknown loss term"),
        (dict(drafter_hidden=torch.randn(R, H, dtype=torch.float64, device="meta")), "device"),
    ],
)
def test_value_errors(over, match):
    with pytest.raises(ValueError, match=match):
        verifier_loss(**_bad(**over))


@pytest.mark.slow
def test_compile_matches_eager():
    h_d, h_v, w_head, labels, weights = _inputs(r=16, v=300, h=16, zero_rows=())
    mix = dict(ce=0.5, kl=1.0, verifier_ce=0.2, temperature=2.0)
    a = verifier_loss(h_d, h_v, w_head, labels, weights, chunk_size=16, row_block=16, compile=True, **mix)
    (ga,) = torch.autograd.grad(a.loss, h_d)
    b = verifier_loss(h_d, h_v, w_head, labels, weights, chunk_size=16, row_block=16, **mix)
    (gb,) = torch.autograd.grad(b.loss, h_d)
    assert abs(a.loss.item() - b.loss.item()) <= 1e-12 * abs(b.loss.item())
    assert _rel(ga, gb) <= 1e-12


@pytest.mark.parametrize("path", ["exp2", "softmax"])
def test_explicit_normalizer_gives_the_weighted_sum_over_it(path):
    """``normalizer=N``: loss and gradient are ``sum_r w_r l_r / N`` (a caller summing packets
    divides once by the global weight sum); the logged term means stay divided by the weight sum."""
    h_d, h_v, w_head, labels, weights = _inputs(dtype=torch.float32)
    mix = dict(ce=1.0, kl=0.5) if path == "exp2" else dict(ce=1.0, kl=0.5, temperature=1.5)
    ref = _reference(h_d.double(), h_v.double(), w_head.double(), labels, weights.double(), **mix)
    (g_ref,) = torch.autograd.grad(ref["loss"], h_d)
    out = verifier_loss(h_d, h_v, w_head, labels, weights, chunk_size=7, normalizer=1.0, **mix)
    (g,) = torch.autograd.grad(out.loss, h_d)
    w_sum = weights.double().sum()
    assert out.loss.item() == pytest.approx((ref["loss"] * w_sum).item(), rel=1e-5)
    assert _rel(g.double(), g_ref * w_sum) < 1e-5
    mean = verifier_loss(h_d, h_v, w_head, labels, weights, chunk_size=7, **mix)
    assert out.terms["ce"].item() == pytest.approx(mean.terms["ce"].item(), rel=1e-6)
    with pytest.raises(ValueError, match="normalizer"):
        verifier_loss(h_d, h_v, w_head, labels, weights, normalizer=0.0, **mix)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError], ids=["oom", "unsupported"])
def test_the_bf16_gemm_fallback_lets_out_of_memory_through(error, monkeypatch):
    """The CUDA branch's bf16 GEMM with fp32 output (``out_dtype``) falls back to fp32 copies of both
    operands when the kernel is missing (a RuntimeError), but an out-of-memory error propagates: the
    fallback's fp32 copy of the whole lm_head would only need more memory. The kernel's failure is
    injected into ``torch.mm`` (CPU has that kernel); the CUDA branch is taken with ``as_cuda``."""
    from dflash.loss.device import as_cuda
    from dflash.loss.verifier import _device_mm

    real_mm = torch.mm

    def mm(a, b, *, out_dtype=None, out=None):
        if out_dtype is not None:
            raise error("injected")
        return real_mm(a, b, out=out)

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g).bfloat16(), torch.randn(16, 4, generator=g).bfloat16()
    out = torch.empty(8, 4)
    monkeypatch.setattr(torch, "mm", mm)
    with as_cuda():
        if error is torch.OutOfMemoryError:
            with pytest.raises(torch.OutOfMemoryError, match="injected"):
                _device_mm(a, b, out)
        else:
            _device_mm(a, b, out)
            torch.testing.assert_close(out, a.float() @ b.float())
