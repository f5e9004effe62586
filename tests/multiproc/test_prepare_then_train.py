"""python -m dflash.data.prepare builds the cache with worker processes (byte-identical to one
process), prints the statistics and shows samples with the supervised tokens marked exactly as
trained; a training launch with the same overrides then loads that cache on every rank without
rebuilding (the app and the job run as processes forked from tests/ranks.py's forkserver)."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
from ranks import run_module
from runner import FAST, REPO, env_for, launch
from transformers import AutoTokenizer

from dflash.config import DataConfig
from dflash.data.cache import build_or_load_dataset
from dflash.data.chat import tokenize_conversation
from dflash.data.display import CLOSE, OPEN, marked_runs

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

HEADER = re.compile(r"^--- sample (\d+) \(record (\d+)\): (\d+) tokens, (\d+) supervised ---$", re.M)


def corpus(path: Path) -> list[dict]:
    """40 conversations (a fresh id in the last one, so the dataset is always built here, even in a
    reused DFLASH_TEST_CACHE_DIR) and one malformed line."""
    records = []
    for i in range(40):
        name = f"f{i}" if i < 39 else f"f_{uuid.uuid4().hex}"
        msgs = [{"role": "user", "content": f"Continue this code:\ndef {name}(x):"}]
        msgs.append({"role": "assistant", "content": f"    return x * {i} + {i % 7}"})
        if i % 3 == 0:
            msgs += [
                {"role": "user", "content": "And the inverse?"},
                {"role": "assistant", "content": f"x / {i + 1}"},
            ]
        records.append({"messages": msgs})
    lines = [json.dumps(r) for r in records]
    lines.insert(5, "{ broken")  # counted as malformed, shown in the statistics
    path.write_text("\n".join(lines) + "\n")
    return records


def parse_shown(stdout: str) -> list[tuple[int, list[tuple[str, bool]]]]:
    """(record index, [(text, supervised)]) of every sample printed by ``show=``."""
    heads = list(HEADER.finditer(stdout))
    out = []
    for k, h in enumerate(heads):
        body = stdout[h.end() + 1 : heads[k + 1].start() - 1 if k + 1 < len(heads) else len(stdout)]
        if k + 1 == len(heads):
            body = body[: -1 if body.endswith("\n") else None]
        runs = []
        for part in re.split(f"({OPEN}.*?{CLOSE})", body, flags=re.S):
            if part.startswith(OPEN):
                runs.append((part[1:-1], True))
            elif part:
                runs.append((part, False))
        out.append((int(h.group(2)), runs))
    return out


def test_prepare_shows_the_trained_mask_and_training_loads_its_cache(tmp_path, run_cache, tiny_target_dir):
    src = tmp_path / "chat.jsonl"
    records = corpus(src)
    overrides = [f"data.path={src}", "data.num_eval_prompts=2", "data.num_workers=2"]
    argv = [*FAST, *overrides, "show=3", f"hydra.run.dir={tmp_path / 'prep'}"]
    proc = run_module("dflash.data.prepare", argv, env=env_for(run_cache), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    m = re.search(r"dataset (\w{12}) built: (\S+)", out)
    assert m, out[-3000:]
    cache_dir = Path(m.group(2))
    assert re.search(r"conversations\s+39\nsamples\s+38\n", out), out  # 41 records, 2 held out, 1 malformed
    assert "skipped        1 (malformed 1," in out and "length histogram" in out and "supervised" in out
    assert (tmp_path / "prep" / "prepare.log").exists()

    # the same cache built in one process is byte-identical
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    one = DataConfig(
        path=str(src),
        cache_dir=str(tmp_path / "one"),
        max_length=160,
        num_eval_prompts=2,
        token_budget=640,
    )
    ds = build_or_load_dataset(
        one, tok, json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    )
    assert ds.fingerprint == cache_dir.name
    for name in ("data.safetensors", "meta.json"):
        assert (cache_dir / name).read_bytes() == (tmp_path / "one" / ds.fingerprint / name).read_bytes(), (
            name
        )

    # what show= printed is the trained loss mask, and it covers the assistant turns and nothing else
    shown = parse_shown(out)
    assert [r for r, _ in shown] == [0, 1, 2]
    for k, (record, runs) in enumerate(shown):
        ids, mask = ds.sample(k)
        assert runs == marked_runs(ids, mask, tok), k
        messages = records[record]["messages"]  # records 0-4 precede the malformed line
        want_ids, want_mask = tokenize_conversation(tok, messages)
        assert ids.tolist() == want_ids and mask.tolist() == want_mask
        supervised = [t for t, sup in runs if sup]
        assert supervised == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]

    # a launch with the same overrides loads the cache on every rank, nothing is tokenized again
    mtime = (cache_dir / "data.safetensors").stat().st_mtime_ns
    run = launch(tmp_path / "run", [*overrides, "train.max_steps=2", "logging.mode=disabled"], run_cache)
    assert run.returncode == 0, run.output[-4000:]
    for rank in range(3):
        text = run.rank_log(rank)
        assert f"loaded from the cache {cache_dir}" in text, text[-2000:]
        assert "tokenizing" not in text and "built into the cache" not in text
    assert (cache_dir / "data.safetensors").stat().st_mtime_ns == mtime
