"""Tokenized dataset: exact skip counts, truncation, abort message, cache, concurrency, eval tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from testpaths import REPO
from transformers import AutoTokenizer

import dflash.data.cache as cache_mod
from dflash.config import DataConfig
from dflash.data.cache import build_or_load_dataset, cache_dir_of, lock_path
from dflash.data.chat import tokenize_conversation
from dflash.data.sources import load_conversations, load_eval_conversations, parse_messages
from dflash.data.tokenize import SKIP_REASONS
from dflash.files import file_lock

OOV = "<oov_marker>"  # added to the tokenizer with an id >= the vocab size we pass


@pytest.fixture(scope="module")
def tok(tiny_target_dir):
    t = AutoTokenizer.from_pretrained(tiny_target_dir)
    t.add_tokens([OOV])
    return t


def good(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"Continue item {i}:\nimport os"},
            {"role": "assistant", "content": f"def f{i}(x):\n    return x + {i}"},
        ]
    }


INJECTED = {
    "malformed": [
        '{"messages": [ broken json',
        b'{"messages": \xff\xfe "not utf-8, not JSON in any encoding: a damaged line"}',
        "[1, 2, 3]",
        '{"text": "no messages field"}',
        '{"messages": []}',
        '{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}',
        '{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}',
    ],
    "too_long": [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "word " * 300},
                    {"role": "assistant", "content": "ok then"},
                ]
            }
        )
        for _ in range(2)
    ],
    "no_supervised_pair": [
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "   "}]}),
    ],
    "token_out_of_vocab": [
        json.dumps(
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a {OOV} b"}]}
        )
    ],
}
NUM_GOOD = 30


def write_source(path: Path, num_good: int = NUM_GOOD, injected: dict | None = None) -> Path:
    """num_good good lines with the injected bad lines interleaved (and blank lines, not records)."""
    injected = INJECTED if injected is None else injected
    bad = [
        line if isinstance(line, bytes) else line.encode() for lines in injected.values() for line in lines
    ]
    lines: list[bytes] = []
    for i in range(num_good):
        lines.append(json.dumps(good(i)).encode())
        if i % 3 == 1 and bad:
            lines.append(bad.pop())
        if i == 5:
            lines.append(b"   ")
    lines += bad
    path.write_bytes(b"\n".join(lines) + b"\n\n")
    return path


def make_cfg(tmp_path: Path, src: Path, **kw) -> DataConfig:
    kw.setdefault("max_length", 128)
    kw.setdefault("max_skip_fraction", 0.5)
    return DataConfig(path=str(src), cache_dir=str(tmp_path / "cache"), **kw)


def vocab(tok) -> int:
    return len(tok) - 1  # the OOV marker's id is out of the target's vocabulary


def test_every_skip_reason_counted_exactly(tok, tmp_path):
    src = write_source(tmp_path / "chat.jsonl")
    ds = build_or_load_dataset(make_cfg(tmp_path, src, overlong="skip"), tok, vocab(tok))
    assert ds.skipped == {r: len(INJECTED[r]) for r in SKIP_REASONS}
    assert ds.truncated == 0
    n_bad = sum(len(v) for v in INJECTED.values())
    assert ds.num_source == NUM_GOOD + n_bad and len(ds) == NUM_GOOD
    assert set(ds.skip_examples) == set(SKIP_REASONS)
    # kept samples are exactly the good conversations, tokenized as tokenize_conversation does
    records = list(load_conversations(str(src)))
    for k, sid in enumerate(ds.sample_ids.tolist()):
        ids, mask = ds.sample(k)
        assert ids.dtype == torch.int64 and mask.dtype == torch.uint8
        want_ids, want_mask = tokenize_conversation(tok, parse_messages(records[sid]))
        assert ids.tolist() == want_ids and mask.tolist() == want_mask
    assert ds.tokens.dtype == torch.int32 and ds.offsets.dtype == torch.int64
    assert ds.lengths().sum() == ds.tokens.numel() == ds.loss_mask.numel()


def test_truncate_keeps_overlong_samples(tok, tmp_path):
    src = write_source(tmp_path / "chat.jsonl")
    ds = build_or_load_dataset(make_cfg(tmp_path, src, overlong="truncate"), tok, vocab(tok))
    # the long user turn fills max_length, so the truncated samples lose their assistant turn
    assert ds.skipped["too_long"] == 0 and ds.truncated == 2
    assert ds.skipped["no_supervised_pair"] == len(INJECTED["no_supervised_pair"]) + 2
    # with a response that survives truncation, the sample is kept at exactly max_length
    long_resp = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 300}]
    }
    src2 = tmp_path / "long.jsonl"
    src2.write_text(json.dumps(long_resp) + "\n" + json.dumps(good(0)) + "\n")
    ds2 = build_or_load_dataset(make_cfg(tmp_path, src2, max_length=40), tok, vocab(tok))
    assert ds2.truncated == 1 and ds2.lengths().tolist()[0] == 40 and ds2.num_skipped == 0


def test_too_many_skips_abort_with_counts_and_fix(tok, tmp_path):
    src = write_source(tmp_path / "chat.jsonl")
    with pytest.raises(ValueError) as err:
        build_or_load_dataset(
            make_cfg(tmp_path, src, overlong="skip", max_skip_fraction=0.1), tok, vocab(tok)
        )
    msg = str(err.value)
    assert "data.max_skip_fraction=0.1" in msg
    assert "malformed=7" in msg and "too_long=2" in msg and "token_out_of_vocab=1" in msg
    assert "no_supervised_pair=2" in msg and "Fix:" in msg and "data.overlong=truncate" in msg


def test_cache_hit_does_not_retokenize(tok, tmp_path, monkeypatch):
    src = write_source(tmp_path / "chat.jsonl")
    cfg = make_cfg(tmp_path, src)
    first = build_or_load_dataset(cfg, tok, vocab(tok))
    assert not first.loaded_from_cache
    data_file = Path(cfg.cache_dir) / first.fingerprint / "data.safetensors"
    mtime = data_file.stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("re-tokenized on a cache hit")

    monkeypatch.setattr(cache_mod, "tokenize_records", boom)
    second = build_or_load_dataset(cfg, tok, vocab(tok))
    assert second.loaded_from_cache and data_file.stat().st_mtime_ns == mtime
    assert second.fingerprint == first.fingerprint and second.skipped == first.skipped
    assert torch.equal(second.tokens, first.tokens) and torch.equal(second.offsets, first.offsets)
    assert torch.equal(second.loss_mask, first.loss_mask) and torch.equal(second.sample_ids, first.sample_ids)
    meta = json.loads((data_file.parent / "meta.json").read_text())
    assert meta["num_source"] == first.num_source and meta["skipped"] == first.skipped
    assert sorted(p.name for p in data_file.parent.iterdir()) == ["data.safetensors", "meta.json"]


def test_fingerprint_changes_with_settings_and_source(tok, tmp_path):
    src = write_source(tmp_path / "chat.jsonl")
    base = cache_dir_of(make_cfg(tmp_path, src), tok, vocab(tok))
    assert cache_dir_of(make_cfg(tmp_path, src), tok, vocab(tok)) == base
    changed = [
        cache_dir_of(make_cfg(tmp_path, src, max_length=64), tok, vocab(tok)),
        cache_dir_of(make_cfg(tmp_path, src, overlong="skip"), tok, vocab(tok)),
        cache_dir_of(make_cfg(tmp_path, src, train_only_last_turn=True), tok, vocab(tok)),
        cache_dir_of(make_cfg(tmp_path, src, num_samples=10), tok, vocab(tok)),
        cache_dir_of(make_cfg(tmp_path, src, num_eval_prompts=2), tok, vocab(tok)),
        cache_dir_of(make_cfg(tmp_path, src), tok, vocab(tok) + 1),
    ]
    ds = build_or_load_dataset(make_cfg(tmp_path, src, max_length=64), tok, vocab(tok))
    assert ds.fingerprint == changed[0].name != base.name
    with open(src, "ab") as fh:  # the source content changes
        fh.write(json.dumps(good(99)).encode() + b"\n")
    changed.append(cache_dir_of(make_cfg(tmp_path, src), tok, vocab(tok)))
    assert len({base, *changed}) == 1 + len(changed)


def test_held_out_tail_and_num_samples(tok, tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(good(i)) + "\n" for i in range(20)))
    cfg = make_cfg(tmp_path, src, num_eval_prompts=4)
    ds = build_or_load_dataset(cfg, tok, vocab(tok))
    assert ds.sample_ids.tolist() == list(range(16)) and ds.num_source == 16
    evals = load_eval_conversations(cfg)
    assert evals == [good(i)["messages"] for i in range(16, 20)]
    # num_samples takes the first N; the eval tail stays the same
    cfg_n = make_cfg(tmp_path, src, num_eval_prompts=4, num_samples=5)
    assert build_or_load_dataset(cfg_n, tok, vocab(tok)).sample_ids.tolist() == list(range(5))
    assert load_eval_conversations(cfg_n) == evals
    with pytest.raises(ValueError, match="data.num_eval_prompts"):
        build_or_load_dataset(make_cfg(tmp_path, src, num_eval_prompts=20), tok, vocab(tok))


def test_sharegpt_records_and_missing_datasets(tok, tmp_path):
    rec = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]}
    assert parse_messages(rec) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
    ]
    with pytest.raises(ValueError, match="does not exist"):
        build_or_load_dataset(make_cfg(tmp_path, tmp_path / "missing.jsonl"), tok, vocab(tok))


def test_a_file_that_is_not_jsonl_needs_datasets(tok, tmp_path, monkeypatch):
    (tmp_path / "chat.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(ValueError, match=r"`datasets` is not installed: pip install 'dflash\[data\]'"):
        build_or_load_dataset(make_cfg(tmp_path, tmp_path / "chat.parquet"), tok, vocab(tok))


def test_a_saved_datasets_dataset_equals_the_same_records_in_jsonl(tok, tmp_path):
    datasets = pytest.importorskip("datasets")
    records = [good(i) for i in range(6)]
    records.insert(2, {"messages": [{"role": "user", "content": "only a question"}]})
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "ds"))

    from_jsonl = build_or_load_dataset(make_cfg(tmp_path, src), tok, vocab(tok))
    from_hf = build_or_load_dataset(make_cfg(tmp_path, tmp_path / "ds"), tok, vocab(tok))
    assert len(from_hf) == len(from_jsonl) == 6
    assert from_hf.skipped == from_jsonl.skipped and from_hf.skipped["no_supervised_pair"] == 1
    for i in range(6):
        for a, b in zip(from_hf.sample(i), from_jsonl.sample(i), strict=True):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="data.split='test' is not in"):
        build_or_load_dataset(make_cfg(tmp_path, tmp_path / "ds", split="test"), tok, vocab(tok))


CHILD = r"""
import json, sys
from transformers import AutoTokenizer
from dflash.config import DataConfig
from dflash.data.cache import build_or_load_dataset
tok = AutoTokenizer.from_pretrained(sys.argv[1])
tok.add_tokens([sys.argv[3]])
cfg = DataConfig(**json.loads(sys.argv[2]))
print("ready", flush=True)
ds = build_or_load_dataset(cfg, tok, len(tok) - 1)
print(json.dumps({"cached": ds.loaded_from_cache, "fp": ds.fingerprint, "n": len(ds),
                  "sum": int(ds.tokens.long().sum())}), flush=True)
"""


def test_concurrent_build_from_two_processes(tok, tiny_target_dir, tmp_path):
    src = write_source(tmp_path / "chat.jsonl")
    cfg = make_cfg(tmp_path, src)
    final = cache_dir_of(cfg, tok, vocab(tok))
    args = json.dumps(
        {
            "path": cfg.path,
            "cache_dir": cfg.cache_dir,
            "max_length": cfg.max_length,
            "max_skip_fraction": cfg.max_skip_fraction,
        }
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # hold the build lock until both processes are about to build, so they really race for it
    with file_lock(lock_path(final.parent, final.name)):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CHILD, str(tiny_target_dir), args, OOV],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in range(2)
        ]
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        time.sleep(0.5)
        assert not final.exists()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["cached"] for r in results) == [False, True]  # exactly one built
    assert results[0]["fp"] == results[1]["fp"] == final.name
    assert results[0]["n"] == results[1]["n"] == NUM_GOOD and results[0]["sum"] == results[1]["sum"]
    assert [p.name for p in final.parent.iterdir() if not p.name.startswith(".") or "tmp" in p.name] == [
        final.name
    ]


def test_pretokenized_records_are_kept_exactly_and_bad_ones_counted(tok, tmp_path):
    src = tmp_path / "ids.jsonl"
    good = {
        "input_ids": [5, 6, 7, 8, 9],
        "loss_mask": [0, 0, 1, 1, 1],
        "messages": [{"role": "user", "content": "x"}],
    }
    bad = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1]},  # lengths differ
        {"input_ids": [5, "6", 7], "loss_mask": [0, 1, 1]},  # not integers
        {"input_ids": [5, 6, 7], "loss_mask": [0, 2, 1]},  # mask not 0/1
    ]
    oov = {"input_ids": [5, 6, 10**9], "loss_mask": [0, 1, 1]}
    unsupervised = {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 0]}
    src.write_text("\n".join(json.dumps(r) for r in [good, *bad, oov, unsupervised]) + "\n")
    ds = build_or_load_dataset(make_cfg(tmp_path, src, max_skip_fraction=1.0), tok, vocab(tok))
    assert (
        len(ds) == 1
        and ds.sample(0)[0].tolist() == good["input_ids"]
        and ds.sample(0)[1].tolist() == good["loss_mask"]
    )
    assert (
        ds.skipped["malformed"] == 3
        and ds.skipped["token_out_of_vocab"] == 1
        and ds.skipped["no_supervised_pair"] == 1
    )
