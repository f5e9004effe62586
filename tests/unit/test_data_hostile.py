"""Hostile records are skipped and counted with their line, a huge record costs little, and the
messages about an empty or all-bad source name the real cause and a fix validation accepts."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from testpaths import REPO
from transformers import AutoTokenizer

from dflash.cli import compose_config
from dflash.config import DataConfig, register_configs, to_config
from dflash.config.checks import config_problems
from dflash.data.cache import build_or_load_dataset
from dflash.data.sources import Source
from dflash.data.tokenize import TokenizeSettings, tokenize_records


@pytest.fixture(scope="module")
def tok(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def good(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"Continue item {i}:\nimport os"},
            {"role": "assistant", "content": f"def f{i}(x):\n    return x + {i}"},
        ]
    }


def cfg_for(tmp_path: Path, src: Path, **kw) -> DataConfig:
    kw.setdefault("max_length", 128)
    kw.setdefault("max_skip_fraction", 0.5)
    return DataConfig(path=str(src), cache_dir=str(tmp_path / "cache"), **kw)


HOSTILE = {
    "deep nesting": b"[" * 200_000,
    "lone surrogate": json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a \ud800 b"}]}
    ).encode(),
    "int64 overflow": json.dumps({"input_ids": [10**30, 5, 6], "loss_mask": [0, 1, 1]}).encode(),
}


def test_hostile_records_are_counted_as_malformed_with_their_line(tok, tmp_path, caplog):
    """Each of these used to abort the whole job (RecursionError, TypeError from the tokenizer,
    OverflowError); now each is one malformed record, logged with its file and line, and the good
    records around it (in the same tokenizer batch) are all kept."""
    lines = [json.dumps(good(i)).encode() for i in range(12)]
    where = {}
    for k, (name, line) in enumerate(HOSTILE.items()):
        lines.insert(3 + 4 * k, line)
        where[name] = 3 + 4 * k + 1  # 1-based line number
    src = tmp_path / "hostile.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.WARNING, logger="dflash.data.tokenize"):
        ds = build_or_load_dataset(cfg_for(tmp_path, src), tok, len(tok))
    assert ds.skipped["malformed"] == 3 and ds.num_skipped == 3 and len(ds) == 12
    bad_idx = {where[n] - 1 for n in HOSTILE}
    assert ds.sample_ids.tolist() == [i for i in range(15) if i not in bad_idx]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for name, lineno in where.items():
        assert f"{src}:{lineno}" in logged, (name, logged)
    assert "nested too deeply" in logged and "tokenizer rejects" in logged and "outside the int64" in logged


def test_a_failing_batch_keeps_and_counts_every_other_record(tok):
    """A batch tokenizer call that fails on one text is redone record by record: nothing else of
    the batch is lost or miscounted, and the result equals tokenizing the good records alone."""
    records = [(i, f"mem:{i}", good(i)) for i in range(10)]
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x\udc80"}]}
    mixed = records[:4] + [(10, "mem:10", bad)] + records[4:]
    settings = TokenizeSettings(vocab_size=len(tok), max_length=128)
    ds = tokenize_records(mixed, tok, settings)
    clean = tokenize_records(records, tok, settings)
    assert ds.skipped["malformed"] == 1 and ds.num_source == 11 and len(ds) == 10
    assert torch.equal(ds.tokens, clean.tokens) and torch.equal(ds.loss_mask, clean.loss_mask)
    assert "mem:10" in ds.skip_examples["malformed"]


def test_worker_processes_give_the_same_dataset(tok):
    records = [(i, f"mem:{i}", good(i)) for i in range(23)]
    records[5] = (5, "mem:5", "not an object")
    records[17] = (17, "mem:17", {"input_ids": [1, 2, 10**9], "loss_mask": [0, 1, 1]})
    settings = TokenizeSettings(vocab_size=len(tok), max_length=24, overlong="skip")
    one = tokenize_records(records, tok, settings)
    seen: list[int] = []
    many = tokenize_records(records, tok, settings, num_workers=2, chunk_size=4, progress=seen.append)
    assert sum(seen) == 23 and len(seen) == 6
    for a, b in zip(
        (one.tokens, one.loss_mask, one.offsets, one.sample_ids),
        (many.tokens, many.loss_mask, many.offsets, many.sample_ids),
        strict=True,
    ):
        assert torch.equal(a, b)
    assert (one.skipped, one.skip_examples, one.truncated) == (
        many.skipped,
        many.skip_examples,
        many.truncated,
    )
    assert one.skipped["malformed"] == 1 and one.skipped["token_out_of_vocab"] == 1


HUGE = r"""
import json, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from dflash.config import DataConfig
from dflash.data.cache import build_or_load_dataset

def kib(key):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1])

tok = AutoTokenizer.from_pretrained(sys.argv[1])
cfg = DataConfig(**json.loads(sys.argv[2]))
Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
before = kib("VmRSS:")
t0 = time.perf_counter()
ds = build_or_load_dataset(cfg, tok, len(tok))
seconds = time.perf_counter() - t0
peak = kib("VmHWM:")
print(json.dumps({"seconds": seconds, "peak_extra_mib": (peak - before) / 1024, "n": len(ds),
                  "lengths": ds.lengths().tolist(), "ids": ds.sample_ids.tolist(),
                  "skipped": ds.skipped, "truncated": ds.truncated}))
"""


@pytest.mark.slow
def test_a_huge_record_costs_little_memory_and_time(tiny_target_dir, tmp_path):
    """A 30 MB assistant turn (and a 30 MB user turn) used to be rendered and tokenized whole
    (~11 GiB and ~70 s for 50 MB, to keep 128 tokens). The content is now cut to
    data.max_record_chars before rendering: seconds and a peak of a few times the line size."""
    big = "x = compute(x) + 1\n" * (30_000_000 // 19)
    records = [
        good(0),
        {"messages": [{"role": "user", "content": "Continue"}, {"role": "assistant", "content": big}]},
        {"messages": [{"role": "user", "content": big}, {"role": "assistant", "content": "ok"}]},
        good(3),
    ]
    src = tmp_path / "huge.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert src.stat().st_size > 60_000_000
    args = {
        "path": str(src),
        "cache_dir": str(tmp_path / "cache"),
        "max_length": 128,
        "max_skip_fraction": 0.5,
    }
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", HUGE, str(tiny_target_dir), json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nhuge records: {r['seconds']:.2f} s, peak +{r['peak_extra_mib']:.0f} MiB")
    assert r["ids"] == [0, 1, 3] and r["lengths"][1] == 128 and r["truncated"] == 1
    assert r["skipped"]["too_long"] == 1  # no assistant turn starts within the cap
    assert r["seconds"] < 20 and r["peak_extra_mib"] < 600


def test_empty_source_names_the_file_not_num_eval_prompts(tok, tmp_path):
    for content in (b"", b"\n  \n\n"):
        src = tmp_path / "empty.jsonl"
        src.write_bytes(content)
        with pytest.raises(ValueError) as err:
            build_or_load_dataset(cfg_for(tmp_path, src), tok, len(tok))
        msg = str(err.value)
        assert f"data.path='{src}' has no records" in msg and "num_eval_prompts" not in msg
    with pytest.raises(ValueError, match="input=.* has no records"):
        Source(str(src), field="input")


def _compose_ok(overrides: list[str]) -> list[str]:
    register_configs()
    return config_problems(to_config(compose_config("config", overrides)), 3)


def test_skip_messages_name_the_cause_and_a_valid_fix(tok, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text("not json\n" * 3 + '{"messages": []}\n')
    with pytest.raises(ValueError) as err:
        build_or_load_dataset(cfg_for(tmp_path, src, max_skip_fraction=0.9), tok, len(tok))
    msg = str(err.value)
    assert "no training sample left: all 4 conversations were skipped (malformed=4)" in msg
    assert "cannot help" in msg and "above 1" not in msg and f"{src}:1" in msg

    src.write_text("not json\n" * 3 + "".join(json.dumps(good(i)) + "\n" for i in range(4)))
    with pytest.raises(ValueError) as err:
        build_or_load_dataset(cfg_for(tmp_path, src, max_skip_fraction=0.1), tok, len(tok))
    msg = str(err.value)
    assert "3 of 7 conversations (42.9%)" in msg and "set data.max_skip_fraction=0.429" in msg
    assert _compose_ok(["data.max_skip_fraction=0.429"]) == []
    build_or_load_dataset(cfg_for(tmp_path, src, max_skip_fraction=0.429), tok, len(tok))  # the fix works
