"""A target forward that runs out of memory is split in halves, down to one document, which is
dropped and counted when it alone does not fit; the run goes on, and a resumed run gets past the
same packets (the data plan is deterministic: a crash would repeat after every restart)."""

from __future__ import annotations

import json

import pytest
from faultkit import STEPS, losses
from runner import launch

pytestmark = pytest.mark.faults


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_out_of_memory_forward_is_split_and_the_run_equals_the_reference(tmp_path, run_cache, reference):
    """Every forward of more than 200 tokens (the packets hold up to 640) runs out of memory: split,
    the same hidden states, the same losses as the uninterrupted reference."""
    run = launch(tmp_path / "run", [*STEPS, "fault.target_oom_tokens=200"], run_cache)
    assert run.returncode == 0, run.output[-4000:]
    rows = _rows(run)
    splits = sum(r["perf/target_oom_splits"] for r in rows)
    assert splits >= len(rows) and all("data/skipped/target_oom" not in r for r in rows)
    ref, got = losses(reference.run_dir), losses(run.run_dir)
    assert sorted(got) == sorted(ref)
    assert all(abs(got[s] - ref[s]) <= 1e-4 * abs(ref[s]) for s in ref), (got, ref)
    log = run.rank_log(0) + run.rank_log(1)
    assert log.count("the target ran out of memory on") <= 2  # the shape, logged once per target


def test_a_document_too_large_alone_is_skipped_and_a_resume_gets_past_it(tmp_path, run_cache):
    """At 120 tokens some documents alone run out of memory: each is dropped, named once and counted
    (data/skipped/target_oom); the run stops at step 4 and a relaunch resumes through the same
    packets to the end."""
    common = [*STEPS, "fault.target_oom_tokens=120", "data.max_skip_fraction=1.0"]
    first = launch(tmp_path / "run", [*common, "train.stop_after_steps=4"], run_cache)
    assert first.returncode == 0, first.output[-4000:]
    again = launch(tmp_path / "run", common, run_cache)
    assert again.returncode == 0, again.output[-4000:]
    rows = _rows(again)
    dropped = rows[-1]["data/skipped/target_oom"]
    assert dropped > 0 and sorted(losses(again.run_dir)) == list(range(1, 13))
    targets = first.rank_log(0) + first.rank_log(1) + again.rank_log(0) + again.rank_log(1)
    assert "alone does not fit the target's memory: skipped" in targets
    ledger = again.ledger()
    assert [e["step"] for e in ledger] == list(range(1, 13))  # every step once, resumed at 5
