"""Prepare and plan from a tokenizer and a config.json (issue 32, item 11): no ``*.safetensors`` on
the machine, a hub id whose cached snapshot holds only those files; the plan then reads the
prepared dataset's length distribution, and training with the weights finds the same cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from runner import REPO
from transformers import AutoTokenizer

from dflash.config import DataConfig
from dflash.data.cache import build_or_load_dataset
from dflash.sizing.costs import PacketShape, target_keys_per_query
from dflash.sizing.packets import DataStats, packed_lengths, plan_packets
from dflash.targets.loader import read_target_meta

HUB_ID = "acme/chat-7b"
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def hub_snapshot(cache: Path, source: Path) -> Path:
    """An HF hub cache holding ``HUB_ID`` as ``huggingface-cli download <id> config.json tokenizer*``
    leaves it: a snapshot of those files only, ``refs/main`` naming it."""
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snap.name)
    return snap


def chat(path: Path) -> Path:
    """60 conversations of a long-tailed length (short questions, a few long answers)."""
    rows = []
    for i in range(60):
        answer = "\n".join(f"    x{k} = x{k - 1} + {i}" for k in range(1, 2 + (i % 6) ** 3 // 2))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Continue this code:\ndef f{i}(x0):"},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prepare_and_plan_from_a_tokenizer_and_config_only(tmp_path, tiny_target_dir):
    hub = tmp_path / "hub"
    snap = hub_snapshot(hub, tiny_target_dir)
    assert not list(snap.glob("*.safetensors")) and not list(hub.rglob("*.safetensors"))
    data = chat(tmp_path / "chat.jsonl")
    common = [
        f"target.path={HUB_ID}",
        "target.tiny=null",
        "data=chat_jsonl",
        f"data.path={data}",
        "data.num_eval_prompts=0",
        "eval.every=0",
        "data.max_length=512",
        "data.token_budget=4096",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub),
        "DFLASH_CACHE_DIR": str(tmp_path / "cache"),
    }

    def app(module: str, *args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", module, *common, *args]
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    prep = app("dflash.data.prepare", f"hydra.run.dir={tmp_path / 'prep'}")
    assert prep.returncode == 0, prep.stdout[-2000:] + prep.stderr[-3000:]
    (meta,) = (tmp_path / "cache" / "data").glob("*/meta.json")
    assert (
        "60 samples" in (tmp_path / "prep" / "prepare.log").read_text() or "samples        60" in prep.stdout
    )
    plan = app("dflash.plan", "plan.world_size=2", "plan.gpu=h100")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert f"[{snap}/config.json]" in plan.stdout  # the target's shape from the snapshot's config.json
    assert f"[dataset cache {meta.parent}]" in plan.stdout  # the data statistics from the prepared cache
    # the packet the plan prices is drawn from the prepared lengths
    stats = DataStats(1.0, 0.5, "cache", lengths=tuple(_lengths(meta.parent)))
    want = packed_lengths(stats.lengths, 4096, 512)
    assert f"most target work (a packed row): {len(want)} samples, {sum(want)} tokens" in plan.stdout
    # training, with the weights wherever they are, tokenizes the same way: it finds this cache
    cfg = DataConfig(
        path=str(data), cache_dir=str(tmp_path / "cache" / "data"), max_length=512, num_eval_prompts=0
    )
    full = AutoTokenizer.from_pretrained(tiny_target_dir)
    ds = build_or_load_dataset(cfg, full, read_target_meta(str(tiny_target_dir)).vocab_size)
    assert ds.loaded_from_cache and meta.parent.name == ds.fingerprint


def _lengths(entry: Path) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(entry / "data.safetensors"), framework="numpy") as f:
        offsets = f.get_tensor("offsets")
    return (offsets[1:] - offsets[:-1]).tolist()


def test_a_packed_packet_follows_the_length_distribution_not_only_its_mean(tmp_path):
    """Half the samples 100 tokens, half 900 (mean 500): the recipe's 512 anchors per sample fit
    only the long ones, and attention grows with sum L^2; the mean alone gave 32 samples of 500
    tokens, each with 349 anchors, and half the attention pairs."""
    from dflash.cli import compose_config
    from dflash.config import register_configs
    from dflash.plan.app import plan_config

    register_configs()
    cfg = plan_config(
        compose_config(
            "plan_app",
            ["experiment=qwen3_8b_8gpu", "data.token_budget=16384", "drafter.max_anchors_per_packet=null"],
        )
    )
    spread = DataStats(500.0, 0.7, "cache", lengths=(100, 900) * 2000)
    mean_only = DataStats(500.0, 0.7, "defaults")
    real, flat = plan_packets(cfg, spread).target, plan_packets(cfg, mean_only).target
    assert sorted(real.doc_lengths) == [100] * 16 + [900] * 16 and flat.doc_lengths is None
    assert real.tokens == flat.tokens == 16000
    assert flat.num_anchors == 32 * min(512, 349) and real.num_anchors == 16 * 69 + 16 * 512
    assert target_keys_per_query(real, "sparse") == (16 * 100 * 101 / 2 + 16 * 900 * 901 / 2) / 16000
    assert target_keys_per_query(flat, "sparse") == 250.5
    equal = PacketShape(tokens=4000, num_seqs=8, num_anchors=8, doc_lengths=(500,) * 8)
    assert target_keys_per_query(equal, "sparse") == 250.5  # equal lengths: as before
