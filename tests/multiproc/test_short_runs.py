"""A short run makes sense (issue 32, item 10): one co-located rank, 21 steps of the FAST corpus, whose
last step trains a single sample (the data plan's last packet), with a periodic eval.

- no eval at step 0; each eval keeps within ``eval.max_share`` of the training time so far (the
  prompt being decoded ends at the deadline), says its budget when it starts and shows a progress bar;
- the end-of-run summary reports loss, tau_hat and accuracy pooled over the last 20 logged steps, with
  that label, not the 1-sample last step;
- a cap of blocks per packet below the recipe's anchors (issue 40, item 4) is warned about once, at
  the first step it cuts, naming the cap and the lever; the summary and the metrics say the anchors
  per sample trained against the recipe's; ``plan.gpu=auto`` asks nothing of the planner.
"""

from __future__ import annotations

import json
import re
from datetime import datetime

import pytest
from runner import launch

pytestmark = pytest.mark.multiproc

SHARE = 0.1
CAP = 16
SHORT = [
    "topology=colocated",
    "logging=disabled",
    "logging.progress_bar=true",
    "eval.every=10",
    "eval.num_prompts=4",
    "eval.max_new_tokens=400",  # 4 x 400 tokens: far beyond 5% of this run's training time
    f"eval.max_share={SHARE}",
    f"drafter.max_anchors_per_packet={CAP}",  # below drafter.num_anchors=8 x a packet's samples
    "plan.gpu=auto",
]
STAMP = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]"


def _time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, run_cache):
    run = launch(tmp_path_factory.mktemp("short") / "run", SHORT, run_cache, nproc=1, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    return run


def test_no_step0_eval_and_each_eval_within_its_share_of_the_training_time(short_run):
    rows = [json.loads(line) for line in (short_run.dir / "metrics.jsonl").read_text().splitlines()]
    log = short_run.rank_log(0)
    started = re.findall(r"eval at step (\d+) started", log)
    assert started == ["10", "20", "21"], log[-3000:]  # every 10 steps and after the last, never at step 0
    eval_s = 0.0
    for step in (10, 20, 21):
        start = re.search(
            rf"{STAMP}.*eval at step {step} started: 4 prompts x up to 400 new tokens on this drafter, "
            rf"at most ([0-9.]+) s \(eval.max_share={SHARE:g} of ([0-9.]+) s trained",
            log,
        )
        end = re.search(rf"{STAMP}.*eval at step {step}( skipped)?: ", log)
        assert start and end, log[-3000:]
        budget, trained = float(start[2]), float(start[3])
        # the budget: the share of the seconds trained so far (at least the steps' own), less earlier evals
        steps_s = sum(r["perf/step_s"] for r in rows if "perf/step_s" in r and r["train/step"] <= step)
        assert trained >= 0.9 * steps_s - 0.5, (trained, steps_s)
        assert budget == pytest.approx(max(0.0, SHARE * trained - eval_s), abs=0.6)
        took = _time(end[1]) - _time(start[1])
        # bounded: one decode step past the deadline, the tau_hat pass over 4 samples, the bookkeeping
        assert took <= budget + 1.5, (step, took, budget)
        eval_s += took
    evals = [r for r in rows if "eval/tau" in r]
    # the first eval had time to decode (a budget > 0); the budget cut the decoding short
    assert evals[0]["train/step"] == 10 and {r["train/step"] for r in evals} <= {10, 20, 21}
    assert all(r["eval/num_output_tokens"] < 4 * 400 for r in evals)
    assert any(r["eval/cut_short"] == 1 for r in evals) or "skipped: its time budget is spent" in log
    total_trained = sum(r["perf/step_s"] for r in rows if "perf/step_s" in r)
    assert eval_s <= SHARE * total_trained + 3 * 1.5
    # the eval's progress bar on the console (tqdm: "eval at step 10:  12%|...| 190/1600 [...tok/s]")
    assert re.search(r"eval at step 10: +\d+%\|.*\| *\d+/1600 ", short_run.stdout), short_run.stdout[-3000:]


def _pooled(rows: list[dict], key: str) -> float:
    """The figure of ``rows`` as one step: loss by loss weight, acc by supervised slots, tau_hat harmonic by blocks."""
    if key == "train/tau_hat":
        return sum(r["train/num_blocks"] for r in rows) / sum(r["train/num_blocks"] / r[key] for r in rows)
    weight = [
        r["train/supervised_slots"] * (r["train/slot_weight_mean"] if key == "train/loss" else 1.0)
        for r in rows
    ]
    return sum(w * r[key] for w, r in zip(weight, rows, strict=True)) / sum(weight)


def test_the_summary_pools_the_last_20_steps_not_the_one_sample_tail(short_run):
    assert len(short_run.ledger()[-1]["sample_ids"]) == 1  # the case: the last step trains one sample
    train = [
        r
        for r in map(json.loads, (short_run.dir / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in r
    ]
    assert [int(r["train/step"]) for r in train] == list(range(1, 22))
    recent, last = train[-20:], train[-1]
    table = short_run.stdout[short_run.stdout.index("dflash run summary") :]
    label = "pooled over the last 20 logged steps, 2-21"
    for key, digits in (("train/loss", 4), ("train/tau_hat", 3), ("train/acc", 3)):
        m = re.search(rf"^{key} +([0-9.]+) \({label}[;)]", table, re.M)
        assert m, table
        shown = float(m[1])
        assert shown == pytest.approx(_pooled(recent, key), abs=0.6 * 10**-digits), key
        assert round(last[key], digits) != shown, key  # not the last step's figure


def test_a_cap_below_the_recipe_is_warned_once_and_the_summary_says_the_anchors(short_run):
    rows = [
        r
        for r in map(json.loads, (short_run.dir / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in r
    ]
    cut = [r for r in rows if r["train/packets_cut"] > 0]
    assert cut and all(r["train/anchors_per_sample"] < r["train/anchors_offered_per_sample"] for r in cut)
    assert all(r["train/anchors_per_packet"] <= CAP for r in rows)
    assert all(r["perf/anchors_per_s"] > 0 and r["perf/slots_per_s"] > r["perf/anchors_per_s"] for r in rows)
    warned = re.findall(
        rf"drafter.max_anchors_per_packet={CAP} cut the anchors of (\d+) of this step's", short_run.output
    )
    assert len(warned) == 1 and int(warned[0]) == int(cut[0]["train/packets_cut"]), short_run.output[-3000:]
    assert "python -m dflash.plan names the largest that fits" in short_run.output
    table = short_run.stdout[short_run.stdout.index("dflash run summary") :]
    m = re.search(
        r"^anchors +(\d+) per sample trained of the recipe's (\d+) \(drafter.max_anchors_per_packet=16 cut (\d+) logged",
        table,
        re.M,
    )
    assert m and int(m[1]) < int(m[2]) <= 8, table
    assert int(m[3]) == sum(int(r["train/packets_cut"]) for r in rows) > 0, table
