"""Chunked verifier-logit loss: exact CE / KL / verifier-CE without ever holding ``[rows, vocab]``.

The drafter's loss compares drafter logits ``z_d = h_d W^T`` with verifier logits ``z_v = h_v W^T``
(``W`` is the frozen target lm_head, shared by the drafter). Materialising both for every supervised
slot is tens of GB at a 150K-250K vocabulary. :func:`verifier_loss` instead:

1. drops the rows whose weight is 0 (``index_select`` of the hidden states, before any GEMM) and,
   with ``verifier_index`` (row ``r`` reads verifier row ``verifier_index[r]``: the rows of
   overlapping blocks share positions), orders the rows by it (no copy when already ordered);
2. for each chunk of ``C`` rows projects the drafter hidden chunk into a preallocated fp32
   ``[C, V]`` buffer and the chunk's distinct verifier rows (``P_c <= C``; without
   ``verifier_index`` each row's own) into a ``[P_c, V]`` one (fp32 accumulation for bf16 inputs:
   ``mm(..., out_dtype=float32)`` on CUDA, upcast operands on CPU; never a bf16 GEMM followed by
   ``.float()``): the verifier's GEMM, argmax, softmax and log-sum-exp are done once per position
   (``kernels.position_math``), not once per row;
3. walks the chunk in row blocks and, per block: max/argmax of the drafter rows (blocked ``amax``),
   the rows' verifier softmax (a view, or gathered from the per-position buffer into an ``[S, V]``
   scratch), one row dot ``sum p z_d`` for the KL (``sum p z_v`` is the position's), the drafter
   softmax in place, and the gradient ``dL/dz_d`` written in place over the drafter logits
   (``q - c p``; the one-hot parts are scattered once per chunk). CPU fast path at ``T = 1``: the GEMMs produce base-2 logits
   (``h / ln 2`` times ``W^T``) and the softmaxes become unnormalised ``exp2(z2 - max)`` (``exp2``
   is cheaper than ``exp`` on CPU), the row sums folded into the coefficients;
4. ``dh_chunk = G @ W`` (one GEMM), scaled per row by ``w_r * s / sum(w)`` (and ``1 / s_d`` on the
   exp2 path) on the ``[C, H]`` result.

Only ``dh`` (``[R, H]``, the drafter dtype) is kept for backward, which returns
``grad_output * dh``. No ``[R, V]`` tensor, no recompute in backward, no ``roll``. FLOPs: 2 GEMMs of
``2 R H V`` (drafter logits, ``dh``) and the verifier's ``2 U H V`` over the ``U`` distinct
positions (``U = R`` without ``verifier_index``; ~R/10 for the recipe's overlapping blocks).

Per row ``r`` (all logits in fp32, or fp64 for fp64 inputs)::

    CE_r  = lse(z_d) - z_d[label_r]
    VCE_r = lse(z_d) - z_d[argmax z_v]
    KL_r  = T^2 * KL(softmax(z_v / T) || softmax(z_d / T))
          = T^2 * (sum_v p_T (z_v - z_d) / T - lse(z_v / T) + lse(z_d / T))
    loss  = sum_r w_r (ce CE_r + kl KL_r + verifier_ce VCE_r) / N      (N = normalizer, default sum_r w_r)
    dL/dz_d[r] = w_r / N * (ce (q_1 - 1[label]) + kl T (q_T - p_T) + verifier_ce (q_1 - 1[argmax z_v]))

``lse`` is recovered from the in-place softmax: ``lse = max - log(p[argmax])`` (``p[argmax] >= 1/V``,
so it never underflows). The row argmax uses a blocked ``amax`` (one reduction over the row, then
``argmax`` over one block of columns only); ties resolve to the first index, as ``torch.argmax``.

Elementwise passes over each ``[S, V]`` row block (ce+kl, T = 1, CPU): 1 blocked max read, 1
gather of the rows' verifier softmax when rows share positions (read 1, write 1), 1 ``mul`` +
``sum`` for the row dot, 1 ``exp2_`` in place and 1 row ``sum`` for the drafter (the max is
subtracted first only for rows whose base-2 maximum is outside [-20, 64] in fp32) and 1
``addcmul_`` for the gradient (read 2, write 1); per distinct position, once: 1 blocked max, a copy,
1 ``exp2_``, a ``sum``, the normalisation and the ``sum p z_v`` dot. The general path (``T != 1``,
CUDA, ``compile=True``) uses in-place softmaxes, and at ``T != 1`` the scratch for
``softmax(z_d / T)``. ce only: 1 blocked max read, 1 ``exp2_`` + ``sum`` and the label scatter. No
``[C, V]`` buffer is allocated per chunk, and on CPU the workspace is kept between calls.

Memory beyond the inputs: ``[C, V]`` fp32 for the drafter, ``[P_max, V]`` for the verifier (the most
distinct positions of a chunk; ``C`` without ``verifier_index``, none without ``verifier_hidden``)
and an ``[S, V]`` scratch (x 2 when rows share positions: the gathered verifier rows; S = 128 rows on
CPU, 256 on CUDA) in one workspace (on
Linux CPU backed by transparent huge pages, and kept for the next call, so a fresh multi-GB buffer's
first-touch page faults are paid once; ``keep_workspace=False`` or :func:`release_workspace` to
free it), plus ``dh`` ``[R, H]`` and a compacted copy of the kept
hidden rows. On CPU with bf16 inputs an fp32 copy of ``W`` is made once per call (CPU bf16 is for
tests only).

Call this outside any ``torch.compile`` region; ``compile=True`` compiles only the per-row-block
math (Inductor; meant for GPUs: on CPU it needs a C++ compiler, and the eager CPU path already
computes each ``exp`` once).

One module for one algorithm: the chunk loop, its forward/backward autograd function, the argument
checks and the GEMM helpers all serve :func:`verifier_loss` (the per-block math is in ``kernels``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from dflash.loss.device import kernel_device
from dflash.loss.kernels import LN2, LOG2E, block_math_exp2, get_kernels, position_math_exp2
from dflash.loss.terms import BY_NAME, TERMS, GradientPlan, computed_terms, gradient_plan
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
# Rows per elementwise block. On CPU the row ops are exp/bandwidth bound, and every op is an
# OpenMP parallel region: fewer, larger blocks mean fewer thread synchronisations when cores are
# shared. Scratch: rows x V x 4 B.
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
    fields are None when ``verifier_hidden`` is None. ``terms`` holds the per-row (unweighted) value
    of every term the row quantities give, whatever its coefficient (:mod:`dflash.loss.terms`): the
    terms that read the verifier whenever ``verifier_hidden`` is given, the ones that read the
    drafter's log-sum-exp at temperature 1 unless only temperature-T terms are weighted at
    ``temperature != 1`` (they would cost an extra softmax).
    """

    drafter_argmax: Tensor  # [R] int64
    data_hit: Tensor  # [R] bool: drafter argmax == label
    terms: dict[str, Tensor] = field(default_factory=dict)  # name -> [R] compute dtype
    verifier_argmax: Tensor | None = None  # [R] int64
    verifier_hit: Tensor | None = None  # [R] bool: drafter argmax == verifier argmax


@dataclass
class VerifierLossOutput:
    loss: Tensor
    """Scalar (fp32, or fp64 for fp64 inputs) with grad w.r.t. ``drafter_hidden`` only."""
    stats: VerifierLossStats
    terms: dict[str, Tensor] = field(default_factory=dict)
    """Weighted means (no grad) of each term that was computed (``VerifierLossStats.terms``)."""
    weight_sum: Tensor | None = None
    chunk_size: int = 0
    """The chunk size used (after the default and the clamp to the number of kept rows)."""


def _device_mm(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """``out = a @ b`` with ``out``'s (fp32/fp64) accumulation and output, never a low-precision output."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    if a.dtype == b.dtype and kernel_device(a.device) == "cuda":
        try:
            return torch.mm(a, b, out_dtype=out.dtype, out=out)
        except torch.OutOfMemoryError:
            raise  # the fallback's upcast copies would need more memory, not less
        except (RuntimeError, TypeError):  # pragma: no cover - older torch / arch
            pass
    return torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


@dataclass
class _Cfg:
    coefs: dict[str, float]
    """Every term's coefficient (:mod:`dflash.loss.terms`)."""
    grad: GradientPlan
    temperature: float
    chunk: int
    row_block: int
    need_grad: bool
    compile: bool
    normalizer: float | None = None
    """The loss is ``sum_r w_r l_r / normalizer``; None: ``sum_r w_r`` (the weighted mean)."""
    keep_workspace: bool = True
    checked_rows: bool = False
    """The caller vouches for every row (``verifier_loss(checked_rows=True)``)."""
    reweight: Callable[[Tensor], Tensor] | None = None
    """Per-row loss values [R] -> multipliers [R] of the row weights (``verifier_loss(reweight=...)``)."""
    reweight_normalizer: str = "sum"
    verifier_index: Tensor | None = None
    """[R] host int64: the verifier row each row reads (``verifier_loss(verifier_index=...)``)."""
    result: dict = field(default_factory=dict)


@dataclass
class _Rows:
    """The rows with weight > 0 in the order they are computed (a compacted copy when some rows
    have weight 0 or ``verifier_index`` had to be sorted)."""

    keep: Tensor
    """[n] int64 indices of the kept rows among the R rows, in computing order."""
    compact: bool
    h_d: Tensor
    h_v: Tensor | None
    """[n, H] (each row its own verifier row) or, with ``index``, the caller's ``[P, H]``."""
    labels: Tensor
    weights: Tensor
    """[n] in the compute dtype."""
    index: Tensor | None = None
    """[n] host int64, non-decreasing: the verifier row each kept row reads (None: its own)."""

    @property
    def n(self) -> int:
        return int(self.keep.numel())


def _kept_rows(
    h_d: Tensor,
    h_v: Tensor | None,
    labels: Tensor,
    weights: Tensor,
    cdt: torch.dtype,
    every_row: bool,
    index: Tensor | None,
) -> _Rows:
    """The rows with weight > 0 (``every_row``: all of them, as the caller vouches: no host sync);
    with a host ``index`` ([R] verifier rows), ordered by it (stable; no copy when already sorted)."""
    r_all, device = h_d.shape[0], h_d.device
    if every_row:
        keep = torch.arange(r_all, device=device)
    else:
        keep = torch.nonzero(weights > 0).view(-1)
    reordered = False
    if index is not None:
        if keep.numel() != r_all:
            index = index[keep.cpu()]
        if index.numel() > 1 and not bool((index[1:] >= index[:-1]).all()):
            order = torch.argsort(index, stable=True)
            index = index[order]
            keep = keep.index_select(0, order.to(device, non_blocking=True))
            reordered = True
    if keep.numel() == r_all and not reordered:
        return _Rows(keep, False, h_d, h_v, labels, weights.to(cdt), index)
    return _Rows(
        keep,
        True,
        h_d.index_select(0, keep),
        h_v if index is not None or h_v is None else h_v.index_select(0, keep),
        labels.index_select(0, keep),
        weights.index_select(0, keep).to(cdt),
        index,
    )


@dataclass
class _Positions:
    """The distinct verifier rows each chunk of kept rows reads (rows sorted by ``_Rows.index``)."""

    rows: Tensor
    """[sum_c P_c] int64 on the device: chunk after chunk, its distinct verifier rows."""
    local: Tensor
    """[n] int64 on the device: each kept row's position among its chunk's ``P_c``."""
    bounds: list[tuple[int, int]]
    """Per chunk, its slice of ``rows``."""

    @property
    def most(self) -> int:
        """The largest ``P_c``: rows of the per-position buffer."""
        return max(u1 - u0 for u0, u1 in self.bounds)

    @classmethod
    def plan(cls, index: Tensor, chunk: int, device: torch.device) -> _Positions:
        """From the host ``index`` (sorted) and the chunk size: host work, two non-blocking copies."""
        rows, local, bounds, at = [], [], [], 0
        for c0 in range(0, index.numel(), chunk):
            distinct, inverse = torch.unique_consecutive(index[c0 : c0 + chunk], return_inverse=True)
            rows.append(distinct)
            local.append(inverse)
            bounds.append((at, at + distinct.numel()))
            at += distinct.numel()
        return cls(
            torch.cat(rows).to(device, non_blocking=True),
            torch.cat(local).to(device, non_blocking=True),
            bounds,
        )


def row_quantities(with_verifier: bool, cfg: _Cfg) -> set[str]:
    """The row quantities of :mod:`dflash.loss.terms` a call computes: the label logit always, the
    temperature-1 log-sum-exp unless only temperature-T terms are weighted at ``T != 1``, the
    verifier's with the verifier logits."""
    out = {"zlab"}
    if cfg.temperature == 1.0 or cfg.grad.q1 > 0:
        out.add("lse_d1")
    if with_verifier:
        out |= {"zav", "kl"}
    return out


@dataclass
class _RowStats:
    """Per kept row (compacted order): argmaxes, and the per-row value of every computed term."""

    ad: Tensor
    av: Tensor | None
    terms: dict[str, Tensor]

    @classmethod
    def empty(
        cls, n: int, with_verifier: bool, cfg: _Cfg, cdt: torch.dtype, device: torch.device
    ) -> _RowStats:
        def new(dtype: torch.dtype) -> Tensor:
            return torch.empty(n, dtype=dtype, device=device)

        computed = computed_terms(row_quantities(with_verifier, cfg))
        return cls(
            new(torch.int64),
            new(torch.int64) if with_verifier else None,
            {t.name: new(cdt) for t in computed},
        )


class _ChunkLoop:
    """The chunk buffers of one call and the work on one chunk of kept rows.

    Per chunk: the drafter projection into the fp32 ``[C, V]`` buffer; the verifier projection of
    the chunk's distinct verifier rows (``P_c <= C``; each row's own without ``verifier_index``)
    into the per-position buffer and, in blocks, the verifier softmax there (``position_math``);
    then the row blocks (``block_math`` or, on the CPU exp2 path, ``block_math_exp2``, each reading
    its rows' verifier softmax: a view of the per-position buffer, or gathered into a scratch) that
    fill the per-row outputs and leave the gradient w.r.t. the drafter logits over the drafter
    buffer, the one-hot parts of that gradient scattered once, and ``dh = G @ W`` scaled per row by
    ``w_r * s / normalizer`` (``/ s_d`` on the exp2 path)."""

    def __init__(self, w: Tensor, rows: _Rows, chunk: int, cdt: torch.dtype, cfg: _Cfg) -> None:
        device, vocab, hid = w.device, w.shape[0], w.shape[1]
        self.cfg, self.rows, self.w, self.cdt = cfg, rows, w, cdt
        self.on_cuda = kernel_device(device) == "cuda"
        # GEMM operand for the projections: W itself, or (CPU, low precision) an fp32 copy made once.
        self.w_mm = w if w.dtype == cdt or self.on_cuda else w.to(cdt)
        self.w_t = self.w_mm.t()
        with_v = rows.h_v is not None
        self.rb = max(1, min(cfg.row_block, chunk))
        self.positions = (
            _Positions.plan(rows.index, chunk, device) if with_v and rows.index is not None else None
        )
        n_pos = 0 if not with_v else (self.positions.most if self.positions is not None else chunk)
        # scratch blocks: the row dot / q_T, and the gathered verifier rows when rows share positions
        n_sc = 0 if not with_v else (1 if self.positions is None else 2)
        numel = (chunk + n_pos + n_sc * self.rb) * vocab
        self.ws_full = acquire_workspace(numel, cdt, device, cfg.keep_workspace)
        ws = self.ws_full[:numel]
        self.zd_buf = ws[: chunk * vocab].view(chunk, vocab)
        self.zv_buf = ws[chunk * vocab : (chunk + n_pos) * vocab].view(n_pos, vocab) if with_v else None
        scr = ws[(chunk + n_pos) * vocab :].view(n_sc, self.rb, vocab)
        self.sc = scr[0] if n_sc >= 1 else None
        self.gathered = scr[1] if n_sc >= 2 else None
        self.dh_buf = torch.empty((chunk, hid), dtype=cdt, device=device) if cfg.need_grad else None
        self.position_fn, self.block_fn = get_kernels(cfg.compile)
        # CPU, T = 1, fp32/fp64 GEMM operands: base-2 logits from (h / ln 2) @ W^T and the exp2 path
        self.use_exp2 = (
            _CPU_EXP2
            and kernel_device(device) == "cpu"
            and cfg.temperature == 1.0
            and not cfg.compile
            and self.w_mm.dtype == cdt
        )
        self.h_scale = LOG2E if self.use_exp2 else 1.0
        self.z_scale = LN2 if self.use_exp2 else 1.0  # natural logit per unit of the buffers
        self.arange_c = torch.arange(chunk, device=device)
        self.fac_c = torch.ones(chunk, dtype=cdt, device=device)  # per-row s_d of the exp2 path
        self.chunk_no = 0

    def close(self) -> None:
        """Give the workspace back (kept for the next call on CPU unless ``keep_workspace=False``)."""
        self.zd_buf = self.zv_buf = self.sc = self.gathered = None  # type: ignore[assignment]
        return_workspace(self.ws_full, self.cfg.keep_workspace)

    def _project(self, hc: Tensor, out: Tensor) -> None:
        if hc.dtype != self.w_mm.dtype:
            hc = hc.to(self.w_mm.dtype)
        if self.h_scale != 1.0:
            hc = hc * self.h_scale
        _device_mm(hc, self.w_t, out)

    def _verifier(self, c0: int, c1: int) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor], Tensor | None]:
        """The chunk's verifier positions: their softmax (in the per-position buffer), their
        ``(argmax, log-sum-exp, sum p z)`` and each row's position among them (None: row r's is r)."""
        rows = self.rows
        assert rows.h_v is not None and self.zv_buf is not None and self.sc is not None
        local = None
        if self.positions is None:
            hv = rows.h_v[c0:c1]
        else:
            u0, u1 = self.positions.bounds[self.chunk_no]
            hv = rows.h_v.index_select(0, self.positions.rows[u0:u1])
            local = self.positions.local[c0:c1]
        pc = hv.shape[0]
        zv = self.zv_buf[:pc]
        self._project(hv, zv)
        stats = [torch.empty(pc, dtype=dt, device=zv.device) for dt in (torch.int64, self.cdt, self.cdt)]
        for b0 in range(0, pc, self.rb):
            b1 = min(b0 + self.rb, pc)
            sc_b = self.sc[: b1 - b0]
            if self.use_exp2:
                got = position_math_exp2(zv[b0:b1], sc_b)
            else:
                got = self.position_fn(zv[b0:b1], sc_b, self.cfg.temperature)
            for dst, x in zip(stats, got, strict=True):
                dst[b0:b1] = x
        return zv, (stats[0], stats[1], stats[2]), local

    def run(self, c0: int, c1: int, out: _RowStats, dh: Tensor | None, normalizer: Tensor) -> None:
        """Kept rows ``[c0, c1)``: per-row outputs into ``out``, their gradient rows into ``dh``."""
        rows, cfg, n = self.rows, self.cfg, c1 - c0
        zd = self.zd_buf[:n]
        self._project(rows.h_d[c0:c1], zd)
        verifier = self._verifier(c0, c1) if rows.h_v is not None else None
        self.chunk_no += 1
        rows_c, lab_c = self.arange_c[:n], rows.labels[c0:c1]
        zlab = zd[rows_c, lab_c]
        if self.z_scale != 1.0:
            zlab = zlab * self.z_scale
        s_used = self._blocks(zd, verifier, zlab, c0, out)
        if not (cfg.need_grad and s_used > 0):
            return
        fac = self.fac_c[:n]
        # one-hot parts of G / s (times s_d on the exp2 path), scattered once per chunk
        for index, coef in cfg.grad.onehots:
            if index == "label":
                at = lab_c
            else:
                assert out.av is not None
                at = out.av[c0:c1]
            zd.index_put_((rows_c, at), fac * (-coef / s_used), accumulate=True)
        assert self.dh_buf is not None and dh is not None
        dh_c = self.dh_buf[:n]
        if self.on_cuda and self.w.dtype != self.cdt:
            _device_mm(zd.to(self.w.dtype), self.w, dh_c)
        else:
            torch.mm(zd, self.w_mm, out=dh_c)
        dh_c.mul_((rows.weights[c0:c1] * (s_used / normalizer) / fac).unsqueeze(1))
        if rows.compact:
            dh.index_copy_(0, rows.keep[c0:c1], dh_c.to(dh.dtype))
        else:
            dh[c0:c1] = dh_c

    def _blocks(
        self,
        zd: Tensor,
        verifier: tuple[Tensor, tuple[Tensor, Tensor, Tensor], Tensor | None] | None,
        zlab: Tensor,
        c0: int,
        out: _RowStats,
    ) -> float:
        """The row blocks of one chunk; returns the gradient scale ``s`` of the last block."""
        cfg, n, s_used = self.cfg, zd.shape[0], 0.0
        fac = self.fac_c[:n]
        for b0 in range(0, n, self.rb):
            b1 = min(b0 + self.rb, n)
            m = b1 - b0
            pv, pos = None, None
            if verifier is not None:
                zv, (av, lse, pz), local = verifier
                if local is None:  # each row its own position: a view
                    pv, pos = zv[b0:b1], (av[b0:b1], lse[b0:b1], pz[b0:b1])
                else:
                    idx = local[b0:b1]
                    assert self.gathered is not None
                    pv = torch.index_select(zv, 0, idx, out=self.gathered[:m])
                    pos = (av.index_select(0, idx), lse.index_select(0, idx), pz.index_select(0, idx))
            sc_b = self.sc[:m] if self.sc is not None else None
            a_coef, b_coef = cfg.grad.q1, cfg.grad.kl_basis
            if self.use_exp2:
                ad, lse_d1, zav, kl_r, s, sd = block_math_exp2(
                    pv, zd[b0:b1], sc_b, pos, a_coef, b_coef, cfg.need_grad
                )
                fac[b0:b1] = sd
            else:
                _, ad, lse_d1, zav, kl_r, s = self.block_fn(
                    pv, zd[b0:b1], sc_b, pos, a_coef, b_coef, cfg.temperature, cfg.need_grad
                )
            g0, g1 = c0 + b0, c0 + b1
            out.ad[g0:g1] = ad
            if pos is not None:
                assert out.av is not None
                out.av[g0:g1] = pos[0]
            q = {"lse_d1": lse_d1, "zlab": zlab[b0:b1], "zav": zav, "kl": kl_r}
            for name, values in out.terms.items():
                values[g0:g1] = BY_NAME[name].value(q)
            s_used = s
        return s_used


def _per_row_loss(rows: _Rows, out: _RowStats, cfg: _Cfg, cdt: torch.dtype) -> Tensor:
    """``l_r = sum_t c_t term_t(r)`` of the kept rows."""
    per_row = torch.zeros(rows.n, dtype=cdt, device=rows.weights.device)
    for name, coef in cfg.coefs.items():
        if coef > 0:
            assert name in out.terms, f"the weighted term {name} was not computed"
            per_row.add_(out.terms[name], alpha=coef)
    return per_row


def _weighted_sum(weights: Tensor, x: Tensor, by: Tensor, cdt: torch.dtype) -> Tensor:
    if weights.numel() == 0:
        return torch.zeros((), dtype=cdt, device=weights.device)
    return (weights.double() @ x.double() / by.double()).to(cdt)


def _reweighted(
    rows: _Rows, per_row: Tensor, cfg: _Cfg, w_sum: Tensor, normalizer: Tensor, r_all: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(multiplier per kept row, the new weights, the new normalizer)`` of ``cfg.reweight``: the
    row weights become ``w_r * m_r``; the loss is divided by their sum (``reweight_normalizer=sum``)
    or by the base weights' sum (``count``), unless the caller fixed ``normalizer``."""
    values = per_row.detach()
    if rows.compact:
        values = torch.zeros(r_all, dtype=per_row.dtype, device=per_row.device).index_copy_(
            0, rows.keep, values
        )
    assert cfg.reweight is not None
    mult = cfg.reweight(values).to(per_row.dtype)
    if mult.shape != (r_all,):
        raise ValueError(f"reweight must return [R={r_all}] multipliers, got {tuple(mult.shape)}")
    if rows.compact:
        mult = mult.index_select(0, rows.keep)
    new_w = rows.weights * mult
    if cfg.normalizer is not None:
        new_norm = normalizer
    else:
        new_norm = new_w.sum() if cfg.reweight_normalizer == "sum" else w_sum
    return mult, new_w, new_norm.clamp_min(torch.finfo(per_row.dtype).tiny)


def _stats_in_row_order(rows: _Rows, out: _RowStats, labels: Tensor, r_all: int) -> VerifierLossStats:
    """The per-row statistics back in the original order of the R rows (dropped rows filled)."""
    device = labels.device

    def expand(x: Tensor | None, fill: float) -> Tensor | None:
        if x is None or not rows.compact:
            return x
        full = torch.full((r_all,), fill, dtype=x.dtype, device=device)
        return full.index_copy_(0, rows.keep, x)

    ad = expand(out.ad, -1)
    assert ad is not None
    terms = {name: x for name, v in out.terms.items() if (x := expand(v, 0.0)) is not None}
    stats = VerifierLossStats(drafter_argmax=ad, data_hit=(ad == labels) & (ad >= 0), terms=terms)
    if rows.h_v is not None:
        av = expand(out.av, -1)
        stats.verifier_argmax = av
        stats.verifier_hit = (ad == av) & (ad >= 0)
    return stats


# ----------------------------------------------------------------------------------------------
# the autograd Function


def _no_autocast(device: torch.device) -> AbstractContextManager[object]:
    """Autocast off for ``device`` (nothing to turn off where autocast does not exist: meta)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return nullcontext()


def _forward_impl(
    h_d: Tensor, h_v: Tensor | None, w: Tensor, labels: Tensor, weights: Tensor, cfg: _Cfg
) -> tuple[Tensor, Tensor | None]:
    """Loss and ``dh`` (``[R, H]``, None without grad); fills ``cfg.result``."""
    # autocast would recast the GEMMs to bf16 outputs: the precision here is explicit instead
    with _no_autocast(h_d.device):
        cdt = torch.float64 if torch.float64 in (h_d.dtype, w.dtype) else torch.float32
        rows = _kept_rows(h_d, h_v, labels, weights, cdt, cfg.checked_rows, cfg.verifier_index)
        out = _RowStats.empty(rows.n, h_v is not None, cfg, cdt, h_d.device)
        w_sum = rows.weights.sum()
        normalizer = (
            w_sum if cfg.normalizer is None else torch.tensor(cfg.normalizer, dtype=cdt, device=h_d.device)
        )
        dh = torch.zeros(h_d.shape, dtype=h_d.dtype, device=h_d.device) if cfg.need_grad else None
        chunk = max(1, min(cfg.chunk, rows.n)) if rows.n else 1
        if rows.n:
            loop = _ChunkLoop(w, rows, chunk, cdt, cfg)
            for c0 in range(0, rows.n, chunk):
                loop.run(c0, min(c0 + chunk, rows.n), out, dh, normalizer)
            loop.close()
        terms = {name: _weighted_sum(rows.weights, x, w_sum, cdt) for name, x in out.terms.items()}
        per_row = _per_row_loss(rows, out, cfg, cdt)
        weight_sum = w_sum
        if cfg.reweight is not None and rows.n:
            mult, new_w, new_norm = _reweighted(rows, per_row, cfg, w_sum, normalizer, h_d.shape[0])
            loss = _weighted_sum(new_w, per_row, new_norm, cdt)
            if dh is not None:  # dh_r was w_r g_r / normalizer: exact after the loop, row by row
                scale = (mult * (normalizer / new_norm)).to(dh.dtype).unsqueeze(1)
                if rows.compact:
                    dh.index_copy_(0, rows.keep, dh.index_select(0, rows.keep) * scale)
                else:
                    dh.mul_(scale)
            weight_sum = new_w.sum() if cfg.reweight_normalizer == "sum" else w_sum
        else:
            loss = _weighted_sum(rows.weights, per_row, normalizer, cdt)
        cfg.result.update(
            chunk_size=chunk,
            stats=_stats_in_row_order(rows, out, labels, h_d.shape[0]),
            terms=terms,
            weight_sum=weight_sum,
        )
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


def _shape(x: object) -> tuple:
    return tuple(getattr(x, "shape", ()))


def _check_tensors(
    h_d: Tensor, h_v: Tensor | None, w: Tensor, labels: Tensor, weights: Tensor, index: Tensor | None
) -> None:
    """Shapes, dtypes, devices and grad flags of the tensor arguments (ValueError naming the argument)."""
    if not isinstance(h_d, Tensor) or h_d.dim() != 2:
        raise ValueError(
            f"drafter_hidden must be a 2-D [R, H] tensor, got {getattr(h_d, 'shape', type(h_d))}"
        )
    if not h_d.is_floating_point():
        raise ValueError(f"drafter_hidden must be floating point, got {h_d.dtype}")
    r_all, hid = h_d.shape
    device = h_d.device
    if not isinstance(w, Tensor) or w.dim() != 2 or w.shape[1] != hid:
        raise ValueError(f"lm_head_weight must be [V, H={hid}], got {_shape(w)}")
    if not w.is_floating_point():
        raise ValueError(f"lm_head_weight must be floating point, got {w.dtype}")
    if w.device != device:
        raise ValueError(f"lm_head_weight is on device {w.device} but drafter_hidden on {device}")
    if w.requires_grad:
        raise ValueError(
            "lm_head_weight must not require grad (the head is frozen); pass lm_head_weight.detach()"
        )
    if h_v is not None:
        if index is None and (not isinstance(h_v, Tensor) or tuple(h_v.shape) != (r_all, hid)):
            raise ValueError(
                f"verifier_hidden must be [R={r_all}, H={hid}] like drafter_hidden, got {_shape(h_v)}"
            )
        if index is not None and (not isinstance(h_v, Tensor) or h_v.dim() != 2 or h_v.shape[1] != hid):
            raise ValueError(f"verifier_hidden must be [P, H={hid}] with verifier_index, got {_shape(h_v)}")
        if not h_v.is_floating_point():
            raise ValueError(f"verifier_hidden must be floating point, got {h_v.dtype}")
        if h_v.device != device:
            raise ValueError(f"verifier_hidden is on device {h_v.device} but drafter_hidden on {device}")
        if h_v.requires_grad:
            raise ValueError("verifier_hidden must not require grad; pass verifier_hidden.detach()")
    if not isinstance(labels, Tensor) or tuple(labels.shape) != (r_all,):
        raise ValueError(f"labels must be [R={r_all}], got {_shape(labels)}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.device != device:
        raise ValueError(f"labels is on device {labels.device} but drafter_hidden on {device}")
    if not isinstance(weights, Tensor) or tuple(weights.shape) != (r_all,):
        raise ValueError(f"weights must be [R={r_all}], got {_shape(weights)}")
    if not weights.is_floating_point():
        raise ValueError(f"weights must be floating point, got {weights.dtype}")
    if weights.device != device:
        raise ValueError(f"weights is on device {weights.device} but drafter_hidden on {device}")
    if weights.requires_grad:
        raise ValueError("weights must not require grad")
    if index is not None:
        if h_v is None:
            raise ValueError("verifier_index needs verifier_hidden (the rows it indexes)")
        if not isinstance(index, Tensor) or tuple(index.shape) != (r_all,):
            raise ValueError(f"verifier_index must be [R={r_all}], got {_shape(index)}")
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise ValueError(f"verifier_index must be an integer tensor, got {index.dtype}")


def _host_index(index: Tensor, positions: int) -> Tensor:
    """The host int64 copy of ``verifier_index`` (a host sync when it is on an accelerator), checked
    to lie in ``[0, P)``."""
    host = index.to("cpu", torch.int64)
    if host.numel() and (int(host.min()) < 0 or int(host.max()) >= positions):
        raise ValueError(f"verifier_index must lie in [0, P={positions}) (the rows of verifier_hidden)")
    return host


def _check_settings(
    temperature: float,
    chunk_size: int | None,
    mem_budget_gib: float,
    row_block: int | None,
    normalizer: float | None,
) -> float:
    """The scalar settings (ValueError naming the argument); returns the temperature as a float."""
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
    if normalizer is not None and not (float(normalizer) > 0 and math.isfinite(float(normalizer))):
        raise ValueError(f"normalizer must be None or a finite number > 0, got {normalizer!r}")
    return temperature


def _check_values(labels: Tensor, weights: Tensor, vocab: int) -> None:
    """Finite, non-negative weights and in-vocabulary labels on the weighted rows (one host sync)."""
    if labels.numel() == 0:
        return
    with torch.no_grad():
        pos = weights > 0
        bad = torch.stack(
            [
                ~torch.isfinite(weights).all(),
                (weights < 0).any(),
                (pos & ((labels < 0) | (labels >= vocab))).any(),
            ]
        ).tolist()
    if bad[0]:
        raise ValueError("weights must be finite (found inf or nan)")
    if bad[1]:
        raise ValueError("weights must be >= 0 (found a negative weight)")
    if bad[2]:
        raise ValueError(f"labels must lie in [0, V={vocab}) on rows with weight > 0")


def _checked_settings(
    h_d: Tensor,
    h_v: Tensor | None,
    w: Tensor,
    labels: Tensor,
    weights: Tensor,
    given: dict,
    tuning: dict,
    keep_workspace: bool,
    checked_rows: bool,
    index: Tensor | None,
) -> _Cfg:
    """Every argument of :func:`verifier_loss` checked (ValueError naming it), as the call's settings."""
    _check_tensors(h_d, h_v, w, labels, weights, index)
    unknown = sorted(set(given) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown loss term(s) {unknown}: the terms are {list(BY_NAME)}")
    coefs = {t.name: _check_coef(t.name, given.get(t.name, t.default)) for t in TERMS}
    normalizer, row_block, chunk = tuning["normalizer"], tuning["row_block"], tuning["chunk_size"]
    temperature = _check_settings(
        tuning["temperature"], chunk, tuning["mem_budget_gib"], row_block, normalizer
    )
    needing = [f"{n} ({c})" for n, c in coefs.items() if c > 0 and BY_NAME[n].needs_verifier]
    if h_v is None and needing:
        raise ValueError(f"verifier_hidden is required when {' or '.join(needing)} is > 0")
    if tuning["reweight_normalizer"] not in ("sum", "count"):
        raise ValueError(f"reweight_normalizer must be sum or count, got {tuning['reweight_normalizer']!r}")
    vocab = w.shape[0]
    if not checked_rows:
        _check_values(labels, weights, vocab)
    wide = torch.float64 in (h_d.dtype, w.dtype)
    return _Cfg(
        coefs=coefs,
        grad=gradient_plan(coefs),
        temperature=temperature,
        chunk=chunk or default_chunk_size(vocab, tuning["mem_budget_gib"], h_v is not None, 8 if wide else 4),
        row_block=row_block or (_CUDA_ROW_BLOCK if kernel_device(h_d.device) == "cuda" else _CPU_ROW_BLOCK),
        need_grad=torch.is_grad_enabled() and h_d.requires_grad,
        compile=bool(tuning["compile"]),
        normalizer=None if normalizer is None else float(normalizer),
        keep_workspace=bool(keep_workspace),
        checked_rows=bool(checked_rows),
        reweight=tuning["reweight"],
        reweight_normalizer=tuning["reweight_normalizer"],
        verifier_index=None if index is None or h_v is None else _host_index(index, h_v.shape[0]),
    )


def verifier_loss(
    drafter_hidden: Tensor,
    verifier_hidden: Tensor | None,
    lm_head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    mem_budget_gib: float = DEFAULT_MEM_BUDGET_GIB,
    compile: bool = False,
    normalizer: float | None = None,
    row_block: int | None = None,
    keep_workspace: bool = True,
    checked_rows: bool = False,
    coefs: Mapping[str, float] | None = None,
    reweight: Callable[[Tensor], Tensor] | None = None,
    reweight_normalizer: str = "sum",
    verifier_index: Tensor | None = None,
    **term_coefs: float,
) -> VerifierLossOutput:
    """Weighted loss terms (:mod:`dflash.loss.terms`: ce, kl, verifier_ce) of the drafter logits
    against the data and the verifier.

    Args:
        drafter_hidden: ``[R, H]`` float, the drafter's final hidden of the supervised slots; the
            only input that receives a gradient.
        verifier_hidden: ``[R, H]`` float, the target's final (post-norm) hidden at position
            ``slot - 1``, without grad; with ``verifier_index``, ``[P, H]`` (e.g. every position of
            a packet), row ``r`` reading ``verifier_hidden[verifier_index[r]]``. May be None when
            ``kl == verifier_ce == 0``; then the verifier GEMM is skipped and the verifier stats
            are None.
        lm_head_weight: ``[V, H]`` frozen lm_head (must not require grad).
        labels: ``[R]`` integer data tokens. Checked to lie in ``[0, V)`` on rows with weight > 0;
            rows with weight 0 may hold anything (e.g. ``-100``).
        weights: ``[R]`` float, finite and ``>= 0`` (slot decay x loss mask). Rows with weight 0
            are dropped before any GEMM and cost nothing.
        temperature: ``T > 0`` of the KL term (scaled by ``T^2``); CE terms are at ``T = 1``.
        chunk_size: rows per chunk; None picks :func:`default_chunk_size` from ``mem_budget_gib``.
        mem_budget_gib: budget of the ``[C, V]`` chunk buffers when ``chunk_size`` is None
            (default 2 GiB, the ``LossConfig`` default).
        compile: ``torch.compile`` the per-row-block math (the chunk loop stays eager).
        normalizer: the loss is ``sum_r w_r l_r / normalizer`` (and its gradient follows); None is
            ``sum_r w_r``, the weighted mean over these rows. A caller that sums several calls and
            divides once by a global weight sum passes 1.
        row_block: rows per elementwise block (tuning; default 128 on CPU, 256 on CUDA).
        keep_workspace: on CPU keep the chunk buffers for the next call (their first-touch page
            faults are paid once); :func:`release_workspace` frees them (CUDA: the allocator does).
        checked_rows: the caller vouches that every row has a finite weight > 0 and a label in
            ``[0, V)`` (``dflash_loss``, which builds the weights and asserts the labels on the
            device): the value checks and the search for weight-0 rows, both host syncs, are skipped.
        coefs, term_coefs: ``{term: coefficient}`` and ``<term>=<coefficient>`` (non-negative) of the
            terms of :data:`dflash.loss.terms.TERMS`; an unnamed term takes its default (``ce=1``,
            the others 0).
        reweight: weights that depend on the losses themselves (D-PACE, :mod:`dflash.loss.dpace`):
            called once, without grad, with the per-row loss ``l_r`` ``[R]`` (0 on weight-0 rows),
            it returns ``[R]`` multipliers ``m_r >= 0``; the loss becomes ``sum_r w_r m_r l_r / N``
            with ``m`` a constant for the gradient. ``dh`` rows are rescaled after the chunk loop
            (each row's gradient is linear in its weight), so it costs no second pass over the
            vocabulary.
        reweight_normalizer: with ``reweight`` and no ``normalizer``: ``N = sum_r w_r m_r``
            (``sum``) or ``sum_r w_r`` (``count``). The output's ``weight_sum`` is that ``N``.
        verifier_index: ``[R]`` integer indices into ``verifier_hidden`` (None: row ``r`` reads
            row ``r``). The verifier's work (its logits, argmax, softmax, log-sum-exp) is then done
            once per distinct index of a chunk and shared by the rows that read it; rows are
            computed in index order (non-decreasing indices cost no copy). Read on the host: a
            CPU tensor costs no host sync.

    Returns:
        :class:`VerifierLossOutput`: ``loss`` (scalar, fp32 or fp64; 0 with a zero gradient when
        all weights are 0), per-row ``stats``, weighted-mean ``terms`` (always divided by the
        weight sum, whatever ``normalizer``).

    Raises:
        ValueError: naming the argument, on mismatched shapes, dtypes or devices, negative or
            non-finite weights, labels outside ``[0, V)``, ``verifier_hidden`` or ``lm_head_weight``
            requiring grad, negative coefficients or an unknown term, ``temperature <= 0``,
            ``chunk_size < 1``, a non-positive ``normalizer``, or no ``verifier_hidden`` with a
            weighted term that needs it.
    """
    cfg = _checked_settings(
        drafter_hidden,
        verifier_hidden,
        lm_head_weight,
        labels,
        weights,
        {**(coefs or {}), **term_coefs},
        dict(
            temperature=temperature,
            chunk_size=chunk_size,
            mem_budget_gib=mem_budget_gib,
            compile=compile,
            normalizer=normalizer,
            row_block=row_block,
            reweight=reweight,
            reweight_normalizer=reweight_normalizer,
        ),
        keep_workspace,
        checked_rows,
        verifier_index,
    )
    labels, vh = labels.to(torch.int64), verifier_hidden.detach() if verifier_hidden is not None else None
    if cfg.need_grad:
        loss = _VerifierLossFn.apply(drafter_hidden, vh, lm_head_weight, labels, weights, cfg)
    else:
        with torch.no_grad():
            loss, _ = _forward_impl(drafter_hidden.detach(), vh, lm_head_weight, labels, weights, cfg)
    res = cfg.result
    return VerifierLossOutput(loss, res["stats"], res["terms"], res["weight_sum"], res["chunk_size"])
