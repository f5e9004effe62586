"""Per-block math of the chunked verifier loss (:mod:`dflash.loss.verifier`).

The verifier's distribution depends only on the position a row reads, so the chunk loop of
:func:`~dflash.loss.verifier.verifier_loss` works in two stages per chunk, each in blocks of ``S``
rows of ``[S, V]`` views of the caller's workspace in the compute dtype (fp32, or fp64 for fp64
inputs):

1. per distinct verifier position of the chunk, :func:`position_math` (general path) or
   :func:`position_math_exp2` (CPU fast path at ``T = 1``) turns the verifier logits into the
   verifier softmax ``p_T`` in place and returns the position's argmax, log-sum-exp and
   ``sum_v p_T z_v / T``;
2. per supervised row, :func:`block_math` / :func:`block_math_exp2` take the drafter logits ``zd``,
   the rows' verifier softmax ``pv`` (a view of stage 1's buffer when every row has its own
   position, else the rows gathered into a scratch) and their positions' stage-1 values. Per row
   they compute the drafter max/argmax, the drafter log-sum-exp at ``T = 1``, the drafter logit at
   the verifier argmax and ``T^2 * KL(p_T || q_T)``, and return them as ``[S]`` tensors. With
   ``need_grad`` the gradient w.r.t. the drafter logits, divided by the scalar ``s`` that is also
   returned (times the per-row sum ``s_d`` on the exp2 path), is written over ``zd``, without its
   one-hot parts (a term's ``-c`` at the label or the verifier argmax, ``dflash.loss.terms``), which
   the caller scatters once per chunk.

``pv`` is None without a verifier. ``sc`` is an ``[S, V]`` scratch (the row dot's product, and
``softmax(z_d / T)`` at ``T != 1``). In-place contract: ``zv`` (stage 1), ``zd`` and ``sc`` are
overwritten, ``pv`` is only read; no ``[S, V]`` tensor is allocated on the CPU.
The exp2 functions take base-2 logits (``z / ln 2``: the caller scales the hidden states by
:data:`LOG2E` before the GEMM) and return base-2 position values and natural-log row values.
:func:`get_kernels` returns the general pair eager or ``torch.compile``d; :func:`max_argmax` is the
blocked row max/argmax.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dflash.loss.device import kernel_device

__all__ = [
    "LN2",
    "LOG2E",
    "block_math",
    "block_math_exp2",
    "get_kernels",
    "max_argmax",
    "position_math",
    "position_math_exp2",
]

_ARGMAX_BLOCK = 128  # columns per block of the blocked max/argmax


def _softmax_(src: Tensor, out: Tensor) -> Tensor:
    """Row softmax of ``src`` written into ``out`` (may alias ``src``), without allocation."""
    try:
        return torch._softmax(src, 1, False, out=out)
    except (RuntimeError, TypeError, AttributeError):  # pragma: no cover - private op changed
        out.copy_(torch.softmax(src, 1))
        return out


def _rowdot(a: Tensor, b: Tensor, scratch: Tensor) -> Tensor:
    """``sum(a * b, 1)`` of two ``[S, V]`` blocks; ``scratch`` (may alias ``a``) is overwritten on CPU.

    CPU: ``mul(a, b, out=scratch).sum(1)``, two large parallel regions per block, no temporary
    (``bmm`` is ~4x slower; a per-row BLAS ``dot`` opens one parallel region per row, which stalls
    when the cores are shared). Other devices: one fused ``vecdot`` kernel.
    """
    if kernel_device(a.device) != "cpu":
        return torch.linalg.vecdot(a, b)
    return torch.mul(a, b, out=scratch).sum(1)


def max_argmax(z: Tensor, k: int = _ARGMAX_BLOCK) -> tuple[Tensor, Tensor]:
    """Row max and first argmax of a 2-D tensor via a blocked ``amax`` (much faster than argmax)."""
    n, v = z.shape
    nb = v // k
    if nb < 2:
        m, a = z.max(1)
        return m, a
    main = z[:, : nb * k].unflatten(1, (nb, k))
    bmax = main.amax(2)  # [n, nb]
    m, b = bmax.max(1)  # first block holding the max
    blk = torch.gather(main, 1, b.view(n, 1, 1).expand(n, 1, k)).view(n, k)
    a = b * k + blk.argmax(1)
    if nb * k < v:
        tm, ta = z[:, nb * k :].max(1)
        tail = tm > m
        m = torch.where(tail, tm, m)
        a = torch.where(tail, ta + nb * k, a)
    return m, a


def position_math(zv: Tensor, sc: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """Stage 1 on one block of verifier positions: ``zv`` (logits) becomes ``p_T`` in place.

    Returns ``(av, lse_vt, pz)``: the argmax of ``z_v``, ``lse(z_v / T)`` and
    ``sum_v p_T z_v / T``, each ``[S]``."""
    rows = torch.arange(zv.shape[0], device=zv.device)
    mv, av = max_argmax(zv)
    if temperature != 1.0:
        zv.mul_(1.0 / temperature)
        mv = mv / temperature
    sc.copy_(zv)
    _softmax_(zv, zv)  # p_T in place
    lse_vt = mv - torch.log(zv[rows, av])
    return av, lse_vt, _rowdot(sc, zv, sc)


def block_math(
    pv: Tensor | None,
    zd: Tensor,
    sc: Tensor | None,
    verifier: tuple[Tensor, Tensor, Tensor] | None,
    q1: float,
    kl_basis: float,
    temperature: float,
    need_grad: bool,
):
    """Stage 2, the row quantities of one row block (``dflash.loss.terms``); overwrites ``zd``.

    ``pv`` ``[S, V]``: the rows' verifier softmax ``p_T``; ``verifier``: their positions'
    ``(av, lse_vt, pz)`` from :func:`position_math` (both None without a verifier).
    ``q1`` / ``kl_basis``: the summed coefficients of the gradient basis ``q_1`` and ``T (q_T -
    p_T)`` over the weighted terms (``terms.gradient_plan``). On return ``zd`` holds ``G' = G / s``
    without the one-hot parts (which the caller scatters per chunk); ``s`` is the scalar the
    gradient was divided by (0: no gradient written). Returns ``(md, ad, lse_d1, zav, kl_r, s)``
    where ``lse_d1`` (None if not computed) is the drafter log-sum-exp at T = 1, ``zav`` the
    drafter logit at the verifier argmax and ``kl_r`` the per-row ``T^2 KL``.
    """
    n = zd.shape[0]
    rows = torch.arange(n, device=zd.device)
    t = temperature
    inv_t = 1.0 / t
    a_coef = q1
    b_coef = kl_basis * t
    md, ad = max_argmax(zd)
    zav = kl_r = lse_dt = qt = None
    if pv is not None:
        assert sc is not None and verifier is not None, "a verifier block needs its scratch and positions"
        av, lse_vt, pz = verifier
        zav = zd[rows, av]
        dot = _rowdot(pv, zd, sc)  # sum p_T z_d; sc is scratch again afterwards
        if t != 1.0:
            qt = torch.mul(zd, inv_t, out=sc)
            _softmax_(qt, qt)  # q_T
            lse_dt = md * inv_t - torch.log(qt[rows, ad])
    lse_d1 = None
    if t == 1.0 or a_coef > 0:
        _softmax_(zd, zd)  # q_1 in place
        lse_d1 = md - torch.log(zd[rows, ad])
        if t == 1.0:
            lse_dt = lse_d1
    if pv is not None:
        assert lse_dt is not None
        kl_r = (pz - dot * inv_t - lse_vt + lse_dt) * (t * t)

    s = 0.0
    if need_grad:
        assert pv is not None or b_coef == 0, "a KL gradient needs the verifier logits"
        if t == 1.0:
            s = a_coef + b_coef
            if pv is not None and b_coef > 0:
                zd.sub_(pv, alpha=b_coef / s)  # q - (B/s) p
        elif a_coef > 0:
            s = a_coef
            if pv is not None and qt is not None and b_coef > 0:
                zd.add_(qt, alpha=b_coef / s)
                zd.sub_(pv, alpha=b_coef / s)
        elif pv is not None and qt is not None and b_coef > 0:
            s = b_coef
            torch.sub(qt, pv, out=zd)
    return md, ad, lse_d1, zav, kl_r, s


LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


# Row maxima (base 2) for which 2^z needs no max shift: no overflow of e, of the row sums or of
# G'' @ W, and entries 2^-126 below 1 (fp32 underflow) are > 2^-100 below the row max.
_EXP2_NOSHIFT = {torch.float32: (-20.0, 64.0), torch.float64: (-900.0, 900.0)}


def _exp2_rows_(z: Tensor, m: Tensor) -> Tensor:
    """``z <- 2^(z - shift)`` in place, the returned per-row ``shift`` being 0 (one pass saved)
    when every row maximum ``m`` is in the safe range, else ``m``."""
    lo, hi = _EXP2_NOSHIFT.get(z.dtype, (0.0, 0.0))
    if bool(((m >= lo) & (m <= hi)).all()):
        z.exp2_()
        return torch.zeros_like(m)
    z.sub_(m.unsqueeze(1)).exp2_()
    return m


def position_math_exp2(zv: Tensor, sc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Stage 1 on base-2 logits (``T = 1``, CPU): ``zv`` becomes ``p`` in place (``2^(z2 - shift)``
    normalised by its row sum). Returns ``(av, lse_v2, pz2)``: the argmax, the base-2
    log-sum-exp and ``sum_v p z2_v``."""
    mv, av = max_argmax(zv)
    sc.copy_(zv)
    sh_v = _exp2_rows_(zv, mv)  # e_v
    sv = zv.sum(1)
    zv.div_(sv.unsqueeze(1))
    return av, sh_v + torch.log2(sv), _rowdot(sc, zv, sc)


def block_math_exp2(
    pv: Tensor | None,
    zd: Tensor,
    sc: Tensor | None,
    verifier: tuple[Tensor, Tensor, Tensor] | None,
    q1: float,
    kl: float,
    need_grad: bool,
):
    """Stage 2 at ``T = 1`` on base-2 drafter logits ``z2 = z / ln 2`` (CPU fast path); ``pv``,
    ``verifier`` (from :func:`position_math_exp2`), ``q1`` / ``kl`` as in :func:`block_math`.

    ``exp2`` is cheaper than ``exp`` on CPU, and the unnormalised ``e = 2^(z2 - shift)``
    (``shift`` = 0 when the row maxima allow, else the row max) replaces the softmax (its max and
    normalisation passes): the row sums are folded into the gradient coefficients and the per-row
    ``dh`` scale. On return ``zd`` holds
    ``G'' = s_d G / s`` (``s_d = sum e_d``) without the one-hot parts. Returns ``(ad, lse_d1,
    zav, kl_r, s, s_d)`` with natural-log ``lse_d1``, ``zav`` and ``kl_r``.
    """
    n = zd.shape[0]
    rows = torch.arange(n, device=zd.device)
    md, ad = max_argmax(zd)
    zav = kl_r = None
    if pv is not None:
        assert sc is not None and verifier is not None, "a verifier block needs its scratch and positions"
        av, lse_v2, pz2 = verifier
        zav = zd[rows, av] * LN2
        dot = _rowdot(pv, zd, sc)  # sum p z2_d
    sh_d = _exp2_rows_(zd, md)  # e_d
    sd = zd.sum(1)
    lse_d2 = sh_d + torch.log2(sd)
    if pv is not None:
        kl_r = (pz2 - dot - lse_v2 + lse_d2) * LN2
    s = 0.0
    if need_grad:
        s = q1 + kl
        if pv is not None and kl > 0:
            zd.addcmul_(pv, ((kl / s) * sd).unsqueeze(1), value=-1.0)  # s_d (q - (kl/s) p)
    return ad, lse_d2 * LN2, zav, kl_r, s, sd


_compiled: tuple | None = None


def get_kernels(compile: bool):
    """``(position_math, block_math)``, or (``compile=True``) their ``torch.compile``d versions,
    compiled once."""
    global _compiled
    if not compile:
        return position_math, block_math
    if _compiled is None:
        _compiled = (torch.compile(position_math), torch.compile(block_math))
    return _compiled
