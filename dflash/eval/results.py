"""Evaluate a DFlash drafter on a prompt set: tau, acceptance histogram, TPOT, speedup, losslessness.

Protocol (z-lab/dflash ``benchmark.py``, transformers backend): greedy decoding, each prompt run
twice, with ``block_size = 1`` (plain autoregressive, the baseline) and with the drafter at block
size B, after one untimed warm-up generation of each kind.

- tau = mean over ALL decode steps of all prompts of ``accepted + 1`` (at most B); per prompt, the
  mean over its own steps;
- histogram of the acceptance lengths tau_step = 1..B (counts, every length present);
- TPOT = decode time / new tokens per prompt (see ``GenerationResult.tpot_s``); the reported TPOT is
  the mean over prompts; speedup = mean TPOT(AR) / mean TPOT(DFlash);
- lossless: the speculative output equals the baseline output for every prompt (mismatches are
  listed: in fp32 they mean a bug; in bf16 a near-tie flipped by the block forward's numerics).

This module holds :func:`evaluate`, the decode loop that turns a loaded target and drafter into an
:class:`EvalReport` (no file I/O), and the report itself: per-prompt :class:`PromptResult`,
:func:`build_report`, the printable :func:`report_table` and the W&B :func:`report_metrics`.
Loading is in :mod:`dflash.eval.loading`; the ``python -m dflash.eval`` app in :mod:`dflash.eval.app`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dflash.drafter.model import DFlashDraftModel
from dflash.eval.spec_decode import GenerationResult, StepTrace, speculative_generate

log = logging.getLogger(__name__)


@dataclass
class PromptResult:
    index: int
    prompt_len: int
    output_ids: list[int]
    accept_lengths: list[int]
    tpot_s: float
    num_target_forwards: int
    baseline_ids: list[int] | None = None
    tpot_ar_s: float | None = None

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else float("nan")

    @property
    def first_mismatch(self) -> int | None:
        """First index where the output differs from the baseline (None when equal or no baseline)."""
        if self.baseline_ids is None or self.output_ids == self.baseline_ids:
            return None
        n = min(len(self.output_ids), len(self.baseline_ids))
        return next((i for i in range(n) if self.output_ids[i] != self.baseline_ids[i]), n)

    @property
    def matches(self) -> bool | None:
        return None if self.baseline_ids is None else self.output_ids == self.baseline_ids


@dataclass
class EvalReport:
    block_size: int
    max_new_tokens: int
    results: list[PromptResult]
    tau: float
    """Mean accepted + 1 over every decode step of every prompt."""
    accept_len_hist: dict[int, int]
    """tau_step (1..block_size) -> number of decode steps."""
    tpot_s: float
    """Mean over prompts of the speculative TPOT."""
    tpot_ar_s: float | None
    """Mean over prompts of the block-size-1 TPOT (None without baseline)."""
    speedup: float | None
    """tpot_ar_s / tpot_s (None without baseline)."""
    lossless: bool | None
    """Every output equals its baseline (None without baseline)."""
    mismatches: list[str]

    @property
    def num_steps(self) -> int:
        return sum(len(r.accept_lengths) for r in self.results)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_steps"], d["num_output_tokens"] = self.num_steps, self.num_output_tokens
        for r, rd in zip(self.results, d["results"], strict=True):
            rd["tau"], rd["matches"], rd["first_mismatch"] = r.tau, r.matches, r.first_mismatch
        return d


def _mean(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _decode(tokenizer: Any, ids: list[int]) -> str:
    if tokenizer is None:
        return str(ids)
    try:
        return repr(tokenizer.decode(ids))
    except Exception:  # noqa: BLE001 - a report must not fail on a decode problem
        return str(ids)


def build_report(
    results: list[PromptResult], block_size: int, max_new_tokens: int, tokenizer: Any = None
) -> EvalReport:
    steps = [a for r in results for a in r.accept_lengths]
    hist = dict.fromkeys(range(1, block_size + 1), 0)
    for a in steps:
        if not 1 <= a <= block_size:
            raise ValueError(f"acceptance length {a} outside 1..{block_size}")
        hist[a] += 1
    has_baseline = bool(results) and all(r.baseline_ids is not None for r in results)
    tpot = _mean(r.tpot_s for r in results)
    tpot_ar = _mean(r.tpot_ar_s for r in results if r.tpot_ar_s is not None) if has_baseline else None
    speedup = tpot_ar / tpot if tpot_ar is not None and tpot > 0 else None
    mismatches = []
    for r in results:
        i = r.first_mismatch
        if i is not None:
            mismatches.append(
                f"prompt {r.index}: output differs from the block-size-1 baseline at new token {i} "
                f"(speculative {_decode(tokenizer, r.output_ids[i : i + 8])} vs baseline "
                f"{_decode(tokenizer, (r.baseline_ids or [])[i : i + 8])})"
            )
    return EvalReport(
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        results=results,
        tau=sum(steps) / len(steps) if steps else float("nan"),
        accept_len_hist=hist,
        tpot_s=tpot,
        tpot_ar_s=tpot_ar,
        speedup=speedup,
        lossless=(not mismatches) if has_baseline else None,
        mismatches=mismatches,
    )


def evaluate(
    target: torch.nn.Module,
    drafter: DFlashDraftModel | None,
    embed: torch.Tensor | None,
    head: torch.Tensor | None,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    layer_ids: list[int],
    block_size: int,
    eos_ids: set[int],
    baseline: bool = True,
    warmup: bool = True,
    progress: Callable[[int, PromptResult], None] | None = None,
    on_step: Callable[[StepTrace], None] | None = None,
    should_end: Callable[[], bool] | None = None,
    verbose: bool = True,
) -> EvalReport:
    """Speculative (and, with ``baseline``, block-size-1) greedy generation of every prompt.

    prompts: token ids (e.g. from :func:`~dflash.eval.loading.load_prompts`). tokenizer: only for readable mismatch
    reports (may be None). ``progress(i, result)`` is called after each prompt, ``on_step(trace)``
    after every decode step (an exception it raises ends the eval). ``should_end()`` turning true
    ends the prompt in progress after its current decode step (its steps so far count) and starts
    no other. ``verbose``: a log line per prompt at INFO (else DEBUG).
    """
    if not prompts:
        raise ValueError("no prompts to evaluate")
    if drafter is None:
        block_size = 1

    def gen(ids: list[int], bs: int, n: int) -> GenerationResult:
        return speculative_generate(
            target,
            drafter if bs > 1 else None,
            embed,
            head,
            ids,
            max_new_tokens=n,
            eos_token_ids=eos_ids,
            layer_ids=layer_ids,
            block_size=bs,
            on_step=on_step,
            should_end=should_end,
        )

    if warmup:
        n = min(max_new_tokens, 2 * block_size + 1)
        if baseline:
            gen(prompts[0], 1, n)
        gen(prompts[0], block_size, n)
    results = []
    for i, ids in enumerate(prompts):
        if should_end is not None and should_end():
            break
        ar = gen(ids, 1, max_new_tokens) if baseline else None
        spec = gen(ids, block_size, max_new_tokens)
        r = PromptResult(
            index=i,
            prompt_len=len(ids),
            output_ids=spec.output_ids,
            accept_lengths=spec.accept_lengths,
            tpot_s=spec.tpot_s,
            num_target_forwards=spec.num_target_forwards,
            baseline_ids=ar.output_ids if ar is not None else None,
            tpot_ar_s=ar.tpot_s if ar is not None else None,
        )
        log.log(
            logging.INFO if verbose else logging.DEBUG,
            "prompt %d/%d: %d tokens in, %d out, tau %.2f, tpot %.2f ms%s",
            i + 1,
            len(prompts),
            len(ids),
            len(r.output_ids),
            r.tau,
            1e3 * r.tpot_s,
            ""
            if ar is None
            else f", tpot AR {1e3 * ar.tpot_s:.2f} ms, {'lossless' if r.matches else 'MISMATCH'}",
        )
        results.append(r)
        if progress is not None:
            progress(i, r)
    return build_report(results, block_size, max_new_tokens, tokenizer)


def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def report_table(report: EvalReport) -> str:
    """A printable per-prompt table, the totals, the acceptance histogram and the lossless verdict."""
    has_ar = report.tpot_ar_s is not None
    head = f"{'prompt':>6} {'in':>6} {'out':>6} {'steps':>6} {'tau':>6} {'tpot_ms':>9}"
    if has_ar:
        head += f" {'tpot_ar_ms':>10} {'speedup':>8} {'lossless':>8}"
    lines = [
        f"DFlash eval: {len(report.results)} prompts, block size {report.block_size}, "
        f"max_new_tokens {report.max_new_tokens}",
        head,
        "-" * len(head),
    ]

    def row(label: str, n_in: str, n_out: int, steps: int, tau: float, tpot: float, tpot_ar, match) -> str:
        s = f"{label:>6} {n_in:>6} {n_out:>6} {steps:>6} {_fmt(tau, '.2f'):>6} {_fmt(tpot * 1e3, '.3f'):>9}"
        if has_ar:
            sp = tpot_ar / tpot if tpot_ar is not None and tpot and not math.isnan(tpot) else None
            s += f" {_fmt(None if tpot_ar is None else tpot_ar * 1e3, '.3f'):>10} {_fmt(sp, '.2f'):>7}x"
            s += f" {'yes' if match else 'NO':>8}"
        return s

    for r in report.results:
        lines.append(
            row(
                str(r.index),
                str(r.prompt_len),
                len(r.output_ids),
                len(r.accept_lengths),
                r.tau,
                r.tpot_s,
                r.tpot_ar_s,
                r.matches,
            )
        )
    lines.append("-" * len(head))
    lines.append(
        row(
            "all",
            "",
            report.num_output_tokens,
            report.num_steps,
            report.tau,
            report.tpot_s,
            report.tpot_ar_s,
            report.lossless,
        )
    )
    lines.append("")
    lines.append(f"tau = {_fmt(report.tau, '.3f')} (mean accepted+1 over {report.num_steps} decode steps)")
    if report.tpot_ar_s is not None:
        lines.append(
            f"speedup = TPOT(AR) {_fmt(report.tpot_ar_s * 1e3, '.3f')} ms / TPOT(DFlash) "
            f"{_fmt(report.tpot_s * 1e3, '.3f')} ms = {_fmt(report.speedup, '.2f')}x"
        )
    lines.append("acceptance length histogram (tau_step = accepted + 1):")
    total = max(report.num_steps, 1)
    peak = max(report.accept_len_hist.values(), default=0) or 1
    for k, c in report.accept_len_hist.items():
        lines.append(f"  {k:>3} {c:>7} {100.0 * c / total:5.1f}% {'#' * round(40 * c / peak)}")
    if report.lossless is None:
        lines.append("lossless: not checked (baseline=false)")
    elif report.lossless:
        lines.append(f"lossless: yes (all {len(report.results)} outputs equal the block-size-1 baseline)")
    else:
        lines.append(f"lossless: NO ({len(report.mismatches)} of {len(report.results)} prompts differ)")
        lines += [f"  {m}" for m in report.mismatches]
    return "\n".join(lines)


def report_metrics(report: EvalReport) -> dict[str, float]:
    """W&B metrics: eval/tau, eval/tpot_ms, eval/accept_len_hist/{k}, eval/num_steps,
    eval/num_output_tokens and, with a baseline, eval/speedup, eval/tpot_ar_ms, eval/lossless (1/0)."""
    m: dict[str, float] = {
        "eval/tau": float(report.tau),
        "eval/tpot_ms": float(report.tpot_s * 1e3),
        "eval/block_size": float(report.block_size),
        "eval/num_prompts": float(len(report.results)),
        "eval/num_steps": float(report.num_steps),
        "eval/num_output_tokens": float(report.num_output_tokens),
    }
    if report.tpot_ar_s is not None:
        m["eval/tpot_ar_ms"] = float(report.tpot_ar_s * 1e3)
        m["eval/speedup"] = float(report.speedup) if report.speedup is not None else float("nan")
        m["eval/lossless"] = float(bool(report.lossless))
    for k, c in report.accept_len_hist.items():
        m[f"eval/accept_len_hist/{k}"] = float(c)
    return m
