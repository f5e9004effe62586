"""A user's own model directory is never written (issue 19, item 1), and a pinned revision means
nothing for a local directory with trust_remote_code (item 13).

``conf/target/tiny.yaml`` sets ``target.tiny`` (build the offline tiny target at ``target.path``);
``target.path=<your model>`` keeps it. ``prepare`` must then load that model as it is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner import FAST, REPO, env_for

from dflash.config import TargetConfig, TinyTargetConfig
from dflash.targets.loader import check_remote_code_source
from dflash.targets.tiny import ensure_tiny_target, tiny_target_path

pytestmark = pytest.mark.faults

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


USER_VOCAB = 2112 + 16
"""The user's model has 16 more embedding rows than the tiny target (2112), to tell the two apart."""


def user_model(directory: Path, tiny_target_dir: Path, num_layers: int = 8) -> Path:
    """An 8-layer Qwen3 saved with save_pretrained (with the tiny target's tokenizer): the user's model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=USER_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_target_dir / name, directory / name)
    return directory


def snapshot(directory: Path) -> dict[str, str]:
    """name -> sha256 of every file below ``directory`` (what must not change)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def chat_jsonl(path: Path, n: int = 24) -> Path:
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


@pytest.mark.parametrize("extra", [[], ["target.name=mine"]], ids=["tiny_defaults", "target_name_mine"])
def test_prepare_never_writes_the_users_model_dir(tmp_path, tiny_target_dir, extra):
    model = user_model(tmp_path / "models" / "mymodel", tiny_target_dir)
    before = snapshot(model)
    data = chat_jsonl(tmp_path / "chat.jsonl")
    cmd = [
        sys.executable,
        "-m",
        "dflash.data.prepare",
        *FAST,
        "data.num_eval_prompts=2",
        f"target.path={model}",
        f"data.path={data}",
        f"hydra.run.dir={tmp_path / 'prep'}",
        *extra,
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env_for(tmp_path / "cache"), capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert snapshot(model) == before  # byte-identical, and no file added (no dflash_tiny_done.json)
    log = (tmp_path / "prep" / "prepare.log").read_text()
    assert "tiny target built at" not in log
    assert "ignoring target.tiny" in log and str(model) in log
    (meta,) = (tmp_path / "cache" / "data").glob("*/meta.json")  # tokenized for the user's model,
    assert json.loads(meta.read_text())["settings"]["vocab_size"] == USER_VOCAB  # not the tiny target
    assert not (tmp_path / "cache" / "tiny_targets").exists()
    # prepare says that the held-out eval records come out of the user's data
    assert "held out: the last 2 records of data.path are never trained on" in proc.stdout


def test_the_tiny_target_is_built_only_where_the_project_owns_the_directory(tmp_path, tiny_target_dir):
    spec = TinyTargetConfig()
    target = TargetConfig(name="tiny", path="unused", tiny=spec)
    cache = tmp_path / "cache"
    model = user_model(tmp_path / "mymodel", tiny_target_dir, num_layers=2)
    before = snapshot(model)
    # the user's directory, a hub id and a missing directory outside the cache: returned as given, never built
    assert tiny_target_path(target, str(model), cache) == str(model)
    assert tiny_target_path(target, "Qwen/Qwen3-8B", cache) == "Qwen/Qwen3-8B"
    missing = tmp_path / "typo" / "mymodle"
    assert tiny_target_path(target, str(missing), cache) == str(missing)
    assert not missing.exists() and not (Path.cwd() / "Qwen").exists() and not cache.exists()
    # called directly, the builder refuses to write over files it did not write
    assert ensure_tiny_target(model, spec) == model
    assert snapshot(model) == before
    # the project's own cache (a copy of an earlier build: its marker proves it) is reused
    shutil.copytree(tiny_target_dir, cache / "tiny_target_v1")
    assert tiny_target_path(target, str(cache / "tiny_target_v1"), cache) == str(cache / "tiny_target_v1")
    assert tiny_target_path(TargetConfig(name="x", path="p"), str(model), cache) == str(model)


def test_remote_code_with_a_revision_pin_is_refused_for_a_local_directory(tmp_path, tiny_target_dir):
    model = user_model(tmp_path / "mymodel", tiny_target_dir, num_layers=2)
    pinned = TargetConfig(name="t", path=str(model), trust_remote_code=True, revision="a" * 40)
    with pytest.raises(ValueError) as err:
        check_remote_code_source(pinned, str(model))
    msg = str(err.value)
    assert "target.revision" in msg and "local directory" in msg and "target.trust_remote_code=false" in msg
    # a hub id is what the pin is for; without remote code a local directory is fine
    check_remote_code_source(pinned, "org/model")
    check_remote_code_source(TargetConfig(name="t", path=str(model), revision="a" * 40), str(model))
