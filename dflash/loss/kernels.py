"""Per-row-block math of the chunked verifier loss (:mod:`dflash.loss.verifier`).

The chunk loop of :func:`~dflash.loss.verifier.verifier_loss` walks each chunk of logits in row
blocks of ``S`` rows and hands each block to :func:`block_math` (general path) or
:func:`block_math_exp2` (CPU fast path at ``T = 1``). Their inputs, all ``[S, V]`` views of the
caller's workspace in the compute dtype (fp32, or fp64 for fp64 inputs):

- ``zd``: drafter logits of the block;
- ``zv``: verifier logits of the block, or None without a verifier (then ``sc`` / ``sc2`` may be None);
- ``sc``: scratch for ``d = z_v - z_d``; ``sc2`` (:func:`block_math` at ``T != 1`` only): scratch
  for the drafter softmax at temperature ``T``.

Per row they compute the drafter max/argmax, the drafter log-sum-exp at ``T = 1``, the verifier
argmax, the drafter logit at the verifier argmax and ``T^2 * KL(p_T || q_T)``, and return them as
``[S]`` tensors. With ``need_grad`` the gradient w.r.t. the drafter logits, divided by the scalar
``s`` that is also returned (times the per-row sum ``s_d`` on the exp2 path), is written over
``zd``, without its one-hot parts (a term's ``-c`` at the label or the verifier argmax,
``dflash.loss.terms``), which the caller scatters once per chunk.

In-place contract: ``zd``, ``zv``, ``sc`` and ``sc2`` are all overwritten (``zv`` with the
verifier probabilities, ``sc`` / ``sc2`` with scratch); no ``[S, V]`` tensor is allocated.
:func:`block_math_exp2` takes base-2 logits (``z / ln 2``: the caller scales the hidden states by
:data:`LOG2E` before the GEMM) and returns natural-log values. :func:`get_block_math` returns
:func:`block_math` eager or ``torch.compile``d; :func:`max_argmax` is the blocked row max/argmax.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dflash.loss.device import kernel_device

__all__ = ["LN2", "LOG2E", "block_math", "block_math_exp2", "get_block_math", "max_argmax"]

_ARGMAX_BLOCK = 128  # columns per block of the blocked max/argmax


def _softmax_(src: Tensor, out: Tensor) -> Tensor:
    """Row softmax of ``src`` written into ``out`` (may alias ``src``), without allocation."""
    try:
        return torch._softmax(src, 1, False, out=out)
    except (RuntimeError, TypeError, AttributeError):  # pragma: no cover - private op changed
        out.copy_(torch.softmax(src, 1))
        return out


def _rowdot_(a: Tensor, b: Tensor) -> Tensor:
    """``sum(a * b, 1)`` of two ``[S, V]`` blocks; ``a`` is overwritten on CPU.

    CPU: ``a.mul_(b).sum(1)``, two large parallel regions per block, no temporary (``bmm`` is ~4x
    slower; a per-row BLAS ``dot`` opens one parallel region per row, which stalls when the cores
    are shared). Other devices: one fused ``vecdot`` kernel.
    """
    if kernel_device(a.device) != "cpu":
        return torch.linalg.vecdot(a, b)
    return a.mul_(b).sum(1)


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


def block_math(
    zv: Tensor | None,
    zd: Tensor,
    sc: Tensor | None,
    sc2: Tensor | None,
    q1: float,
    kl_basis: float,
    temperature: float,
    need_grad: bool,
):
    """Row quantities of one row block (``dflash.loss.terms``); overwrites ``zv`` and ``zd``.

    ``q1`` / ``kl_basis``: the summed coefficients of the gradient basis ``q_1`` and ``T (q_T -
    p_T)`` over the weighted terms (``terms.gradient_plan``). On return ``zd`` holds ``G' = G / s``
    without the one-hot parts (which the caller scatters per chunk); ``s`` is the scalar the
    gradient was divided by (0: no gradient written). Returns ``(md, ad, lse_d1, av, zav, kl_r, s)``
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
    av = zav = kl_r = lse_dt = None
    if zv is not None:
        assert sc is not None, "a verifier block needs the scratch buffer"
        mv, av = max_argmax(zv)
        zav = zd[rows, av]
        torch.sub(zv, zd, out=sc)  # d = z_v - z_d
        if t != 1.0:
            zv.mul_(inv_t)
            mv = mv * inv_t
        _softmax_(zv, zv)  # p_T in place
        lse_vt = mv - torch.log(zv[rows, av])
        dot = _rowdot_(sc, zv)  # sum p_T (z_v - z_d); sc is scratch again afterwards
        if t != 1.0:
            assert sc2 is not None, "T != 1 needs the second scratch buffer"
            torch.mul(zd, inv_t, out=sc2)
            _softmax_(sc2, sc2)  # q_T
            lse_dt = md * inv_t - torch.log(sc2[rows, ad])
    lse_d1 = None
    if t == 1.0 or a_coef > 0:
        _softmax_(zd, zd)  # q_1 in place
        lse_d1 = md - torch.log(zd[rows, ad])
        if t == 1.0:
            lse_dt = lse_d1
    if zv is not None:
        assert lse_dt is not None
        kl_r = (dot * inv_t - lse_vt + lse_dt) * (t * t)

    s = 0.0
    if need_grad:
        assert zv is not None or b_coef == 0, "a KL gradient needs the verifier logits"
        if t == 1.0:
            s = a_coef + b_coef
            if zv is not None and b_coef > 0:
                zd.sub_(zv, alpha=b_coef / s)  # q - (B/s) p
        elif a_coef > 0:
            s = a_coef
            if zv is not None and sc2 is not None and b_coef > 0:
                zd.add_(sc2, alpha=b_coef / s)
                zd.sub_(zv, alpha=b_coef / s)
        elif zv is not None and sc2 is not None and b_coef > 0:
            s = b_coef
            torch.sub(sc2, zv, out=zd)
    return md, ad, lse_d1, av, zav, kl_r, s


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


def block_math_exp2(
    zv: Tensor | None,
    zd: Tensor,
    sc: Tensor | None,
    q1: float,
    kl: float,
    need_grad: bool,
):
    """The ``T = 1`` block on base-2 logits ``z2 = z / ln 2`` (CPU fast path); ``q1`` / ``kl``:
    the gradient basis coefficients as in :func:`block_math`.

    ``exp2`` is cheaper than ``exp`` on CPU, and the unnormalised ``e = 2^(z2 - shift)``
    (``shift`` = 0 when the row maxima allow, else the row max) replaces the softmax (its max and
    normalisation passes): the row sums are folded into the gradient coefficients and the per-row
    ``dh`` scale. On return ``zd`` holds
    ``G'' = s_d G / s`` (``s_d = sum e_d``) without the one-hot parts. Returns ``(ad, lse_d1, av,
    zav, kl_r, s, s_d)`` with natural-log ``lse_d1``, ``zav`` and ``kl_r``.
    """
    n = zd.shape[0]
    rows = torch.arange(n, device=zd.device)
    md, ad = max_argmax(zd)
    av = zav = kl_r = sv = None
    if zv is not None:
        assert sc is not None, "a verifier block needs the scratch buffer"
        mv, av = max_argmax(zv)
        zav = zd[rows, av] * LN2
        torch.sub(zv, zd, out=sc)  # d2 = z2_v - z2_d
        sh_v = _exp2_rows_(zv, mv)  # e_v
        sv = zv.sum(1)
        dot = _rowdot_(sc, zv) / sv  # sum p (z2_v - z2_d)
        lse_v2 = sh_v + torch.log2(sv)
    sh_d = _exp2_rows_(zd, md)  # e_d
    sd = zd.sum(1)
    lse_d2 = sh_d + torch.log2(sd)
    if zv is not None:
        kl_r = (dot - lse_v2 + lse_d2) * LN2
    s = 0.0
    if need_grad:
        s = q1 + kl
        if zv is not None and sv is not None and kl > 0:
            zd.addcmul_(zv, ((kl / s) * sd / sv).unsqueeze(1), value=-1.0)  # s_d (q - (kl/s) p)
    return ad, lse_d2 * LN2, av, zav, kl_r, s, sd


_compiled_block_math = None


def get_block_math(compile: bool):
    """:func:`block_math`, or (``compile=True``) its ``torch.compile``d version, compiled once."""
    global _compiled_block_math
    if not compile:
        return block_math
    if _compiled_block_math is None:
        _compiled_block_math = torch.compile(block_math)
    return _compiled_block_math
