"""Chunked verifier-logit loss: exact CE / KL / verifier-CE without ever holding ``[rows, vocab]``.

The drafter's loss compares drafter logits ``z_d = h_d W^T`` with verifier logits ``z_v = h_v W^T``
(``W`` is the frozen target lm_head, shared by the drafter). Materialising both for every supervised
slot is tens of GB at a 150K-250K vocabulary. :func:`verifier_loss` instead:

1. drops the rows whose weight is 0 (``index_select`` of the hidden states, before any GEMM);
2. for each chunk of ``C`` rows projects both hidden chunks into two preallocated fp32 ``[C, V]``
   buffers (fp32 accumulation for bf16 inputs: ``mm(..., out_dtype=float32)`` on CUDA, upcast
   operands on CPU; never a bf16 GEMM followed by ``.float()``);
3. walks the chunk in row blocks and, per block: max/argmax of both logit rows (blocked ``amax``),
   ``d = z_v - z_d`` into a small ``[S, V]`` scratch, the verifier softmax in place, one row dot
   ``sum p (z_v - z_d)`` for the KL, the drafter softmax in place, and the gradient
   ``dL/dz_d`` written in place over the drafter logits (``q - c p``; the one-hot parts are
   scattered once per chunk). CPU fast path at ``T = 1``: the GEMMs produce base-2 logits
   (``h / ln 2`` times ``W^T``) and the softmaxes become unnormalised ``exp2(z2 - max)`` (``exp2``
   is ~35% cheaper than ``exp`` on CPU), the row sums folded into the coefficients;
4. ``dh_chunk = G @ W`` (one GEMM), scaled per row by ``w_r * s / sum(w)`` (and ``1 / s_d`` on the
   exp2 path) on the ``[C, H]`` result.

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

Elementwise passes over each ``[S, V]`` row block (ce+kl, T = 1, CPU): 2 blocked max reads, 1
``sub`` for ``d`` (read 2, write 1), per distribution 1 ``exp2_`` in place and 1 row ``sum`` (the
only transcendental work: 2 per logit, the minimum; the max is subtracted first only for rows whose
base-2 maximum is outside [-20, 64] in fp32), 1 ``mul_`` + ``sum`` for the row dot and 1
``addcmul_`` for the gradient (read 2, write 1). The general path (``T != 1``, CUDA,
``compile=True``) uses in-place softmaxes, and at ``T != 1`` a second scratch for
``softmax(z_d / T)``. ce only: 1 blocked max read, 1 ``exp2_`` + ``sum`` and the label scatter. No
``[C, V]`` buffer is allocated per chunk, and on CPU the workspace is kept between calls.

Memory beyond the inputs: ``[C, V]`` fp32 x 2 (x 1 without ``verifier_hidden``) and the
``[S, V]`` scratch (x 2 at ``T != 1``; S = 128 rows on CPU, 256 on CUDA) in one workspace (on
Linux CPU backed by transparent huge pages, and kept for the next call: first-touch page faults of
fresh buffers measured 0.5-0.9 s per call at 1024 x 152K; ``keep_workspace=False`` or
:func:`release_workspace` to free it), plus ``dh`` ``[R, H]`` and a compacted copy of the kept
hidden rows. On CPU with bf16 inputs an fp32 copy of ``W`` is made once per call (CPU bf16 is for
tests only).

Call this outside any ``torch.compile`` region; ``compile=True`` compiles only the per-row-block
math (Inductor; on CPU it needs a C++ compiler and measured slower than eager, whose softmax
computes each ``exp`` once; meant for GPUs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from dflash.loss.kernels import LN2, LOG2E, block_math_exp2, get_block_math
from dflash.loss.workspace import acquire_workspace, return_workspace

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
# Rows per elementwise block. On CPU the row ops are exp/bandwidth bound and cache residency of
# smaller blocks measured no gain, while every op is an OpenMP parallel region: with shared cores,
# 32-row blocks spent seconds in futex waits where 128-row blocks did not. Scratch: 128 x V x 4 B.
_CPU_ROW_BLOCK = 128
_CUDA_ROW_BLOCK = 256
_CPU_EXP2 = True  # the T = 1 CPU fast path (base-2 logits, unnormalised exp2); False: softmax path


def default_chunk_size(
    vocab_size: int,
    mem_budget_gib: float = DEFAULT_MEM_BUDGET_GIB,
    with_verifier: bool = True,
    dtype_bytes: int = 4,
) -> int:
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
    keep_workspace: bool = True
    result: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# the autograd Function


def _forward_impl(
    h_d: Tensor, h_v: Tensor | None, w: Tensor, labels: Tensor, weights: Tensor, cfg: _Cfg
) -> tuple[Tensor, Tensor | None]:
    # autocast would recast the GEMMs to bf16 outputs: the precision here is explicit instead
    with torch.autocast(device_type=h_d.device.type, enabled=False):
        return _forward_impl_body(h_d, h_v, w, labels, weights, cfg)


def _forward_impl_body(
    h_d: Tensor, h_v: Tensor | None, w: Tensor, labels: Tensor, weights: Tensor, cfg: _Cfg
) -> tuple[Tensor, Tensor | None]:
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
    ce_k: Tensor | None = torch.empty(n_keep, dtype=cdt, device=device)
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
        ws_full = acquire_workspace((n_big * chunk + n_sc * rb) * vocab, cdt, device, cfg.keep_workspace)
        ws = ws_full[: (n_big * chunk + n_sc * rb) * vocab]
        bufs = ws[: n_big * chunk * vocab].view(n_big, chunk, vocab)
        zd_buf = bufs[0]
        zv_buf = bufs[1] if h_v is not None else None
        scr = ws[n_big * chunk * vocab :].view(n_sc, rb, vocab)
        sc = scr[0] if n_sc >= 1 else None
        sc2 = scr[1] if n_sc >= 2 else None
        dh_buf = torch.empty((chunk, hid), dtype=cdt, device=device) if cfg.need_grad else None
        block_fn = get_block_math(cfg.compile)
        # CPU, T = 1, fp32/fp64 GEMM operands: base-2 logits from (h / ln 2) @ W^T and the exp2 path
        use_exp2 = (
            _CPU_EXP2
            and device.type == "cpu"
            and cfg.temperature == 1.0
            and not cfg.compile
            and w_mm.dtype == cdt
        )
        h_scale = LOG2E if use_exp2 else 1.0
        z_scale = LN2 if use_exp2 else 1.0  # natural logit per unit of the buffers
        arange_c = torch.arange(chunk, device=device)
        fac_c = torch.ones(chunk, dtype=cdt, device=device)  # per-row s_d of the exp2 path

        def project(hc: Tensor, out: Tensor) -> None:
            if hc.dtype != w_mm.dtype:
                hc = hc.to(w_mm.dtype)
            if h_scale != 1.0:
                hc = hc * h_scale
            _device_mm(hc, w_t, out)

        for c0 in range(0, n_keep, chunk):
            c1 = min(c0 + chunk, n_keep)
            n = c1 - c0
            zd = zd_buf[:n]
            project(h_d[c0:c1], zd)
            zv = None
            if h_v is not None:
                assert zv_buf is not None
                zv = zv_buf[:n]
                project(h_v[c0:c1], zv)
            rows_c = arange_c[:n]
            lab_c = labels_k[c0:c1]
            zlab = zd[rows_c, lab_c]
            if z_scale != 1.0:
                zlab = zlab * z_scale
            av_c = av_k[c0:c1] if av_k is not None else None
            fac = fac_c[:n]
            for b0 in range(0, n, rb):
                b1 = min(b0 + rb, n)
                m = b1 - b0
                zv_b = zv[b0:b1] if zv is not None else None
                sc_b = sc[:m] if sc is not None else None
                if use_exp2:
                    ad, lse_d1, av, zav, kl_r, s, sd = block_math_exp2(
                        zv_b, zd[b0:b1], sc_b, cfg.ce, cfg.kl, cfg.vce, cfg.need_grad
                    )
                    fac[b0:b1] = sd
                else:
                    _, ad, lse_d1, av, zav, kl_r, s = block_fn(
                        zv_b,
                        zd[b0:b1],
                        sc_b,
                        sc2[:m] if sc2 is not None else None,
                        cfg.ce,
                        cfg.kl,
                        cfg.vce,
                        cfg.temperature,
                        cfg.need_grad,
                    )
                g0, g1 = c0 + b0, c0 + b1
                ad_k[g0:g1] = ad
                if lse_d1 is None:
                    have_ce = False
                else:
                    assert ce_k is not None
                    ce_k[g0:g1] = lse_d1 - zlab[b0:b1]
                if zv is not None:
                    assert av_k is not None and kl_k is not None and vce_k is not None
                    av_k[g0:g1] = av
                    kl_k[g0:g1] = kl_r
                    if lse_d1 is not None:
                        vce_k[g0:g1] = lse_d1 - zav
                s_used = s
            if cfg.need_grad and s_used > 0:
                # one-hot parts of G / s (times s_d on the exp2 path), scattered once per chunk
                if cfg.ce > 0:
                    zd.index_put_((rows_c, lab_c), fac * (-cfg.ce / s_used), accumulate=True)
                if cfg.vce > 0:
                    zd.index_put_((rows_c, av_c), fac * (-cfg.vce / s_used), accumulate=True)
                assert dh_buf is not None and dh is not None
                dh_c = dh_buf[:n]
                if on_cuda and w.dtype != cdt:
                    _device_mm(zd.to(w.dtype), w, dh_c)
                else:
                    torch.mm(zd, w_mm, out=dh_c)
                dh_c.mul_((w_k[c0:c1] * (s_used / w_sum) / fac).unsqueeze(1))
                if compact:
                    dh.index_copy_(0, keep[c0:c1], dh_c.to(dh.dtype))
                else:
                    dh[c0:c1] = dh_c
        del zd, zv, bufs, zd_buf, zv_buf, scr, sc, sc2, ws
        return_workspace(ws_full, cfg.keep_workspace)
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
        for coef, term in ((cfg.ce, ce_k), (cfg.kl, kl_k), (cfg.vce, vce_k)):
            if coef > 0:
                assert term is not None, "a weighted term was not computed"
                per_row.add_(term, alpha=coef)
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
    assert ad_full is not None and lab_ok is not None
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
    @once_differentiable
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
    keep_workspace: bool = True,
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
        row_block: rows per elementwise block (tuning; default 128 on CPU, 256 on CUDA).
        keep_workspace: on CPU keep the chunk buffers for the next call (saves their page faults,
            ~0.5-0.9 s per call at 1024 x 152K); :func:`release_workspace` frees them. No effect
            on CUDA, where the caching allocator does the same.

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
        raise ValueError(
            f"drafter_hidden must be a 2-D [R, H] tensor, got "
            f"{getattr(drafter_hidden, 'shape', type(drafter_hidden))}"
        )
    if not drafter_hidden.is_floating_point():
        raise ValueError(f"drafter_hidden must be floating point, got {drafter_hidden.dtype}")
    r_all, hid = drafter_hidden.shape
    device = drafter_hidden.device
    if not isinstance(lm_head_weight, Tensor) or lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hid:
        raise ValueError(
            f"lm_head_weight must be [V, H={hid}], got {tuple(getattr(lm_head_weight, 'shape', ()))}"
        )
    if not lm_head_weight.is_floating_point():
        raise ValueError(f"lm_head_weight must be floating point, got {lm_head_weight.dtype}")
    if lm_head_weight.device != device:
        raise ValueError(
            f"lm_head_weight is on device {lm_head_weight.device} but drafter_hidden on {device}"
        )
    if lm_head_weight.requires_grad:
        raise ValueError(
            "lm_head_weight must not require grad (the head is frozen); pass lm_head_weight.detach()"
        )
    vocab = lm_head_weight.shape[0]
    if verifier_hidden is not None:
        if not isinstance(verifier_hidden, Tensor) or tuple(verifier_hidden.shape) != (r_all, hid):
            raise ValueError(
                f"verifier_hidden must be [R={r_all}, H={hid}] like drafter_hidden, got "
                f"{tuple(getattr(verifier_hidden, 'shape', ()))}"
            )
        if not verifier_hidden.is_floating_point():
            raise ValueError(f"verifier_hidden must be floating point, got {verifier_hidden.dtype}")
        if verifier_hidden.device != device:
            raise ValueError(
                f"verifier_hidden is on device {verifier_hidden.device} but drafter_hidden on {device}"
            )
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
    if not (
        isinstance(mem_budget_gib, (int, float)) and mem_budget_gib > 0 and math.isfinite(mem_budget_gib)
    ):
        raise ValueError(f"mem_budget_gib must be a finite number > 0, got {mem_budget_gib!r}")
    if row_block is not None and (not isinstance(row_block, int) or row_block < 1):
        raise ValueError(f"row_block must be None or an int >= 1, got {row_block!r}")
    if verifier_hidden is None and (kl > 0 or verifier_ce > 0):
        raise ValueError(f"verifier_hidden is required when kl ({kl}) or verifier_ce ({verifier_ce}) is > 0")
    # value checks: one host sync for all of them
    with torch.no_grad():
        pos = weights > 0
        bad = (
            torch.stack(
                [
                    ~torch.isfinite(weights).all(),
                    (weights < 0).any(),
                    (pos & ((labels < 0) | (labels >= vocab))).any(),
                ]
            ).tolist()
            if r_all
            else [False, False, False]
        )
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
    cfg = _Cfg(
        ce=ce,
        kl=kl,
        vce=verifier_ce,
        temperature=temperature,
        chunk=chunk_size,
        row_block=row_block,
        need_grad=need_grad,
        compile=bool(compile),
        keep_workspace=bool(keep_workspace),
    )
    vh = verifier_hidden.detach() if verifier_hidden is not None else None
    if need_grad:
        loss = _VerifierLossFn.apply(drafter_hidden, vh, lm_head_weight, labels, weights, cfg)
    else:
        with torch.no_grad():
            loss, _ = _forward_impl(drafter_hidden.detach(), vh, lm_head_weight, labels, weights, cfg)
    res = cfg.result
    return VerifierLossOutput(
        loss=loss,
        stats=res["stats"],
        terms=res["terms"],
        weight_sum=res["weight_sum"],
        chunk_size=res["chunk_size"],
    )
