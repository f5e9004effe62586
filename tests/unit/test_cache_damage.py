"""The caches the project builds are checked on every load and rebuilt when damaged (issue 19, item 5).

Each test damages a real cache entry the way a disk, a copy or a person does (same-size garbage, a
truncation, an edited ``meta.json``, NaN weights), then asserts that the next load names the damaged
file, rebuilds the entry from its source and gets exactly what a clean build gives.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from dflash import files
from dflash.config import DataConfig, TinyTargetConfig
from dflash.data.cache import DamagedCache, build_or_load_dataset, cache_dir_of, load_cached_dataset
from dflash.data.embedded import build_embedded_corpus
from dflash.files import digest_files, digest_problems, file_digest
from dflash.targets.tiny import ensure_tiny_target


@pytest.fixture(scope="module")
def tok(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def chat_source(path: Path, n: int = 24) -> Path:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Continue this code:\ndef f{i}(x):"},
                {"role": "assistant", "content": f"    return x * {i} + {i % 5}"},
            ]
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def built(tok, tmp_path):
    """(config, vocab size, the clean dataset, its cache directory)."""
    cfg = DataConfig(path=str(chat_source(tmp_path / "chat.jsonl")), cache_dir=str(tmp_path / "cache"))
    vocab = len(tok)
    ds = build_or_load_dataset(cfg, tok, vocab)
    return cfg, vocab, ds, cache_dir_of(cfg, tok, vocab)


def _same(a, b) -> bool:
    return all(
        torch.equal(getattr(a, k), getattr(b, k)) for k in ("tokens", "loss_mask", "offsets", "sample_ids")
    )


def _garble_same_size(path: Path) -> None:
    """Every byte after the safetensors header replaced (the header parses, the values are garbage)."""
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start:] = bytes((i * 37 + 11) % 256 for i in range(len(raw) - start))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["same_size_garbage", "truncated", "bad_meta_value", "meta_not_json"])
def test_a_damaged_dataset_cache_is_named_and_rebuilt(built, tok, caplog, damage):
    cfg, vocab, clean, entry = built
    data, meta = entry / "data.safetensors", entry / "meta.json"
    if damage == "same_size_garbage":
        size = data.stat().st_size
        _garble_same_size(data)
        assert data.stat().st_size == size
        named = str(data)
    elif damage == "truncated":
        os.truncate(data, data.stat().st_size // 2)
        named = str(data)
    elif damage == "bad_meta_value":
        m = json.loads(meta.read_text())
        m["num_source"] = "twenty-four"  # was "invalid literal for int()" naming no file
        meta.write_text(json.dumps(m))
        named = str(meta)
    else:
        meta.write_text("{ not json")
        named = str(meta)
    with pytest.raises(DamagedCache, match=named):
        load_cached_dataset(entry)
    with caplog.at_level(logging.WARNING, logger="dflash.data.cache"):
        again = build_or_load_dataset(cfg, tok, vocab)
    assert f"dataset cache {entry} is damaged, rebuilding it" in caplog.text and named in caplog.text
    assert not again.loaded_from_cache and _same(again, clean)
    assert again.skipped == clean.skipped and again.skipped["token_out_of_vocab"] == 0
    assert build_or_load_dataset(cfg, tok, vocab).loaded_from_cache  # the rebuilt entry is trusted


def test_garbage_that_matches_the_hash_is_still_refused_by_its_values(built, tok):
    """Defence in depth for the sampled digest of huge files: ids outside the vocabulary are refused
    before anything reaches an embedding (was an IndexError in training)."""
    cfg, vocab, clean, entry = built
    t = load_file(str(entry / "data.safetensors"))
    t["tokens"][3] = vocab + 5
    save_file(t, str(entry / "data.safetensors"))
    m = json.loads((entry / "meta.json").read_text())
    m["files"] = digest_files(entry, ["data.safetensors"])
    from dflash.data.cache import meta_checksum

    m["checksum"] = meta_checksum(m)
    (entry / "meta.json").write_text(json.dumps(m))
    with pytest.raises(DamagedCache, match=rf"token ids outside \[0, {vocab}\)"):
        load_cached_dataset(entry)
    assert _same(build_or_load_dataset(cfg, tok, vocab), clean)


def test_an_entry_without_hashes_from_an_older_dflash_is_rebuilt(built, tok, caplog):
    cfg, vocab, clean, entry = built
    m = json.loads((entry / "meta.json").read_text())
    del m["files"], m["checksum"]
    (entry / "meta.json").write_text(json.dumps(m))
    with caplog.at_level(logging.WARNING, logger="dflash.data.cache"):
        again = build_or_load_dataset(cfg, tok, vocab)
    assert "no checksum (written by an older dflash" in caplog.text
    assert not again.loaded_from_cache and _same(again, clean)


def test_a_half_truncated_embedded_corpus_is_rebuilt(tiny_target_dir, tmp_path, caplog):
    out = tmp_path / "corpus.jsonl"
    kw = dict(num_prompts=6, max_new_tokens=8, seed=3, device="cpu")
    build_embedded_corpus(tiny_target_dir, out, **kw)
    clean = out.read_bytes()
    lines = clean.splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:3]))  # 3 of 6 records, each line whole: was used without a word
    with caplog.at_level(logging.WARNING, logger="dflash.data.embedded"):
        build_embedded_corpus(tiny_target_dir, out, **kw)
    assert f"embedded corpus {out} is damaged, rebuilding it" in caplog.text
    assert "truncated or replaced" in caplog.text
    assert out.read_bytes() == clean
    caplog.clear()
    build_embedded_corpus(tiny_target_dir, out, **kw)  # intact now: reused without a warning
    assert "damaged" not in caplog.text


def small_tiny_spec(num_layers: int, train_steps: int) -> TinyTargetConfig:
    return TinyTargetConfig(
        num_layers=num_layers,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        train_steps=train_steps,
    )


def test_nan_weights_in_the_cached_tiny_target_are_rebuilt(tmp_path, caplog):
    spec = small_tiny_spec(num_layers=2, train_steps=0)
    out = ensure_tiny_target(tmp_path / "tiny", spec)
    weights = out / "model.safetensors"
    clean = weights.read_bytes()
    t = load_file(str(weights))
    save_file(
        {k: torch.full_like(v, float("nan")) for k, v in t.items()}, str(weights), metadata={"format": "pt"}
    )
    assert weights.stat().st_size == len(clean)  # same size, every weight NaN
    with caplog.at_level(logging.WARNING, logger="dflash.targets.tiny"):
        assert ensure_tiny_target(tmp_path / "tiny", spec) == out
    assert f"tiny target {out} is damaged, rebuilding it" in caplog.text and str(weights) in caplog.text
    assert weights.read_bytes() == clean
    assert all(torch.isfinite(v).all() for v in load_file(str(weights)).values())


def test_digests_name_every_damaged_file_and_sample_huge_ones(tmp_path, monkeypatch):
    (tmp_path / "a").write_bytes(b"x" * 100)
    (tmp_path / "b").write_bytes(b"y" * 100)
    rec = digest_files(tmp_path, ["a", "b"])
    assert digest_problems(tmp_path, rec) == []
    (tmp_path / "a").write_bytes(b"x" * 99 + b"z")
    os.remove(tmp_path / "b")
    assert digest_problems(tmp_path, rec) == [
        f"{tmp_path / 'a'}: content differs from when it was written (sha256 mismatch)",
        f"{tmp_path / 'b'}: missing",
    ]
    assert "no content hashes" in digest_problems(tmp_path, None)[0]
    monkeypatch.setattr(files, "SAMPLE_BLOCKS", 4)  # blocks of 1 MiB: a 6 MiB file is "huge"
    big = tmp_path / "big"
    big.write_bytes(os.urandom(6 << 20))
    d = file_digest(big, sample_above=1)
    assert d["sampled"] == 1 and file_digest(big)["sha256"] != d["sha256"]
    with open(big, "r+b") as fh:  # one byte of the last block: a sampled block
        fh.seek(big.stat().st_size - 10)
        fh.write(b"\0" if fh.read(1) != b"\0" else b"\1")
    assert "sha256 mismatch" in digest_problems(tmp_path, {"big": d})[0]


def test_the_default_tiny_target_is_the_shipped_build(tmp_path, monkeypatch):
    """The default spec is copied from dflash/targets/prebuilt (the same weights on every CPU), never
    trained where it runs; a damaged shipped file is named, and nothing is put in place."""
    from dflash.targets import tiny

    def no_training(*args, **kwargs):
        raise AssertionError("the default spec was trained instead of copied")

    monkeypatch.setattr(tiny, "build_tiny_target", no_training)
    out = ensure_tiny_target(tmp_path / "tiny", TinyTargetConfig())
    shipped = json.loads((tiny.PREBUILT_DIR / "dflash_tiny_done.json").read_text())
    assert shipped["spec"] == TinyTargetConfig().key() and shipped["version"] == tiny.BUILD_VERSION
    for name in shipped["files"]:
        assert (out / name).read_bytes() == (tiny.PREBUILT_DIR / name).read_bytes(), name
    assert digest_problems(out, shipped["files"]) == []
    damaged = tmp_path / "prebuilt"
    shutil.copytree(tiny.PREBUILT_DIR, damaged)
    (damaged / "config.json").write_text("{}")
    monkeypatch.setattr(tiny, "PREBUILT_DIR", damaged)
    with pytest.raises(RuntimeError, match=r"prebuilt/config.json: \d+ bytes.*reinstall dflash"):
        ensure_tiny_target(tmp_path / "again", TinyTargetConfig())
    assert not (tmp_path / "again").exists()


def test_another_spec_is_trained_here(tmp_path):
    out = ensure_tiny_target(tmp_path / "tiny", small_tiny_spec(num_layers=1, train_steps=3))
    marker = json.loads((out / "dflash_tiny_done.json").read_text())
    assert (
        marker["spec"]["train_steps"] == 3
        and math.isfinite(marker["final_loss"])
        and marker["final_loss"] > 0
    )
