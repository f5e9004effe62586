"""R5: a corpus with bad samples of every kind: no crash, every one skipped and counted by reason (W&B
``data/skipped/<reason>`` and the checkpoint), counts kept across a resume, none ever trained on, and
too many of them abort the run naming data.max_skip_fraction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from faultkit import figure
from runner import launch, no_leftover_processes, prepare_fast
from wandb_reader import read_history

from dflash.config import EXIT_USER_ERROR
from dflash.data.sources import resolve_source

pytestmark = pytest.mark.faults

MAX_LENGTH = 160  # FAST's data.max_length
STOP = 3


def _pair(mask: list[int]) -> bool:
    return any(a and b for a, b in zip(mask, mask[1:], strict=False))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, run_cache, tiny_target_dir):
    """A pre-tokenized JSONL of clean samples of the embedded corpus with bad ones injected, the
    overrides to train on it, the expected counts and, from the data plan, the expected ledger."""
    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    fast = prepare_fast(run_cache)  # the FAST embedded corpus (a reused cache dir may hold others)
    src = Path(resolve_source(fast.cfg.data, fast.target_path))
    clean = []
    for line in src.read_text().splitlines():
        r = json.loads(line)
        ids, mask = r["input_ids"], r["loss_mask"]
        if len(ids) <= MAX_LENGTH and _pair(mask) and 0 <= min(ids) and max(ids) < vocab:
            clean.append({"input_ids": ids, "loss_mask": mask})
    clean = clean[:40]
    a, b, c = clean[0], clean[1], clean[2]
    long_ids = (a["input_ids"] + b["input_ids"])[: MAX_LENGTH + 40]
    bad = {
        "no_supervised_pair": [
            {"input_ids": a["input_ids"], "loss_mask": [0] * len(a["input_ids"])},  # empty loss mask
            {
                "input_ids": b["input_ids"],
                "loss_mask": [i % 2 for i in range(len(b["input_ids"]))],
            },  # no two in a row
        ],
        "too_long": [{"input_ids": long_ids, "loss_mask": [1] * len(long_ids)}],
        "token_out_of_vocab": [
            {"input_ids": [*c["input_ids"][:-1], vocab], "loss_mask": c["loss_mask"]},
            {"input_ids": [-1, *c["input_ids"][1:]], "loss_mask": c["loss_mask"]},
        ],
    }
    records, bad_ids = list(clean), {}
    for k, (reason, rec) in enumerate((reason, rec) for reason, recs in bad.items() for rec in recs):
        records.insert(4 + 7 * k, rec)  # increasing positions: earlier insertions keep their index
        bad_ids.setdefault(reason, []).append(4 + 7 * k)
    path = tmp_path_factory.mktemp("bad_corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = [
        f"data.path={path}",
        "data.num_eval_prompts=0",
        "data.num_epochs=1",
        "data.overlong=skip",
        "data.max_skip_fraction=0.2",
        "train.save_every=100",
    ]

    # The data plan, as every rank computes it (this also builds the dataset cache the ranks load).
    setup = prepare_fast(run_cache, overrides)
    planned = [setup.dataset.sample_ids[setup.plan.packet(g)].tolist() for g in range(setup.num_steps)]
    assert setup.num_steps >= STOP + 3
    # one non-finite sample trained before the stop, one after it
    nonfinite = [planned[1][0], planned[STOP + 2][-1]]
    expected_ledger = [
        {"step": g + 1, "packets": [g], "sample_ids": [i for i in ids if i not in nonfinite]}
        for g, ids in enumerate(planned)
    ]
    counts = {"malformed": 0, **{k: len(v) for k, v in bad_ids.items()}, "nonfinite_hidden": len(nonfinite)}
    overrides.append(f"fault.nonfinite_sample_ids=[{nonfinite[0]},{nonfinite[1]}]")
    return {
        "path": path,
        "overrides": overrides,
        "counts": counts,
        "bad_ids": bad_ids,
        "nonfinite": nonfinite,
        "ledger": expected_ledger,
        "num_records": len(records),
    }


def _skipped(ckpt: Path) -> dict[str, int]:
    return json.loads((ckpt / "train_state.json").read_text())["skipped"]


def test_bad_samples_are_skipped_counted_and_never_trained(tmp_path, run_cache, corpus):
    run_dir = tmp_path / "run"
    first = launch(run_dir, [*corpus["overrides"], f"train.stop_after_steps={STOP}"], run_cache)
    assert first.returncode == 0, first.output[-4000:]
    at_stop = _skipped(run_dir / "checkpoints" / f"step_{STOP:08d}")
    assert at_stop == {
        **corpus["counts"],
        "nonfinite_hidden": 1,
    }  # the dataset's counts + one non-finite so far
    second = launch(run_dir, corpus["overrides"], run_cache)
    assert second.returncode == 0, second.output[-4000:]
    assert f"at step {STOP}" in second.rank_log(2)

    last = read_history(run_dir)[-1]
    logged = {
        k.removeprefix("data/skipped/"): int(v) for k, v in last.items() if k.startswith("data/skipped/")
    }
    assert logged == corpus["counts"]
    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert _skipped(final) == corpus["counts"]
    ledger = second.ledger()
    assert ledger == corpus["ledger"]
    trained = [i for e in ledger for i in e["sample_ids"]]
    bad = {i for v in corpus["bad_ids"].values() for i in v} | set(corpus["nonfinite"])
    assert not bad & set(trained) and len(trained) == len(set(trained))
    assert len(trained) + len(bad) == corpus["num_records"]  # every sample trained once or skipped once
    figure(
        "R5 bad input",
        injected=corpus["counts"],
        logged_last_row=logged,
        checkpoint=_skipped(final),
        at_stop_step_checkpoint=at_stop,
        crashes=0,
        bad_trained=0,
        trained_samples=len(trained),
        records=corpus["num_records"],
    )
    assert no_leftover_processes(first, second)


def test_too_many_bad_samples_abort_on_every_rank(tmp_path, run_cache, corpus):
    overrides = [o for o in corpus["overrides"] if not o.startswith("data.max_skip_fraction")]
    run = launch(
        tmp_path / "run",
        [*overrides, "logging.mode=disabled"],
        run_cache,
        stop_peers_on_failure=False,  # every rank must reject the data by itself
        timeout=120,
    )
    assert run.returncode != 0
    exits = run.exits()
    n_bad = sum(len(v) for v in corpus["bad_ids"].values())
    for r in range(3):
        assert exits[(r, 0)]["returncode"] == EXIT_USER_ERROR  # a data problem the user fixes: no traceback
        log = run.rank_log(r)
        assert f"data.max_skip_fraction=0.1: {n_bad} of {corpus['num_records']} conversations" in log, log[
            -2000:
        ]
        assert "gloo on" not in log  # never got to the process group, let alone a model
    ended = max(e["end"] for e in exits.values()) - run.started_at
    figure(
        "R5 skip rate above data.max_skip_fraction",
        skipped=n_bad,
        records=corpus["num_records"],
        exit_codes=[exits[(r, 0)]["returncode"] for r in range(3)],
        all_ranks_done_s=round(ended, 1),
    )
    assert no_leftover_processes(run)
