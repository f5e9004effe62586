"""``python -m dflash.report <run dir>``: the curves of a run from its own files, no W&B account.

Reads ``<run dir>/metrics.jsonl`` (every row the drafter leader logged) and writes one
self-contained HTML page (inline SVG, no scripts, no network) with the loss, the acceptance
estimates against the real speculative-decoding eval, and throughput, each against ``train/step``.

    python -m dflash.report outputs/tiny_cpu/<run id>            # -> <run dir>/report.html
    python -m dflash.report run_dir=<dir> out=/tmp/curves.html
    python -m dflash.report -- 'outputs/my run=1'                 # after --: a path, whatever it holds

The run directory may come first by position: an existing path is always taken as one (even with
``=`` in it, as in ``hydra.run.dir='outputs/lr=3e-4'``), as is anything after ``--``, or a first
argument without ``=``; ``key=value`` arguments are overrides.
"""

from __future__ import annotations

import html
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING, DictConfig, OmegaConf

from dflash.config import EXIT_USER_ERROR, UserError
from dflash.files import atomic_write
from dflash.loss.terms import metric_keys
from dflash.train.steplog import StepLog
from dflash.train.summary import METRICS_FILE

log = logging.getLogger(__name__)

SCHEMA_NAME = "dflash_report_schema"
CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("train/loss", *metric_keys())),
    ("acceptance length", ("train/tau_hat", "eval/tau", "eval/tau_hat")),
    ("accuracy", ("train/acc", "train/acc_verifier")),
    ("throughput (tokens/s)", ("perf/tokens_per_s",)),
    ("drafter wait fraction", ("comm/recv_wait_frac",)),
)
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


@dataclass
class ReportAppConfig:
    """Schema of ``conf/report.yaml``."""

    run_dir: str = MISSING
    """A run directory (holds metrics.jsonl)."""
    out: str | None = None
    """The HTML file to write; None = <run_dir>/report.html."""


def register_report_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=ReportAppConfig)


def read_series(path: Path) -> tuple[dict[str, list[tuple[float, float]]], list[str]]:
    """``(metric -> [(train/step, value)] of every finite value, what was left out)`` of a
    metrics.jsonl file: a damaged line (``StepLog`` skips it, never stops there) and a row whose
    ``train/step`` is not finite are left out and named; a torn last line is ignored."""
    series: dict[str, list[tuple[float, float]]] = {}
    steplog = StepLog(path, step_key="train/step")
    nonfinite: list[str] = []
    for row in steplog.records():
        step = float(row["train/step"])
        if not math.isfinite(step):
            nonfinite.append(f"a row with train/step={row['train/step']!r}")
            continue
        for key, value in row.items():
            if key != "train/step" and isinstance(value, int | float) and math.isfinite(value):
                series.setdefault(key, []).append((step, float(value)))
    return series, [f"damaged line {n}" for n in steplog.damaged_lines] + nonfinite


def svg_chart(
    title: str, lines: dict[str, list[tuple[float, float]]], width: int = 640, height: int = 260
) -> str:
    """One line chart (inline SVG) of several series against the step, with axes and a legend."""
    pts = [p for values in lines.values() for p in values]
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    left, right, top, bottom = 60, 150, 24, 30
    w, h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * w

    def sy(y: float) -> float:
        return top + h - (y - y0) / (y1 - y0) * h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">'
    ]
    out.append(f'<text x="{left}" y="14" font-size="13" font-weight="bold">{html.escape(title)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#999"/>')
    for frac in (0.0, 0.5, 1.0):
        y = y0 + frac * (y1 - y0)
        out.append(f'<text x="{left - 4}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.4g}</text>')
        x = x0 + frac * (x1 - x0)
        out.append(f'<text x="{sx(x):.1f}" y="{top + h + 14}" text-anchor="middle">{x:.0f}</text>')
    out.append(f'<text x="{left + w / 2:.0f}" y="{height - 2}" text-anchor="middle">train/step</text>')
    for i, (name, values) in enumerate(lines.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        path = " ".join(f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(values))
        marker = "".join(
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in values
        )
        out.append(f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        if len(values) <= 40:
            out.append(marker)
        out.append(
            f'<text x="{left + w + 8}" y="{top + 14 * (i + 1)}" fill="{colour}">{html.escape(name)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def render(run_dir: Path, series: dict[str, list[tuple[float, float]]]) -> str:
    """The HTML page: one chart per ``CHARTS`` entry that has data, then a table of last values."""
    charts = []
    for title, keys in CHARTS:
        lines = {k: series[k] for k in keys if series.get(k)}
        if lines:
            charts.append(svg_chart(title, lines))
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v[-1][1]:.4g}</td><td>{int(v[-1][0])}</td></tr>"
        for k, v in sorted(series.items())
        if k.startswith(("train/loss", "train/tau", "train/acc", "eval/tau", "perf/tokens"))
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>dflash run {html.escape(run_dir.name)}</title></head>"
        f"<body><h2>dflash run {html.escape(str(run_dir))}</h2>{''.join(f'<div>{c}</div>' for c in charts)}"
        f"<h3>last values</h3><table border='1' cellpadding='3'><tr><th>metric</th><th>value</th><th>step</th></tr>"
        f"{rows}</table></body></html>"
    )


def report_task(dcfg: DictConfig, _hydra_dir: Path) -> int:
    """What ``python -m dflash.report`` does: read metrics.jsonl, write the HTML, print a summary."""
    obj = OmegaConf.to_object(dcfg)
    assert isinstance(obj, ReportAppConfig)
    run_dir = Path(obj.run_dir).expanduser().resolve()
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise UserError(
            f"run_dir={obj.run_dir}: no {METRICS_FILE} there; give the directory of a dflash.train run"
        )
    series, left_out = read_series(metrics)
    if left_out:
        more = f" (and {len(left_out) - 3} more)" if len(left_out) > 3 else ""
        print(f"{metrics}: left out {len(left_out)}: {'; '.join(left_out[:3])}{more}")
    if "train/loss" not in series:
        raise UserError(f"{metrics} holds no readable logged training step")
    out = Path(obj.out).expanduser() if obj.out else run_dir / "report.html"
    atomic_write(out, render(run_dir, series))
    last = {k: v[-1][1] for k, v in series.items()}
    steps = int(series["train/loss"][-1][0])
    print(f"{metrics}: {len(series['train/loss'])} logged steps, last step {steps}")
    for key in ("train/loss", "train/tau_hat", "eval/tau", "eval/tau_hat", "perf/tokens_per_s"):
        if key in last:
            print(f"  {key:<18} {last[key]:.4g}")
    print(f"curves: {out}")
    return 0


def positional_run_dir(args: list[str]) -> list[str]:
    """The command line with the run directory given by position written as the ``run_dir=``
    override (Hydra-quoted): the argument after ``--``, else a first argument that is an existing
    path or holds no ``=``; every other argument is left as it is."""
    from dflash.cli import hydra_quote

    if "--" in args:
        k = args.index("--")
        before, after = args[:k], args[k + 1 :]
        if len(after) != 1:
            print(f"dflash: error: give one run directory after --, not {len(after)}", file=sys.stderr)
            raise SystemExit(EXIT_USER_ERROR)
        return [*before, f"run_dir={hydra_quote(after[0])}"]
    if args and not args[0].startswith("-") and (os.path.exists(args[0]) or "=" not in args[0]):
        return [f"run_dir={hydra_quote(args[0])}", *args[1:]]
    return args


def main() -> None:
    from dflash.cli import run_app

    sys.argv[1:] = positional_run_dir(sys.argv[1:])
    register_report_schema()
    run_app("report", ReportAppConfig, report_task)


if __name__ == "__main__":
    main()
