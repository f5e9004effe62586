#!/usr/bin/env python
"""Pipeline throughput of one experiment under several rank splits, measured side by side.

    python scripts/bench_pipeline.py --splits 2:1,1:2 --steps 20                     # the tiny CPU default
    python scripts/bench_pipeline.py --splits 7:1,3:5,colocated:8 --steps 50 -- experiment=qwen3_8b_8gpu data.path=/data/chat.jsonl

Each split (``N:M`` = N targets + M drafters, or ``colocated:W`` = W co-located ranks) is a real
``torchrun --standalone`` launch of ``dflash.train`` for ``--steps`` optimizer steps (W&B off, a
temporary run directory). From the run's ``metrics.jsonl`` it takes the mean over the second half of
the steps (the first ones include loading and compiling) and prints one JSON line per split:
samples/s, tokens/s, step time, busy fractions per role, the measured seconds per packet of each
role, the peak memory of every rank and the tokens trained in all (``tokens_trained``: which packets
the split trained); then one line with every split's samples/s relative to the first split.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dflash.distributed.launch import torchrun_command  # noqa: E402

KEYS = (
    "perf/samples_per_s",
    "perf/tokens_per_s",
    "perf/step_s",
    "perf/target_busy_frac",
    "perf/target_frac",
    "perf/drafter_busy_frac",
    "comm/recv_wait_frac",
    "perf/target_s_per_packet",
    "perf/drafter_s_per_packet",
)


def split_overrides(split: str) -> tuple[int, list[str]]:
    """``N:M`` or ``colocated:W`` -> (processes, topology overrides)."""
    kind, _, count = split.partition(":")
    if kind == "colocated":
        return int(count), ["topology=colocated"]
    n, m = int(kind), int(count)
    return n + m, [f"topology.num_targets={n}", f"topology.num_drafters={m}"]


def run_split(split: str, steps: int, overrides: list[str], timeout: float) -> dict:
    """One launch; the second-half means of KEYS and the peak memory per rank."""
    nproc, topo = split_overrides(split)
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = torchrun_command(
            nproc,
            [
                f"hydra.run.dir={run_dir}",
                f"train.max_steps={steps}",
                "logging.mode=disabled",
                "logging.progress_bar=false",
                "eval.every=0",
                f"train.save_every={10 * steps}",
                *topo,
                *overrides,
            ],
        )
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=os.environ)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(
                f"split {split} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    tail = rows[len(rows) // 2 :]
    out: dict = {"split": split, "steps": len(rows), "wall_s": round(wall, 1)}
    out["tokens_trained"] = int(rows[-1]["train/tokens_seen"]) if rows else 0
    for key in KEYS:
        values = [r[key] for r in tail if r.get(key) is not None]
        if values:
            out[key.split("/", 1)[1]] = round(sum(values) / len(values), 4)
    out["peak_mem_gib"] = {
        k.rsplit("_", 1)[1]: round(max(r.get(k, 0.0) for r in rows), 3)
        for k in sorted({k for r in rows for k in r if k.startswith("mem/peak_gib/rank_")})
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", default="2:1,1:2", help="comma-separated N:M or colocated:W")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the experiment (after --)")
    args = parser.parse_args()
    results = []
    for split in args.splits.split(","):
        result = run_split(split.strip(), args.steps, args.overrides, args.timeout)
        print(json.dumps(result), flush=True)
        results.append(result)
    base = results[0].get("samples_per_s") or 0.0
    print(
        json.dumps(
            {
                "relative_samples_per_s": {
                    r["split"]: round(r.get("samples_per_s", 0.0) / base, 3) if base else None
                    for r in results
                },
                "baseline": results[0]["split"],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
