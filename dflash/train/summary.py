"""What a run says about itself without W&B: a line per logged step and a table at the end.

The drafter leader writes every logged metrics row to ``metrics.jsonl`` in the run directory
(``dflash.train.steplog``), one line per ``logging.log_every`` steps to its rank log (``step_line``)
and, when the run ends, a short table to the console and the log (``summary_table``): where the
run stands, the loss and acceptance estimates of the recent steps (pooled over the last
``RECENT_STEPS`` logged steps, never the last step alone: the last step of an epoch can hold a
single sample), the last real eval, throughput, where the exported drafter is and how to look at
the W&B run offline. ``python -m dflash.report`` draws the curves from the same ``metrics.jsonl``.
Every command in the table is shell-quoted: pasted, it runs as printed whatever the run directory
holds (spaces, ``=``, non-ASCII).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from shlex import quote
from typing import Any

METRICS_FILE = "metrics.jsonl"
RECENT_STEPS = 20
"""Logged steps the summary's loss, tau_hat and accuracy are pooled over (``recent_figures``)."""


def step_line(m: dict[str, float], num_steps: int) -> str:
    """``step 10/145  loss 6.123  tau_hat 1.23  tok/s 456  wait 3%`` (plus eval tau when present)."""
    parts = [
        f"step {int(m['train/step'])}/{num_steps}",
        f"loss {m['train/loss']:.4f}",
        f"tau_hat {m['train/tau_hat']:.3f}",
        f"acc {m['train/acc']:.3f}",
        f"tok/s {m['perf/tokens_per_s']:.0f}",
        f"wait {100 * m['comm/recv_wait_frac']:.0f}%",
    ]
    if "eval/tau" in m:
        parts.append(f"eval/tau {m['eval/tau']:.3f}")
    return "  ".join(parts)


def eval_line(m: dict[str, float]) -> str:
    """``eval at step 50: eval/tau 1.86 (real speculative decoding, 8 held-out prompts, 512 new
    tokens), eval/tau_hat 1.65 (estimate)``, and when the time budget ended it early, so."""
    cut, n = int(m.get("eval/cut_short", 0)), int(m.get("eval/num_prompts", 0))
    return (
        f"eval at step {int(m['train/step'])}: eval/tau {m['eval/tau']:.3f} (real speculative decoding, "
        f"{n} held-out prompt{'s' * (n != 1)}, {int(m.get('eval/num_output_tokens', 0))} new "
        f"tokens{'; cut short at its time budget, eval.max_share' if cut else ''}), "
        f"eval/tau_hat {m.get('eval/tau_hat', math.nan):.3f} (the training estimate on the same conversations)"
    )


@dataclass
class RunSummary:
    """The figures the end-of-run table shows, collected as the rows are logged."""

    num_steps: int
    first: dict[str, float] = field(default_factory=dict)
    recent: list[dict[str, float]] = field(default_factory=list)
    """The last ``RECENT_STEPS`` logged train rows."""
    last_eval: dict[str, float] = field(default_factory=dict)
    tokens_per_s: list[float] = field(default_factory=list)
    rows: list[dict[str, float]] = field(default_factory=list)
    """The ``perf/`` and ``comm/`` values of every logged step (for the balance line)."""

    def add(self, m: dict[str, float]) -> None:
        if "train/loss" in m:
            self.first = self.first or dict(m)
            self.recent = [*self.recent[1 - RECENT_STEPS :], dict(m)]
            self.tokens_per_s.append(m.get("perf/tokens_per_s", 0.0))
            self.rows.append(
                {
                    k: v
                    for k, v in m.items()
                    if k.startswith(("perf/", "comm/", "train/anchors", "train/packets_cut"))
                }
            )
        if "eval/tau" in m:
            self.last_eval = dict(m)


def recent_figures(rows: list[dict[str, float]]) -> dict[str, float]:
    """``train/loss``, ``train/tau_hat`` and ``train/acc`` pooled over ``rows`` (logged train rows)
    as if they were one step: the loss weighted by each step's loss weight (supervised slots x
    ``train/slot_weight_mean``), the accuracy by its supervised slots, tau_hat the harmonic mean over
    all their blocks. A step that trained one sample weighs one sample, not a whole step. A row
    without those counts (written before they existed) weighs 1."""

    def pooled(key: str, weight: Callable[[dict[str, float]], float], harmonic: bool = False) -> float:
        pairs = [(weight(r), r[key]) for r in rows if math.isfinite(r.get(key, math.nan))]
        pairs = [(w, v) for w, v in pairs if w > 0 and (v > 0 or not harmonic)]
        total = sum(w for w, _ in pairs)
        if not pairs or total <= 0:
            return math.nan
        if harmonic:
            return total / sum(w / v for w, v in pairs)
        return sum(w * v for w, v in pairs) / total

    def slots(r: dict[str, float]) -> float:
        return r.get("train/supervised_slots", 1.0)

    return {
        "train/loss": pooled("train/loss", lambda r: slots(r) * r.get("train/slot_weight_mean", 1.0)),
        "train/tau_hat": pooled("train/tau_hat", lambda r: r.get("train/num_blocks", 1.0), harmonic=True),
        "train/acc": pooled("train/acc", slots),
    }


def recent_label(rows: list[dict[str, float]]) -> str:
    """``pooled over the last 20 logged steps, 94-113`` (or ``over step 3``, ``over all 3 logged steps, 1-3``)."""
    first, last = int(rows[0]["train/step"]), int(rows[-1]["train/step"])
    if len(rows) == 1:
        return f"step {last}"
    return f"pooled over the last {len(rows)} logged steps, {first}-{last}"


def summary_table(
    s: RunSummary,
    *,
    run_dir: Path,
    status: str,
    drafter_dir: Path | None,
    checkpoint: Path | None,
    wandb_mode: str,
    wandb_fallback: str | None = None,
    extra: dict[str, str] | None = None,
    not_exported: str = "the run did not finish",
    cap: int | None = None,
) -> str:
    """A short two-column table (``status`` first) for the console and the log (``cap``:
    ``drafter.max_anchors_per_packet``, for the anchors line; ``wandb_mode``: where W&B rows went
    in the end, ``wandb_fallback``: why that is not the configured mode)."""
    rows: list[tuple[str, str]] = [("run", str(run_dir)), ("status", status)]
    if s.recent:
        r = recent_figures(s.recent)
        which = recent_label(s.recent)
        rows.append(
            ("train/loss", f"{r['train/loss']:.4f} ({which}; first logged {s.first['train/loss']:.4f})")
        )
        rows.append(
            (
                "train/tau_hat",
                f"{r['train/tau_hat']:.3f} ({which}; first logged {s.first['train/tau_hat']:.3f})",
            )
        )
        rows.append(("train/acc", f"{r['train/acc']:.3f} ({which})"))
        tail = s.tokens_per_s[len(s.tokens_per_s) // 2 :] or [0.0]
        rows.append(("tokens/s", f"{sum(tail) / len(tail):.0f} (mean of the last half of the logged steps)"))
    if s.last_eval:
        e = s.last_eval
        rows.append(
            (
                "eval/tau",
                f"{e['eval/tau']:.3f} at step {int(e['train/step'])} (eval/tau_hat {e.get('eval/tau_hat', math.nan):.3f}"
                + (
                    f"; cut short by eval.max_share: {int(e.get('eval/num_output_tokens', 0))} new tokens)"
                    if e.get("eval/cut_short")
                    else ")"
                ),
            )
        )
    if (anchors := anchors_line(s.rows, cap)) is not None:
        rows.append(("anchors", anchors))
    rows += list((extra or {}).items())
    rows.append(
        (
            "drafter",
            f"{drafter_dir} (serve it: docs/eval-and-serving.md)"
            if drafter_dir
            else f"not exported ({not_exported})",
        )
    )
    if checkpoint is not None:
        rows.append(("checkpoint", str(checkpoint)))
    rows.append(
        ("metrics", f"{run_dir / METRICS_FILE}; curves: python -m dflash.report {quote(str(run_dir))}")
    )
    why = f" ({wandb_fallback})" if wandb_fallback else ""
    if wandb_mode == "offline":
        runs = quote(str(run_dir / "wandb"))  # the glob after it stays outside the quotes
        rows.append(
            ("W&B", f"offline{why}: wandb leet {runs} (terminal UI); upload: wandb sync {runs}/offline-run-*")
        )
    elif why:
        rows.append(("W&B", f"off{why}"))
    elif wandb_mode == "online":
        rows.append(("W&B", "online run (see the W&B page of the project)"))
    width = max(len(k) for k, _ in rows)
    bar = "-" * 78
    return "\n".join(["dflash run summary", bar, *(f"{k:<{width}}  {v}" for k, v in rows), bar])


def best_split(world: int, t_target: float, t_drafter: float, target_tp: int = 1) -> tuple[int, float]:
    """The number of targets N (1..) that maximises ``min(N / t_target, (world - N*k) / t_drafter)``
    packets/s with at least one drafter, and that rate (one packet costs ``t_target`` s on a target
    replica of ``target_tp`` = k ranks, ``t_drafter`` s on a drafter)."""
    k = target_tp
    rates = {n: min(n / t_target, (world - n * k) / t_drafter) for n in range(1, (world - 1) // k + 1)}
    n = max(rates, key=lambda x: rates[x])
    return n, rates[n]


def _split(n: int, m: int, k: int = 1) -> str:
    targets = f"{n} target{'s' * (n != 1)}" if k == 1 else f"{n} target replica{'s' * (n != 1)} x {k} ranks"
    return f"{targets} + {m} drafter{'s' * (m != 1)}"


def anchors_line(rows: list[dict[str, float]], cap: int | None) -> str | None:
    """The anchors trained per sample (mean over the logged steps) against the recipe's (what
    ``drafter.num_anchors`` offers per sample) and, when the per-packet cap took some away, that it did."""
    got = [
        r["train/anchors_per_sample"]
        for r in rows
        if math.isfinite(r.get("train/anchors_per_sample", math.nan))
    ]
    if not got:
        return None
    offered = [r["train/anchors_offered_per_sample"] for r in rows if "train/anchors_offered_per_sample" in r]
    trained = sum(got) / len(got)
    recipe = sum(offered) / len(offered) if offered else trained
    line = f"{trained:.0f} per sample trained of the recipe's {recipe:.0f}"
    if recipe > trained * 1.001:
        cut = sum(r.get("train/packets_cut", 0.0) for r in rows)
        line += f" (drafter.max_anchors_per_packet={cap} cut {cut:.0f} logged packets: python -m dflash.plan)"
    return line


def balance_line(
    rows: list[dict[str, float]], num_targets: int, num_drafters: int, self_produced: bool, target_tp: int = 1
) -> str | None:
    """Where the time went, from the measured per-packet times of the last half of the logged steps,
    and what the best split of the same number of GPUs would give (``best_split``; ``num_targets``
    replicas of ``target_tp`` ranks)."""
    tail = rows[len(rows) // 2 :]
    if not tail:
        return None

    def mean(key: str) -> float:
        values = [r[key] for r in tail if key in r]
        return sum(values) / len(values) if values else math.nan

    def share(key: str) -> float:
        """A per-step fraction over the whole tail (weighted by step time), at most 1: targets work
        up to ``max_in_flight`` packets ahead, so one step can hold more than its own forward time."""
        rows_with = [r for r in tail if key in r and "perf/step_s" in r]
        wall = sum(r["perf/step_s"] for r in rows_with)
        return min(1.0, sum(r[key] * r["perf/step_s"] for r in rows_with) / wall) if wall > 0 else math.nan

    t_t, t_d = mean("perf/target_s_per_packet"), mean("perf/drafter_s_per_packet")
    if not (t_t > 0 and t_d > 0):
        return None
    if self_produced:  # co-located: each rank runs the target forward, then the drafter
        world = num_drafters
        pct = 100 * t_t / (t_t + t_d)
        line = (
            f"per packet: target forward {t_t:.3g}s + drafter {t_d:.3g}s on each rank "
            f"({pct:.0f}% / {100 - pct:.0f}% of the step)"
        )
        if world > 1:
            n, rate = best_split(world, t_t, t_d)
            line += f"; disaggregated {_split(n, world - n)} would be ~{rate * (t_t + t_d) / world:.2f}x this"
        return line
    k = target_tp
    world = num_targets * k + num_drafters
    busy = share("perf/target_busy_frac")
    waited = share("comm/recv_wait_frac")
    now = min(num_targets / t_t, num_drafters / t_d)
    n, rate = best_split(world, t_t, t_d, k)
    line = (
        f"targets busy {100 * busy:.0f}% (idle {100 * (1 - busy):.0f}%), drafters waited {100 * waited:.0f}%"
    )
    if n == num_targets:
        return line + f": {_split(num_targets, num_drafters, k)} is the best split of {world} ranks"
    return line + (
        f": {_split(n, world - n * k, k)} would be ~{rate / now:.1f}x faster "
        f"(measured {t_t:.3g}s per target forward, {t_d:.3g}s per drafter packet)"
    )


def status_line(step: int, num_steps: int, stopped_by: str | None) -> str:
    """``finished: 145 of 145 steps``, ``stopped at step 51 of 505 (SIGTERM); relaunch ...``, or for a
    requested stop (``stopped_by`` = ``train.stop_after_steps=N``) the command that continues."""
    if step >= num_steps:
        return f"finished: {step} of {num_steps} steps"
    why = f" ({stopped_by})" if stopped_by else ""
    if stopped_by and stopped_by.startswith("train.stop_after_steps"):
        return (
            f"stopped at step {step} of {num_steps}{why}; to continue, launch the same command without "
            f"train.stop_after_steps (or with a larger value)"
        )
    return f"stopped at step {step} of {num_steps}{why}; relaunch the same command to resume"


def jsonable(m: dict[str, Any]) -> dict[str, Any]:
    """A metrics row with NaN/inf as None (JSON has no NaN)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
