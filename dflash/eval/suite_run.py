"""Decoding a benchmark suite (:mod:`dflash.eval.suites`) and its report: one table, ``report.json``
entries and W&B metrics per benchmark.

:func:`decode_conversations` runs the conversations of one benchmark turn by turn through
:func:`~dflash.eval.results.evaluate` (each turn one prompt: speculative and, with a baseline,
block-size-1 decoding), feeding each turn's speculative answer back into the next turn's prompt.
:func:`gather_to_rank0` collects the shares of a torchrun launch (rank r decodes conversations
r, r + W, ...). :func:`benchmark_report` turns one benchmark's turns into a
:class:`BenchmarkReport` (an :class:`~dflash.eval.results.EvalReport` over every turn plus the
reference's tau); :func:`suite_table` and :func:`suite_metrics` print and log them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from dflash.drafter.model import DFlashDraftModel
from dflash.eval.results import EvalReport, PromptResult, build_report, evaluate, report_metrics
from dflash.eval.spec_decode import StepTrace
from dflash.eval.suites import Conversation, render_turn

T = TypeVar("T")


@dataclass
class Decoder:
    """What decoding a turn needs: the models, the tokenizer and the generation settings."""

    target: torch.nn.Module
    drafter: DFlashDraftModel | None
    embed: torch.Tensor | None
    head: torch.Tensor | None
    tokenizer: Any
    layer_ids: list[int]
    block_size: int
    eos_ids: set[int]
    max_new_tokens: int
    baseline: bool
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_positions: int | None = None
    """The target's max_position_embeddings: a turn whose prompt + max_new_tokens + block does not fit
    is refused (ValueError) instead of decoded past it."""

    def decode(self, ids: list[int], max_new_tokens: int | None = None, **kw: Any) -> PromptResult:
        """One prompt through :func:`~dflash.eval.results.evaluate` (no warm-up)."""
        rep = evaluate(
            self.target,
            self.drafter,
            self.embed,
            self.head,
            self.tokenizer,
            [ids],
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            layer_ids=self.layer_ids,
            block_size=self.block_size,
            eos_ids=self.eos_ids,
            baseline=self.baseline,
            warmup=False,
            verbose=False,
            **kw,
        )
        return rep.results[0]


@dataclass
class TurnResult:
    """One decoded turn of one benchmark conversation."""

    benchmark: str
    sample: int
    row: int
    turn: int
    user: str
    """The user turn as rendered by the benchmark's format (before the chat template)."""
    answer: str
    """The speculative output decoded with ``skip_special_tokens`` (the next turn's assistant message)."""
    result: PromptResult


def decode_conversations(
    dec: Decoder,
    benchmark: str,
    conversations: list[Conversation],
    *,
    on_step: Callable[[StepTrace], None] | None = None,
    progress: Callable[[TurnResult], None] | None = None,
) -> list[TurnResult]:
    """Every turn of every conversation, in order. Turn j's prompt is the chat template of the user
    turns 1..j with the speculative answers to turns 1..j-1 between them (the reference's protocol).
    ``on_step`` is passed to the decoding (an exception it raises ends the eval); ``progress`` is
    called after each turn."""
    out = []
    for conv in conversations:
        messages: list[dict[str, str]] = []
        for j, user in enumerate(conv.turns):
            messages.append({"role": "user", "content": user})
            ids = render_turn(dec.tokenizer, messages, dec.template_kwargs)
            need = len(ids) + dec.max_new_tokens + dec.block_size
            if dec.max_positions and need > dec.max_positions:
                raise ValueError(
                    f"benchmark {benchmark} row {conv.row} turn {j + 1}: a {len(ids)}-token prompt + "
                    f"max_new_tokens={dec.max_new_tokens} + block size exceeds the target's "
                    f"max_position_embeddings={dec.max_positions}; lower max_new_tokens"
                )
            r = dec.decode(ids, on_step=on_step)
            answer = dec.tokenizer.decode(r.output_ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
            turn = TurnResult(benchmark, conv.sample, conv.row, j, user, answer, r)
            out.append(turn)
            if progress is not None:
                progress(turn)
    return out


def gather_to_rank0(items: list[T]) -> list[T] | None:
    """Every rank's ``items`` concatenated in rank order on rank 0 (None on the other ranks);
    ``items`` itself without a process group. The items travel pickled (``gather_object``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return items
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(items, parts, dst=0)
    return None if parts is None else [x for part in parts for x in (part or [])]


@dataclass
class BenchmarkReport:
    """One benchmark's results: the eval report over every turn, in (sample, turn) order."""

    name: str
    source: str
    turns: list[TurnResult]
    report: EvalReport

    @property
    def num_samples(self) -> int:
        return len({t.sample for t in self.turns})

    @property
    def tau(self) -> float:
        """The reference's tau: the mean over turns of each turn's mean acceptance length (turns
        without a decode step, whose first token ended the answer, are left out)."""
        taus = [t.result.tau for t in self.turns if t.result.accept_lengths]
        return sum(taus) / len(taus) if taus else float("nan")

    @property
    def first_prompt(self) -> str:
        """The first evaluated user turn as the benchmark's format renders it."""
        return self.turns[0].user if self.turns else ""

    def to_dict(self) -> dict[str, Any]:
        r = self.report
        return {
            "source": self.source,
            "num_samples": self.num_samples,
            "num_turns": len(self.turns),
            "tau": self.tau,
            "tau_pooled": r.tau,
            "accept_len_hist": r.accept_len_hist,
            "tpot_ms": r.tpot_s * 1e3,
            "tpot_ar_ms": None if r.tpot_ar_s is None else r.tpot_ar_s * 1e3,
            "speedup": r.speedup,
            "lossless": r.lossless,
            "mismatches": r.mismatches,
            "first_prompt": self.first_prompt,
            "turns": [{"sample": t.sample, "row": t.row, "turn": t.turn} for t in self.turns],
            "report": r.to_dict(),
        }


def benchmark_report(
    name: str,
    source: str,
    turns: list[TurnResult],
    block_size: int,
    max_new_tokens: int,
    tokenizer: Any = None,
) -> BenchmarkReport:
    """The report of one benchmark's turns (any order in; sorted by sample and turn, each result's
    ``index`` its position in that order)."""
    ordered = sorted(turns, key=lambda t: (t.sample, t.turn))
    ordered = [replace(t, result=replace(t.result, index=i)) for i, t in enumerate(ordered)]
    rep = build_report([t.result for t in ordered], block_size, max_new_tokens, tokenizer)
    return BenchmarkReport(name=name, source=source, turns=ordered, report=rep)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def suite_table(reports: list[BenchmarkReport], block_size: int, max_new_tokens: int) -> str:
    """One row per benchmark (samples, turns, steps, tau, pooled tau, TPOT, speedup, lossless), then
    each benchmark's acceptance-length histogram in percent of its decode steps."""
    head = (
        f"{'benchmark':<10} {'samples':>7} {'turns':>5} {'steps':>6} {'tau':>6} {'tau_pooled':>10} "
        f"{'tpot_ms':>8} {'tpot_ar_ms':>10} {'speedup':>8} {'lossless':>8}"
    )
    lines = [f"DFlash suite: block size {block_size}, max_new_tokens {max_new_tokens}", head, "-" * len(head)]
    for b in reports:
        r = b.report
        lossless = "-" if r.lossless is None else ("yes" if r.lossless else "NO")
        speedup = "-" if r.speedup is None else f"{r.speedup:.2f}x"
        tpot_ar = None if r.tpot_ar_s is None else r.tpot_ar_s * 1e3
        lines.append(
            f"{b.name:<10} {b.num_samples:>7} {len(b.turns):>5} {r.num_steps:>6} {_fmt(b.tau, '.3f'):>6} "
            f"{_fmt(r.tau, '.3f'):>10} {_fmt(r.tpot_s * 1e3, '.3f'):>8} {_fmt(tpot_ar, '.3f'):>10} "
            f"{speedup:>8} {lossless:>8}"
        )
    lines += ["", "tau = mean over turns of each turn's mean acceptance length (the z-lab benchmark's);"]
    lines += ["tau_pooled = mean acceptance length over every verify step of the benchmark", ""]
    lines.append("acceptance length histogram (% of decode steps; tau_step = accepted + 1):")
    lines.append(f"{'':<10} " + " ".join(f"{k:>5}" for k in range(1, block_size + 1)))
    for b in reports:
        total = max(b.report.num_steps, 1)
        cells = [100.0 * b.report.accept_len_hist.get(k, 0) / total for k in range(1, block_size + 1)]
        lines.append(f"{b.name:<10} " + " ".join(f"{c:5.1f}" for c in cells))
    for b in reports:
        lines += [f"{b.name}: {m}" for m in b.report.mismatches]
    return "\n".join(lines)


def suite_metrics(reports: list[BenchmarkReport]) -> dict[str, float]:
    """``eval/<benchmark>/...``: tau (the reference's), tau_pooled, num_samples and every
    :func:`~dflash.eval.results.report_metrics` key of the benchmark's report (histogram, TPOT,
    speedup, lossless, ...)."""
    m: dict[str, float] = {}
    for b in reports:
        prefix = f"eval/{b.name}/"
        for key, value in report_metrics(b.report).items():
            m[prefix + key.removeprefix("eval/")] = value
        m[prefix + "tau_pooled"] = float(b.report.tau)
        m[prefix + "tau"] = float(b.tau)
        m[prefix + "num_samples"] = float(b.num_samples)
    return m


SUITE_SUMS = (
    "enabled",  # 1 from every share of a benchmark in the suite (so an empty share still counts)
    "samples",
    "turns",
    "decoded_turns",  # turns with at least one decode step
    "turn_tau_sum",  # sum over those turns of their mean acceptance length
    "accept_sum",  # sum over decode steps of accepted + 1
    "steps",
    "output_tokens",
    "tpot_sum",  # sum over decoded turns of the speculative TPOT (s)
)
"""Partial sums of one share of one benchmark, in this order, then its acceptance histogram (1..B).
Shares add up: the sums of every drafter's share are the sums of the whole benchmark."""


def suite_sums(reports: dict[str, BenchmarkReport], block_size: int) -> torch.Tensor:
    """float64 ``[len(BENCHMARKS) * (len(SUITE_SUMS) + block_size)]``: one segment per known benchmark
    (``dflash.eval.suites.BENCHMARKS`` order) holding ``SUITE_SUMS`` and the histogram of this
    share's report of it; zeros for a benchmark not in ``reports``."""
    from dflash.eval.suites import BENCHMARKS

    width = len(SUITE_SUMS) + block_size
    out = torch.zeros(len(BENCHMARKS) * width, dtype=torch.float64)
    for i, name in enumerate(BENCHMARKS):
        b = reports.get(name)
        if b is None:
            continue
        decoded = [t.result for t in b.turns if t.result.accept_lengths]
        values = {
            "enabled": 1.0,
            "samples": float(b.num_samples),
            "turns": float(len(b.turns)),
            "decoded_turns": float(len(decoded)),
            "turn_tau_sum": float(sum(r.tau for r in decoded)),
            "accept_sum": float(sum(a for r in decoded for a in r.accept_lengths)),
            "steps": float(b.report.num_steps),
            "output_tokens": float(b.report.num_output_tokens),
            "tpot_sum": float(sum(r.tpot_s for r in decoded)),
        }
        seg = [values[k] for k in SUITE_SUMS] + [
            float(b.report.accept_len_hist[k]) for k in range(1, block_size + 1)
        ]
        out[i * width : (i + 1) * width] = torch.tensor(seg, dtype=torch.float64)
    return out


def suite_sums_metrics(sums: torch.Tensor, block_size: int) -> dict[str, float]:
    """``eval/<benchmark>/...`` from summed :func:`suite_sums`: tau (the reference's: the mean over
    turns of each turn's mean acceptance length), tau_pooled, tpot_ms, num_samples, num_prompts
    (turns), num_steps, num_output_tokens and accept_len_hist/{k}, for every benchmark in the suite
    with a decode step."""
    from dflash.eval.suites import BENCHMARKS

    width = len(SUITE_SUMS) + block_size
    m: dict[str, float] = {}
    for i, name in enumerate(BENCHMARKS):
        seg = sums[i * width : (i + 1) * width].tolist()
        v = dict(zip(SUITE_SUMS, seg[: len(SUITE_SUMS)], strict=True))
        if v["enabled"] == 0 or v["steps"] == 0:
            continue
        p = f"eval/{name}/"
        m[p + "tau"] = v["turn_tau_sum"] / v["decoded_turns"]
        m[p + "tau_pooled"] = v["accept_sum"] / v["steps"]
        m[p + "tpot_ms"] = 1e3 * v["tpot_sum"] / v["decoded_turns"]
        m[p + "num_samples"], m[p + "num_prompts"] = v["samples"], v["turns"]
        m[p + "num_steps"], m[p + "num_output_tokens"] = v["steps"], v["output_tokens"]
        for k, c in enumerate(seg[len(SUITE_SUMS) :], start=1):
            m[p + f"accept_len_hist/{k}"] = c
    return m
