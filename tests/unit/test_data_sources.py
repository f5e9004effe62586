"""The data paths users try (issue 19, item 10): parquet, a JSON array, a folder mixing chat and
ShareGPT files, a glob and a list of paths all train the same records as one JSONL, and every
skipped record names its own file and line (or row)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from dflash.config import DataConfig
from dflash.data.cache import build_or_load_dataset
from dflash.data.sources import Source, load_eval_conversations

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def tok(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def chat(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"Continue this code:\ndef f{i}(x):"},
            {"role": "assistant", "content": f"    return x * {i} + {i % 5}"},
        ]
    }


def sharegpt(i: int) -> dict:
    turns = chat(i)["messages"]
    return {
        "conversations": [
            {"from": {"user": "human"}.get(m["role"], "gpt"), "value": m["content"]} for m in turns
        ]
    }


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build(tmp_path: Path, tok, path, **kw):
    cfg = DataConfig(path=path, cache_dir=str(tmp_path / "cache"), max_skip_fraction=0.5, **kw)
    return build_or_load_dataset(cfg, tok, len(tok))


def same_samples(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) for i in range(len(a)) for x, y in zip(a.sample(i), b.sample(i), strict=True)
    )


def test_parquet_and_a_json_array_are_read_with_datasets(tmp_path, tok):
    rows = [chat(i) for i in range(8)]
    reference = build(tmp_path, tok, str(jsonl(tmp_path / "chat.jsonl", rows)))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "chat.parquet"))
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=1))
    for name in ("chat.parquet", "array.json"):
        ds = build(tmp_path, tok, str(tmp_path / name))
        assert ds.skipped["malformed"] == 0 and same_samples(ds, reference), name  # was: all malformed
    # a .json file of JSON lines is read line by line (a bad line is one record, named by its line)
    lines = tmp_path / "lines.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows[:4]) + "{ broken\n")
    src = Source(str(lines))
    assert [w for _, w, _ in src.numbered()][-1] == f"{lines}:5"


def test_a_folder_mixing_chat_sharegpt_and_parquet_files_keeps_every_record(tmp_path, tok, caplog):
    folder = tmp_path / "data"
    jsonl(folder / "a_chat.jsonl", [chat(i) for i in range(4)])
    jsonl(folder / "b_sharegpt.jsonl", [sharegpt(i) for i in range(4, 8)])
    datasets.Dataset.from_list([sharegpt(i) for i in range(8, 10)]).to_parquet(
        str(folder / "c" / "more.parquet")
    )
    (folder / "c" / "bad.jsonl").write_text(json.dumps(chat(10)) + "\n\n{ broken\n")
    (folder / "a_chat.jsonl.meta.json").write_text("{}")  # sidecars and hidden files are not data
    jsonl(folder / "a_chat.jsonl.failed.jsonl", [{"index": 0, "error": "x"}])
    jsonl(folder / ".hidden" / "x.jsonl", [chat(99)])
    src = Source(str(folder))
    assert [p.name for p in src.parts] == [
        str(folder / n) for n in ("a_chat.jsonl", "b_sharegpt.jsonl", "c/bad.jsonl", "c/more.parquet")
    ]
    assert src.num_records == 12
    with caplog.at_level(logging.WARNING, logger="dflash.data.tokenize"):
        ds = build(tmp_path, tok, str(folder))
    assert len(ds) == 11 and ds.skipped["malformed"] == 1  # was: every ShareGPT record malformed
    assert f"({folder / 'c' / 'bad.jsonl'}:3)" in ds.skip_examples["malformed"]  # its own file and line
    reference = build(
        tmp_path,
        tok,
        str(jsonl(tmp_path / "all.jsonl", [chat(i) for i in (*range(4), *range(4, 8), 10, 8, 9)])),
    )
    assert same_samples(ds, reference)


def test_a_json_array_mixing_chat_and_sharegpt_rows(tmp_path, tok):
    rows = [chat(0), sharegpt(1), chat(2), sharegpt(3)]
    (tmp_path / "mixed.json").write_text(json.dumps(rows))
    ds = build(tmp_path, tok, str(tmp_path / "mixed.json"))
    assert len(ds) == 4 and ds.skipped["malformed"] == 0  # datasets fills `messages: None` for ShareGPT rows


def test_a_glob_and_a_list_of_paths(tmp_path, tok):
    a = jsonl(tmp_path / "part-0.jsonl", [chat(i) for i in range(3)])
    b = jsonl(tmp_path / "part-1.jsonl", [sharegpt(i) for i in range(3, 6)])
    datasets.Dataset.from_list([chat(i) for i in range(6, 8)]).to_parquet(str(tmp_path / "part-2.parquet"))
    as_list = build(tmp_path, tok, [str(a), str(b), str(tmp_path / "part-2.parquet")])
    as_glob = build(tmp_path, tok, str(tmp_path / "part-*"))  # was: "does not exist"
    assert len(as_list) == 8 and as_list.fingerprint == as_glob.fingerprint and same_samples(as_list, as_glob)
    assert (
        as_list.fingerprint
        != build(tmp_path, tok, [str(b), str(a), str(tmp_path / "part-2.parquet")]).fingerprint
    )
    # the held-out tail is the end of the last file
    held = load_eval_conversations(
        DataConfig(path=[str(a), str(b)], cache_dir=str(tmp_path), num_eval_prompts=2)
    )
    assert [m[0]["content"] for m in held] == [
        chat(4)["messages"][0]["content"],
        chat(5)["messages"][0]["content"],
    ]
    with pytest.raises(ValueError, match="the glob matches no file"):
        Source(str(tmp_path / "nothing-*.jsonl"))
    with pytest.raises(ValueError, match=r"data.path=\[\]: give a file, a folder, a glob"):
        Source([])
    with pytest.raises(ValueError, match="'embedded' cannot be part of a list"):
        build(tmp_path, tok, [str(a), "embedded"])
