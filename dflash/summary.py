"""What a run says about itself without W&B: a line per logged step and a table at the end.

The drafter leader writes every logged metrics row to ``metrics.jsonl`` in the run directory
(``dflash.steplog``), one line per ``logging.log_every`` steps to its rank log (``step_line``)
and, when the run ends, a short table to the console and the log (``summary_table``): where the
run stands, the final loss and acceptance estimates, the last real eval, throughput, where the
exported drafter is and how to look at the W&B run offline. ``python -m dflash.report`` draws the
curves from the same ``metrics.jsonl``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


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
    """``eval at step 50: eval/tau 1.86 (real speculative decoding), eval/tau_hat 1.65 (estimate)``."""
    return (
        f"eval at step {int(m['train/step'])}: eval/tau {m['eval/tau']:.3f} (real speculative decoding, "
        f"{int(m.get('eval/num_prompts', 0))} held-out prompts), eval/tau_hat {m.get('eval/tau_hat', math.nan):.3f} "
        f"(the training estimate on the same conversations)"
    )


@dataclass
class RunSummary:
    """The figures the end-of-run table shows, collected as the rows are logged."""

    num_steps: int
    first: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    last_eval: dict[str, float] = field(default_factory=dict)
    tokens_per_s: list[float] = field(default_factory=list)

    def add(self, m: dict[str, float]) -> None:
        if "train/loss" in m:
            self.first = self.first or dict(m)
            self.last = dict(m)
            self.tokens_per_s.append(m.get("perf/tokens_per_s", 0.0))
        if "eval/tau" in m:
            self.last_eval = dict(m)


def summary_table(
    s: RunSummary,
    *,
    run_dir: Path,
    status: str,
    drafter_dir: Path | None,
    checkpoint: Path | None,
    wandb_mode: str,
    extra: dict[str, str] | None = None,
) -> str:
    """A short two-column table (``status`` first) for the console and the log."""
    rows: list[tuple[str, str]] = [("run", str(run_dir)), ("status", status)]
    if s.last:
        rows.append(("train/loss", f"{s.last['train/loss']:.4f} (first logged {s.first['train/loss']:.4f})"))
        rows.append(
            ("train/tau_hat", f"{s.last['train/tau_hat']:.3f} (first logged {s.first['train/tau_hat']:.3f})")
        )
        rows.append(("train/acc", f"{s.last['train/acc']:.3f}"))
        tail = s.tokens_per_s[len(s.tokens_per_s) // 2 :] or [0.0]
        rows.append(("tokens/s", f"{sum(tail) / len(tail):.0f} (mean of the last half of the logged steps)"))
    if s.last_eval:
        e = s.last_eval
        rows.append(
            (
                "eval/tau",
                f"{e['eval/tau']:.3f} at step {int(e['train/step'])} (eval/tau_hat {e.get('eval/tau_hat', math.nan):.3f})",
            )
        )
    rows += list((extra or {}).items())
    rows.append(
        (
            "drafter",
            f"{drafter_dir} (serve it: see README)"
            if drafter_dir
            else "not exported (the run did not finish)",
        )
    )
    if checkpoint is not None:
        rows.append(("checkpoint", str(checkpoint)))
    rows.append(("metrics", f"{run_dir / METRICS_FILE}; curves: python -m dflash.report {run_dir}"))
    if wandb_mode == "offline":
        rows.append(
            (
                "W&B",
                f"offline run in {run_dir / 'wandb'}: wandb leet {run_dir / 'wandb'} (terminal), or wandb sync --sync-all there to upload",
            )
        )
    elif wandb_mode == "online":
        rows.append(("W&B", "online run (see the W&B page of the project)"))
    width = max(len(k) for k, _ in rows)
    bar = "-" * 78
    return "\n".join(["dflash run summary", bar, *(f"{k:<{width}}  {v}" for k, v in rows), bar])


def status_line(step: int, num_steps: int, stopped_by: str | None) -> str:
    """``finished: 145 of 145 steps`` or ``stopped at step 51 of 505 (SIGTERM); relaunch ...``."""
    if step >= num_steps:
        return f"finished: {step} of {num_steps} steps"
    why = f" ({stopped_by})" if stopped_by else ""
    return f"stopped at step {step} of {num_steps}{why}; relaunch the same command to resume"


def jsonable(m: dict[str, Any]) -> dict[str, Any]:
    """A metrics row with NaN/inf as None (JSON has no NaN)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
