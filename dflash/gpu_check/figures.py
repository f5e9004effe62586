"""The check's figures from what its subprocesses leave: pytest's summary line, bench_loss.py's JSON
lines and a training run's metrics.jsonl (pure functions, no torch)."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash.gpu_check.profiles import OOM_MARKERS

PHASES = ("target_forward", "recv_wait", "drafter_forward", "loss", "backward", "reduce", "optimizer")


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The training steps of ``run_dir/metrics.jsonl`` (rows with ``train/loss``); none when it is missing."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
        if "train/loss" in row:
            rows.append(row)
    return rows


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _r(x: float | None, n: int = 4) -> float | None:
    return None if x is None else round(x, n)


def round_sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (tiny dry-run figures stay visible)."""
    return float(f"{x:.{digits}g}")


def step_figures(rows: list[dict[str, Any]], warmup: int, packets_per_step: int) -> dict[str, Any]:
    """Steady-state medians over the steps after ``warmup``, the compile time (step 1 minus the
    median step), the phase split, the measured packet and the peak memory of every rank."""
    steady = rows[warmup:] if len(rows) > warmup else rows[-1:]
    med = {k: _median(steady, k) for k in ("perf/samples_per_s", "perf/tokens_per_s", "perf/step_s")}
    step_s = med["perf/step_s"] or 0.0
    first = float(rows[0]["perf/step_s"])
    phases = {p: _r(_median(steady, f"perf/phase/{p}_s")) for p in PHASES}
    phases = {p: s for p, s in phases.items() if s is not None}

    def per_packet(fn: Callable[[dict[str, Any]], float]) -> float:
        return statistics.mean(fn(r) for r in steady) / packets_per_step

    packet = {
        "tokens": per_packet(lambda r: r["perf/tokens_per_s"] * r["perf/step_s"]),
        "seqs": per_packet(lambda r: r["perf/samples_per_s"] * r["perf/step_s"]),
        "blocks": per_packet(lambda r: r.get("train/num_blocks", 0.0)),
        "supervised_slots": per_packet(lambda r: r.get("train/supervised_slots", 0.0)),
    }
    fwd_bwd = [phases.get("drafter_forward"), phases.get("backward")]
    split = {
        "target_forward_s": phases.get("target_forward"),
        "recv_wait_s": phases.get("recv_wait"),
        "drafter_forward_backward_s": _r(sum(x for x in fwd_bwd if x is not None)) if any(fwd_bwd) else None,
        "loss_s": phases.get("loss"),
        "optimizer_s": _r((phases.get("optimizer") or 0.0) + (phases.get("reduce") or 0.0)),
    }
    mem_keys = sorted({k for r in rows for k in r if k.startswith("mem/peak_gib/rank_")})
    return {
        "steps": len(rows),
        "steady_steps": f"{rows.index(steady[0]) + 1}-{len(rows)}",
        "samples_per_s": _r(med["perf/samples_per_s"], 3),
        "tokens_per_s": _r(med["perf/tokens_per_s"], 1),
        "step_s": _r(step_s),
        "first_step_s": _r(first),
        "compile_s": _r(max(0.0, first - step_s), 2),
        "phases_s": phases,
        "split_s": {k: v for k, v in split.items() if v is not None},
        "target_s_per_packet": _r(_median(steady, "perf/target_s_per_packet")),
        "drafter_s_per_packet": _r(_median(steady, "perf/drafter_s_per_packet")),
        "busy": {
            k.split("/", 1)[1]: _r(_median(steady, k), 3)
            for k in (
                "perf/target_frac",
                "perf/target_busy_frac",
                "perf/drafter_busy_frac",
                "comm/recv_wait_frac",
            )
            if _median(steady, k) is not None
        },
        "packet": {k: round(v, 1) for k, v in packet.items()},
        "peak_mem_gib": {k.rsplit("_", 1)[1]: round(max(r.get(k, 0.0) for r in rows), 3) for k in mem_keys},
        "final_loss": _r(float(rows[-1]["train/loss"])),
    }


def pytest_counts(text: str) -> dict[str, int]:
    """Counts of pytest's final summary line (``3 passed, 2 skipped in 1.2s``)."""
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors"), 0)
    lines = [
        ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", ln)
    ]
    for n, what in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", lines[-1] if lines else ""
    ):
        key = "errors" if what.startswith("error") else what
        counts[key] = counts.get(key, 0) + int(n)
    return counts


def loss_figures(recs: list[dict[str, Any]], peak: float | None) -> dict[str, Any]:
    """Part loss from bench_loss.py's JSON lines: every case with its fraction of the bf16 peak, the
    best chunk of the chunked CE+KL and CE, and the status. Only the product's own cases (chunked,
    chunked_ce) fail the part; a baseline that cannot run (the naive path out of memory, an
    ``F.linear_cross_entropy`` this torch lacks) is reported beside the figures."""
    cases = []
    for r in recs:
        c: dict[str, Any] = {k: r.get(k) for k in ("case", "terms", "chunk", "time_s", "peak_extra_gb")}
        if "error" in r:
            err = str(r["error"])  # "rc=1: <the last 3 lines of stderr, ' | '-joined>"
            c["oom"] = any(m in err for m in OOM_MARKERS)
            c["error"] = err.rsplit(" | ", 1)[-1][:300]  # the exception line (CUDA's OOM one is long)
        else:
            c["tflops"] = r.get("gemm_tflops")
            c["peak_frac"] = round_sig(r["gemm_tflops"] / peak) if peak else None
            for k in (
                "time_vs_naive",
                "mem_vs_naive",
                "time_vs_limit",
                "time_vs_torch_lce",
                "mem_vs_torch_lce",
                "loss",
                "grad_norm",
            ):
                if k in r:
                    c[k] = r[k]
        cases.append(c)
    res: dict[str, Any] = {"peak_tflops": peak, "cases": cases}
    for case in ("chunked", "chunked_ce"):
        runs = [c for c in cases if c["case"] == case and "error" not in c]
        if runs:
            res[f"best_{case}"] = min(runs, key=lambda c: c["time_s"])
    res["naive_oom"] = [c["case"] for c in cases if c["case"].startswith("naive") and c.get("oom")]
    failed = [c for c in cases if "error" in c]
    baseline = [
        c for c in failed if c["case"] not in ("chunked", "chunked_ce") and c["case"] not in res["naive_oom"]
    ]
    if baseline:
        res["baseline_errors"] = [f"{c['case']}@{c['chunk']}: {c['error']}" for c in baseline]
    own = [c for c in failed if c["case"] in ("chunked", "chunked_ce")]
    if own or "best_chunked" not in res or "best_chunked_ce" not in res:
        res["errors"] = [f"{c['case']}@{c['chunk']}: {c['error']}" for c in own]
        res["status"] = "failed"
    else:
        res["status"] = "passed"
    return res
