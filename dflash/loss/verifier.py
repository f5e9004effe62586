"""Chunked verifier-logit loss: exact CE / KL / verifier-CE without ever holding ``[rows, vocab]``.

The drafter's loss compares drafter logits ``z_d = h_d W^T`` with verifier logits ``z_v = h_v W^T``
(``W`` is the frozen target lm_head, shared by the drafter). Materialising both for every supervised
slot is tens of GB at a 150K-250K vocabulary. :func:`verifier_loss` instead:

1. drops the rows whose weight is 0 (``index_select`` of the hidden states, before any GEMM);
2. for each chunk of ``C`` rows projects both hidden chunks into two preallocated fp32 ``[C, V]``
   buffers (fp32 accumulation for bf16 inputs: ``mm(..., out_dtype=float32)`` on CUDA, upcast
   operands on CPU; never a bf16 GEMM followed by ``.float()``);
3. walks the chunk in small row blocks that stay in cache and, per block: max/argmax of both logit
   rows, the verifier softmax into a small ``[S, V]`` scratch, two row dots for the KL, the drafter
   softmax in place, and the gradient ``dL/dz_d`` written in place over the drafter logits;
4. ``dh_chunk = G @ W`` (one GEMM), scaled per row by ``w_r * s / sum(w)`` on the ``[C, H]`` result.

Only ``dh`` (``[R, H]``, the drafter dtype) is kept for backward, which returns
``grad_output * dh``. No ``[R, V]`` tensor, no recompute in backward, no ``roll``. FLOPs: 3 GEMMs of
``2 R H V`` each for ce+kl (2 for ce only), which is what the materialising path costs too.

Per row ``r`` (all logits in fp32, or fp64 for fp64 inputs)::

    CE_r  = lse(z_d) - z_d[label_r]
    VCE_r = lse(z_d) - z_d[argmax z_v]
    KL_r  = T^2 * KL(softmax(z_v / T) || softmax(z_d / T))
          = T^2 * (sum_v p_T (z_v - z_d) / T - lse(z_v / T) + lse(z_d / T))
    loss  = sum_r w_r (ce CE_r + kl KL_r + verifier_ce VCE_r) / sum_r w_r
    dL/dz_d[r] = w_r / sum(w) * (ce (q_1 - 1[label]) + kl T (q_T - p_T) + verifier_ce (q_1 - 1[argmax z_v]))

``lse`` is recovered from the in-place softmax: ``lse = max - log(p[argmax])`` (``p[argmax] >= 1/V``,
so it never underflows). The row argmax uses a blocked ``amax`` (``argmax`` itself is ~8x slower
than ``amax`` on CPU); ties resolve to the first index, as ``torch.argmax``.

Elementwise passes per row block (ce+kl, T = 1): 2 blocked max reads, 2 softmaxes (the only
``exp`` work), 2 row dots, 1 fused ``q - c p`` update. At ``T != 1`` a second scratch holds
``softmax(z_d / T)`` (one more softmax). ce only: 1 blocked max read and 1 in-place softmax.

Memory beyond the inputs: ``[C, V]`` fp32 x 2 (x 1 without ``verifier_hidden``), the ``[S, V]``
scratch (x 2 at ``T != 1``), ``dh`` ``[R, H]`` and a compacted copy of the kept hidden rows. On CPU
with bf16 inputs an fp32 copy of ``W`` is made once per call (CPU bf16 is for tests only).

Call this outside any ``torch.compile`` region; ``compile=True`` compiles only the per-row-block
math (Inductor; on CPU it needs a C++ compiler).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_MEM_BUDGET_GIB",
    "VerifierLossOutput",
    "VerifierLossStats",
    "default_chunk_size",
    "verifier_loss",
]

DEFAULT_MEM_BUDGET_GIB = 2.0
"""Default budget for the ``[C, V]`` chunk buffers (same default as ``LossConfig.mem_budget_gib``)."""

_MIN_CHUNK = 16
_MAX_CHUNK = 8192
_ARGMAX_BLOCK = 128  # columns per block of the blocked max/argmax
_CPU_ROW_BLOCK = 32  # rows per elementwise block on CPU (few, large parallel regions; 3 x 32 x V x 4 B scratch-side)
_CUDA_ROW_BLOCK = 256


def default_chunk_size(vocab_size: int, mem_budget_gib: float = DEFAULT_MEM_BUDGET_GIB,
                       with_verifier: bool = True, dtype_bytes: int = 4) -> int:
    """Rows per chunk such that the ``[C, V]`` buffers fit ``mem_budget_gib``.

    ``C = budget // (n_buffers * V * dtype_bytes)`` with ``n_buffers = 2`` with a verifier (verifier
    and drafter logits) and 1 without, clamped to ``[16, 8192]`` and rounded down to a multiple of
    16. At V = 151,936 and the default 2 GiB: 1760 rows with a verifier, 3520 without.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if not (mem_budget_gib > 0 and math.isfinite(mem_budget_gib)):
        raise ValueError(f"mem_budget_gib must be a finite number > 0, got {mem_budget_gib}")
    per_row = (2 if with_verifier else 1) * vocab_size * dtype_bytes
    rows = int(mem_budget_gib * 2**30) // per_row
    rows = max(_MIN_CHUNK, min(_MAX_CHUNK, rows))
    return rows - rows % 16


@dataclass
class VerifierLossStats:
    """Per-row statistics in the original row order, without grad.

    Rows with weight 0 are not computed: argmaxes are -1, hits False, losses 0. The verifier
    fields are None when ``verifier_hidden`` is None. ``ce`` / ``verifier_ce`` are the per-row
    (unweighted) cross-entropies at temperature 1; they are None when only the temperature-T KL is
    computed (``ce == verifier_ce == 0`` and ``temperature != 1``), where they would cost an extra
    softmax. ``kl`` is ``T^2 * KL(p_T || q_T)`` and is computed whenever ``verifier_hidden`` is
    given, whatever the ``kl`` coefficient.
    """

    drafter_argmax: Tensor  # [R] int64
    data_hit: Tensor  # [R] bool: drafter argmax == label
    ce: Tensor | None  # [R] compute dtype
    verifier_argmax: Tensor | None = None  # [R] int64
    verifier_hit: Tensor | None = None  # [R] bool: drafter argmax == verifier argmax
    kl: Tensor | None = None  # [R] compute dtype
    verifier_ce: Tensor | None = None  # [R] compute dtype


@dataclass
class VerifierLossOutput:
    loss: Tensor
    """Scalar (fp32, or fp64 for fp64 inputs) with grad w.r.t. ``drafter_hidden`` only."""
    stats: VerifierLossStats
    terms: dict[str, Tensor] = field(default_factory=dict)
    """Weighted means (no grad) of each term that was computed: ``ce``, ``kl``, ``verifier_ce``."""
    weight_sum: Tensor | None = None
    chunk_size: int = 0
    """The chunk size used (after the default and the clamp to the number of kept rows)."""


# ----------------------------------------------------------------------------------------------
# small helpers


def _softmax_(src: Tensor, out: Tensor) -> Tensor:
    """Row softmax of ``src`` written into ``out`` (may alias ``src``), without allocation."""
    try:
        return torch._softmax(src, 1, False, out=out)
    except (RuntimeError, TypeError, AttributeError):  # pragma: no cover - private op changed
        out.copy_(torch.softmax(src, 1))
        return out


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """sum(a * b, 1) for two [S, V] tensors without a [S, V] temporary (one BLAS dot per row;
    measured faster on CPU than ``bmm``, ``mul_`` + ``sum`` or ``linalg.vecdot``); one fused
    ``vecdot`` kernel on other devices."""
    if a.device.type != "cpu":
        return torch.linalg.vecdot(a, b)
    return torch.stack([torch.dot(a[i], b[i]) for i in range(a.shape[0])])


def _max_argmax(z: Tensor, k: int = _ARGMAX_BLOCK) -> tuple[Tensor, Tensor]:
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
        tm, ta = z[:, nb * k:].max(1)
        tail = tm > m
        m = torch.where(tail, tm, m)
        a = torch.where(tail, ta + nb * k, a)
    return m, a


def _device_mm(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """``out = a @ b`` with ``out``'s (fp32/fp64) accumulation and output, never a low-precision output."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    if a.dtype == b.dtype and a.device.type == "cuda":
        try:
            return torch.mm(a, b, out_dtype=out.dtype, out=out)
        except (RuntimeError, TypeError):  # pragma: no cover - older torch / arch
            pass
    return torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc_madvise = None


def _madvise_huge(ptr: int, nbytes: int) -> bool:
    global _libc_madvise
    try:
        if _libc_madvise is None:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _libc_madvise = fn
        return _libc_madvise(ptr, nbytes, _MADV_HUGEPAGE) == 0
    except Exception:  # pragma: no cover - not Linux / no libc
        _libc_madvise = False
        return False


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat uninitialised buffer; on Linux CPU backed by transparent huge pages when possible.

    A fresh multi-GB CPU buffer costs ~0.3 s per GB in 4 KiB page faults on first touch; with
    ``MADV_HUGEPAGE`` (honoured when THP is ``madvise`` or ``always``) it is ~10x cheaper and the
    elementwise passes see fewer TLB misses.
    """
    item = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * item
    if device.type != "cpu" or nbytes < 8 * _HUGE_PAGE or _libc_madvise is False or not sys.platform.startswith("linux"):
        return torch.empty(numel, dtype=dtype, device=device)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % _HUGE_PAGE
    _madvise_huge(raw.data_ptr() + off, nbytes - nbytes % _HUGE_PAGE)
    return raw[off:off + nbytes].view(dtype)


@dataclass
class _Cfg:
    ce: float
    kl: float
    vce: float
    temperature: float
    chunk: int
    row_block: int
    need_grad: bool
    compile: bool
    result: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# per row-block math (eager; optionally compiled)


def _block_math(zv: Tensor | None, zd: Tensor, sc: Tensor | None, sc2: Tensor | None,
                ce: float, kl: float, vce: float, temperature: float, need_grad: bool):
    """Loss terms and stats of one row block; overwrites ``zv`` and ``zd``.

    On return ``zd`` holds ``G' = G / s`` without the one-hot parts (``-ce/s`` at the label and
    ``-vce/s`` at the verifier argmax, which the caller scatters per chunk); ``s`` is the scalar
    the gradient was divided by (0: no gradient written). Returns ``(md, ad, lse_d1, av, zav, kl_r,
    s)`` where ``lse_d1`` (None if not computed) is the drafter log-sum-exp at T = 1, ``zav`` the
    drafter logit at the verifier argmax and ``kl_r`` the per-row ``T^2 KL``.
    """
    n = zd.shape[0]
    rows = torch.arange(n, device=zd.device)
    t = temperature
    inv_t = 1.0 / t
    a_coef = ce + vce
    b_coef = kl * t
    md, ad = _max_argmax(zd)
    av = zav = kl_r = lse_dt = None
    if zv is not None:
        mv, av = _max_argmax(zv)
        zav = zd[rows, av]
        torch.sub(zv, zd, out=sc)  # d = z_v - z_d
        if t != 1.0:
            zv.mul_(inv_t)
            mv = mv * inv_t
        _softmax_(zv, zv)  # p_T in place
        lse_vt = mv - torch.log(zv[rows, av])
        dot = _rowdot(sc, zv)  # sum p_T (z_v - z_d)
        if t != 1.0:
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
        kl_r = (dot * inv_t - lse_vt + lse_dt) * (t * t)

    s = 0.0
    if need_grad:
        if t == 1.0:
            s = a_coef + b_coef
            if b_coef > 0:
                zd.sub_(zv, alpha=b_coef / s)  # q - (B/s) p
        elif a_coef > 0:
            s = a_coef
            if b_coef > 0:
                zd.add_(sc2, alpha=b_coef / s)
                zd.sub_(zv, alpha=b_coef / s)
        elif b_coef > 0:
            s = b_coef
            torch.sub(sc2, zv, out=zd)
    return md, ad, lse_d1, av, zav, kl_r, s


_compiled_block_math = None


def _get_block_math(compile: bool):
    global _compiled_block_math
    if not compile:
        return _block_math
    if _compiled_block_math is None:
        _compiled_block_math = torch.compile(_block_math, dynamic=False)
    return _compiled_block_math


# ----------------------------------------------------------------------------------------------
# the autograd Function


def _forward_impl(h_d: Tensor, h_v: Tensor | None, w: Tensor, labels: Tensor, weights: Tensor,
                  cfg: _Cfg) -> tuple[Tensor, Tensor | None]:
    device = h_d.device
    r_all, hid = h_d.shape
    vocab = w.shape[0]
    cdt = torch.float64 if torch.float64 in (h_d.dtype, w.dtype) else torch.float32
    keep = torch.nonzero(weights > 0).view(-1)
    n_keep = int(keep.numel())
    compact = n_keep < r_all
    if compact:
        h_d = h_d.index_select(0, keep)
        h_v = h_v.index_select(0, keep) if h_v is not None else None
        labels_k = labels.index_select(0, keep)
        w_k = weights.index_select(0, keep).to(cdt)
    else:
        labels_k = labels
        w_k = weights.to(cdt)
    w_sum = w_k.sum()

    # per-row outputs (compacted order)
    ad_k = torch.empty(n_keep, dtype=torch.int64, device=device)
    av_k = torch.empty(n_keep, dtype=torch.int64, device=device) if h_v is not None else None
    ce_k = torch.empty(n_keep, dtype=cdt, device=device)
    kl_k = torch.empty(n_keep, dtype=cdt, device=device) if h_v is not None else None
    vce_k = torch.empty(n_keep, dtype=cdt, device=device) if h_v is not None else None
    have_ce = True
    dh = torch.zeros((r_all, hid), dtype=h_d.dtype, device=device) if cfg.need_grad else None

    chunk = max(1, min(cfg.chunk, n_keep)) if n_keep else 1
    cfg.result["chunk_size"] = chunk
    s_used = 0.0
    if n_keep:
        on_cuda = device.type == "cuda"
        # GEMM operand for the projections: W itself, or (CPU, low precision) an fp32 copy made once.
        if w.dtype == cdt or on_cuda:
            w_mm = w
        else:
            w_mm = w.to(cdt)
        w_t = w_mm.t()
        rb = max(1, min(cfg.row_block, chunk))
        n_sc = 0 if h_v is None else (1 if cfg.temperature == 1.0 else 2)
        n_big = 1 if h_v is None else 2
        ws = _workspace((n_big * chunk + n_sc * rb) * vocab, cdt, device)
        bufs = ws[: n_big * chunk * vocab].view(n_big, chunk, vocab)
        zd_buf = bufs[0]
        zv_buf = bufs[1] if h_v is not None else None
        scr = ws[n_big * chunk * vocab:].view(n_sc, rb, vocab)
        sc = scr[0] if n_sc >= 1 else None
        sc2 = scr[1] if n_sc >= 2 else None
        dh_buf = torch.empty((chunk, hid), dtype=cdt, device=device) if cfg.need_grad else None
        block_fn = _get_block_math(cfg.compile)
        arange_c = torch.arange(chunk, device=device)
        for c0 in range(0, n_keep, chunk):
            c1 = min(c0 + chunk, n_keep)
            n = c1 - c0
            zd = zd_buf[:n]
            hd_c = h_d[c0:c1]
            _device_mm(hd_c if hd_c.dtype == w_mm.dtype else hd_c.to(w_mm.dtype), w_t, zd)
            zv = None
            if h_v is not None:
                zv = zv_buf[:n]
                hv_c = h_v[c0:c1]
                _device_mm(hv_c if hv_c.dtype == w_mm.dtype else hv_c.to(w_mm.dtype), w_t, zv)
            rows_c = arange_c[:n]
            lab_c = labels_k[c0:c1]
            zlab = zd[rows_c, lab_c]
            av_c = av_k[c0:c1] if zv is not None else None
            for b0 in range(0, n, rb):
                b1 = min(b0 + rb, n)
                m = b1 - b0
                md, ad, lse_d1, av, zav, kl_r, s = block_fn(
                    zv[b0:b1] if zv is not None else None, zd[b0:b1],
                    sc[:m] if sc is not None else None, sc2[:m] if sc2 is not None else None,
                    cfg.ce, cfg.kl, cfg.vce, cfg.temperature, cfg.need_grad)
                g0, g1 = c0 + b0, c0 + b1
                ad_k[g0:g1] = ad
                if lse_d1 is None:
                    have_ce = False
                else:
                    ce_k[g0:g1] = lse_d1 - zlab[b0:b1]
                if zv is not None:
                    av_k[g0:g1] = av
                    kl_k[g0:g1] = kl_r
                    if lse_d1 is not None:
                        vce_k[g0:g1] = lse_d1 - zav
                s_used = s
            if cfg.need_grad and s_used > 0:
                # one-hot parts of G / s, scattered once per chunk
                if cfg.ce > 0:
                    zd.index_put_((rows_c, lab_c), torch.full((n,), -cfg.ce / s_used, dtype=cdt, device=device),
                                  accumulate=True)
                if cfg.vce > 0:
                    zd.index_put_((rows_c, av_c), torch.full((n,), -cfg.vce / s_used, dtype=cdt, device=device),
                                  accumulate=True)
            if cfg.need_grad and s_used > 0:
                dh_c = dh_buf[:n]
                if on_cuda and w.dtype != cdt:
                    _device_mm(zd.to(w.dtype), w, dh_c)
                else:
                    torch.mm(zd, w_mm, out=dh_c)
                dh_c.mul_((w_k[c0:c1] * (s_used / w_sum)).unsqueeze(1))
                if compact:
                    dh.index_copy_(0, keep[c0:c1], dh_c.to(dh.dtype))
                else:
                    dh[c0:c1] = dh_c
    if not have_ce:
        ce_k = None
        vce_k = None

    # loss and weighted term means
    def wmean(x: Tensor) -> Tensor:
        if n_keep == 0:
            return torch.zeros((), dtype=cdt, device=device)
        return (w_k.double() @ x.double() / w_sum.double()).to(cdt)

    zero = torch.zeros((), dtype=cdt, device=device)
    terms: dict[str, Tensor] = {}
    if ce_k is not None:
        terms["ce"] = wmean(ce_k)
    if kl_k is not None:
        terms["kl"] = wmean(kl_k)
    if vce_k is not None:
        terms["verifier_ce"] = wmean(vce_k)
    loss = zero.clone()
    if n_keep:
        per_row = torch.zeros(n_keep, dtype=cdt, device=device)
        if cfg.ce > 0:
            per_row.add_(ce_k, alpha=cfg.ce)
        if cfg.kl > 0:
            per_row.add_(kl_k, alpha=cfg.kl)
        if cfg.vce > 0:
            per_row.add_(vce_k, alpha=cfg.vce)
        loss = wmean(per_row)

    # stats back in the original row order
    def expand(x: Tensor | None, fill) -> Tensor | None:
        if x is None:
            return None
        if not compact:
            return x
        full = torch.full((r_all,), fill, dtype=x.dtype, device=device)
        return full.index_copy_(0, keep, x)

    ad_full = expand(ad_k, -1)
    lab_ok = labels if not compact else expand(labels_k, -1)
    stats = VerifierLossStats(
        drafter_argmax=ad_full,
        data_hit=(ad_full == lab_ok) & (ad_full >= 0),
        ce=expand(ce_k, 0.0),
    )
    if h_v is not None:
        av_full = expand(av_k, -1)
        stats.verifier_argmax = av_full
        stats.verifier_hit = (ad_full == av_full) & (ad_full >= 0)
        stats.kl = expand(kl_k, 0.0)
        stats.verifier_ce = expand(vce_k, 0.0)
    cfg.result["stats"] = stats
    cfg.result["terms"] = terms
    cfg.result["weight_sum"] = w_sum
    return loss, dh


class _VerifierLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_d, h_v, w, labels, weights, cfg: _Cfg):
        loss, dh = _forward_impl(h_d.detach(), h_v, w, labels, weights, cfg)
        ctx.save_for_backward(dh if dh is not None else torch.zeros_like(h_d))
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        (dh,) = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0]:
            grad = dh * grad_output.to(dh.dtype) if dh.dtype != grad_output.dtype else dh * grad_output
        return grad, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# public entry point


def _check_coef(name: str, value: float) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def verifier_loss(
    drafter_hidden: Tensor,
    verifier_hidden: Tensor | None,
    lm_head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    ce: float = 1.0,
    kl: float = 0.0,
    verifier_ce: float = 0.0,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    mem_budget_gib: float = DEFAULT_MEM_BUDGET_GIB,
    compile: bool = False,
    *,
    row_block: int | None = None,
) -> VerifierLossOutput:
    """Weighted ce / kl / verifier_ce loss of the drafter logits against the data and the verifier.

    Args:
        drafter_hidden: ``[R, H]`` float, the drafter's final hidden of the supervised slots; the
            only input that receives a gradient.
        verifier_hidden: ``[R, H]`` float, the target's final (post-norm) hidden at position
            ``slot - 1``, without grad. May be None when ``kl == verifier_ce == 0``; then the
            verifier GEMM is skipped and the verifier stats are None.
        lm_head_weight: ``[V, H]`` frozen lm_head (must not require grad).
        labels: ``[R]`` integer data tokens. Checked to lie in ``[0, V)`` on rows with weight > 0;
            rows with weight 0 may hold anything (e.g. ``-100``).
        weights: ``[R]`` float, finite and ``>= 0`` (slot decay x loss mask). Rows with weight 0
            are dropped before any GEMM and cost nothing.
        ce, kl, verifier_ce: non-negative coefficients of the three terms.
        temperature: ``T > 0`` of the KL term (scaled by ``T^2``); CE terms are at ``T = 1``.
        chunk_size: rows per chunk; None picks :func:`default_chunk_size` from ``mem_budget_gib``.
        mem_budget_gib: budget of the ``[C, V]`` chunk buffers when ``chunk_size`` is None
            (default 2 GiB, the ``LossConfig`` default).
        compile: ``torch.compile`` the per-row-block math (the chunk loop stays eager).
        row_block: rows per elementwise block (tuning; default 8 on CPU, 256 on CUDA).

    Returns:
        :class:`VerifierLossOutput`: ``loss`` (scalar, fp32 or fp64; 0 with a zero gradient when
        all weights are 0), per-row ``stats``, weighted-mean ``terms``.

    Raises:
        ValueError: naming the argument, on mismatched shapes, dtypes or devices, negative or
            non-finite weights, labels outside ``[0, V)``, ``verifier_hidden`` or ``lm_head_weight``
            requiring grad, negative coefficients, ``temperature <= 0``, ``chunk_size < 1``, or a
            missing ``verifier_hidden`` when ``kl`` or ``verifier_ce`` is non-zero.
    """
    # ---- argument checks (all raise ValueError naming the argument)
    if not isinstance(drafter_hidden, Tensor) or drafter_hidden.dim() != 2:
        raise ValueError(f"drafter_hidden must be a 2-D [R, H] tensor, got "
                         f"{getattr(drafter_hidden, 'shape', type(drafter_hidden))}")
    if not drafter_hidden.is_floating_point():
        raise ValueError(f"drafter_hidden must be floating point, got {drafter_hidden.dtype}")
    r_all, hid = drafter_hidden.shape
    device = drafter_hidden.device
    if not isinstance(lm_head_weight, Tensor) or lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hid:
        raise ValueError(f"lm_head_weight must be [V, H={hid}], got "
                         f"{tuple(getattr(lm_head_weight, 'shape', ()))}")
    if not lm_head_weight.is_floating_point():
        raise ValueError(f"lm_head_weight must be floating point, got {lm_head_weight.dtype}")
    if lm_head_weight.device != device:
        raise ValueError(f"lm_head_weight is on device {lm_head_weight.device} but drafter_hidden on {device}")
    if lm_head_weight.requires_grad:
        raise ValueError("lm_head_weight must not require grad (the head is frozen); pass "
                         "lm_head_weight.detach()")
    vocab = lm_head_weight.shape[0]
    if verifier_hidden is not None:
        if not isinstance(verifier_hidden, Tensor) or tuple(verifier_hidden.shape) != (r_all, hid):
            raise ValueError(f"verifier_hidden must be [R={r_all}, H={hid}] like drafter_hidden, got "
                             f"{tuple(getattr(verifier_hidden, 'shape', ()))}")
        if not verifier_hidden.is_floating_point():
            raise ValueError(f"verifier_hidden must be floating point, got {verifier_hidden.dtype}")
        if verifier_hidden.device != device:
            raise ValueError(f"verifier_hidden is on device {verifier_hidden.device} but drafter_hidden on {device}")
        if verifier_hidden.requires_grad:
            raise ValueError("verifier_hidden must not require grad; pass verifier_hidden.detach()")
    if not isinstance(labels, Tensor) or tuple(labels.shape) != (r_all,):
        raise ValueError(f"labels must be [R={r_all}], got {tuple(getattr(labels, 'shape', ()))}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.device != device:
        raise ValueError(f"labels is on device {labels.device} but drafter_hidden on {device}")
    if not isinstance(weights, Tensor) or tuple(weights.shape) != (r_all,):
        raise ValueError(f"weights must be [R={r_all}], got {tuple(getattr(weights, 'shape', ()))}")
    if not weights.is_floating_point():
        raise ValueError(f"weights must be floating point, got {weights.dtype}")
    if weights.device != device:
        raise ValueError(f"weights is on device {weights.device} but drafter_hidden on {device}")
    if weights.requires_grad:
        raise ValueError("weights must not require grad")
    ce = _check_coef("ce", ce)
    kl = _check_coef("kl", kl)
    verifier_ce = _check_coef("verifier_ce", verifier_ce)
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"temperature must be a number, got {temperature!r}") from None
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    if not (isinstance(mem_budget_gib, (int, float)) and mem_budget_gib > 0 and math.isfinite(mem_budget_gib)):
        raise ValueError(f"mem_budget_gib must be a finite number > 0, got {mem_budget_gib!r}")
    if row_block is not None and (not isinstance(row_block, int) or row_block < 1):
        raise ValueError(f"row_block must be None or an int >= 1, got {row_block!r}")
    if verifier_hidden is None and (kl > 0 or verifier_ce > 0):
        raise ValueError(f"verifier_hidden is required when kl ({kl}) or verifier_ce ({verifier_ce}) is > 0")
    # value checks: one host sync for all of them
    with torch.no_grad():
        pos = weights > 0
        bad = torch.stack([
            ~torch.isfinite(weights).all(),
            (weights < 0).any(),
            (pos & ((labels < 0) | (labels >= vocab))).any(),
        ]).tolist() if r_all else [False, False, False]
    if bad[0]:
        raise ValueError("weights must be finite (found inf or nan)")
    if bad[1]:
        raise ValueError("weights must be >= 0 (found a negative weight)")
    if bad[2]:
        raise ValueError(f"labels must lie in [0, V={vocab}) on rows with weight > 0")

    labels = labels.to(torch.int64)
    if chunk_size is None:
        cdt_bytes = 8 if torch.float64 in (drafter_hidden.dtype, lm_head_weight.dtype) else 4
        chunk_size = default_chunk_size(vocab, mem_budget_gib, verifier_hidden is not None, cdt_bytes)
    if row_block is None:
        row_block = _CUDA_ROW_BLOCK if device.type == "cuda" else _CPU_ROW_BLOCK
    need_grad = torch.is_grad_enabled() and drafter_hidden.requires_grad
    cfg = _Cfg(ce=ce, kl=kl, vce=verifier_ce, temperature=temperature, chunk=chunk_size,
               row_block=row_block, need_grad=need_grad, compile=bool(compile))
    vh = verifier_hidden.detach() if verifier_hidden is not None else None
    if need_grad:
        loss = _VerifierLossFn.apply(drafter_hidden, vh, lm_head_weight, labels, weights, cfg)
    else:
        with torch.no_grad():
            loss, _ = _forward_impl(drafter_hidden.detach(), vh, lm_head_weight, labels, weights, cfg)
    res = cfg.result
    return VerifierLossOutput(loss=loss, stats=res["stats"], terms=res["terms"],
                              weight_sum=res["weight_sum"], chunk_size=res["chunk_size"])
