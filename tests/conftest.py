"""Shared fixtures: offline environment and a tiny target built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from testpaths import REPO


@pytest.fixture(scope="module")
def one_thread():
    """Tiny forwards on 2 shared cores: intra-op threads only spin against each other (6x slower)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny target + tokenizer (conf/target/tiny.yaml), built once for the session."""
    from dflash.config import TinyTargetConfig
    from dflash.targets.tiny import ensure_tiny_target

    return ensure_tiny_target(tmp_path_factory.mktemp("tiny") / "target", TinyTargetConfig())


HYBRID = dict(
    model_type="qwen3_5_text",
    num_layers=6,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


@pytest.fixture(scope="session")
def tiny_hybrid_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3.5 text target (linear attention in layers 0-2 and 4-5, full attention in
    layer 3; RoPE over a quarter of each head), built like the default tiny target."""
    from dflash.config import TinyTargetConfig
    from dflash.targets.tiny import ensure_tiny_target

    spec = TinyTargetConfig(**HYBRID)
    return ensure_tiny_target(tmp_path_factory.mktemp("tiny_hybrid") / "target", spec)


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DFLASH_CACHE_DIR holding what the fast torchrun jobs of tests/runner.py need, built once
    in-process (tiny target, regenerated corpus, tokenized data) so the ranks only load it."""
    from hydra import compose, initialize_config_dir
    from runner import FAST

    from dflash.config import register_configs, to_config
    from dflash.setup import prepare

    cache = tmp_path_factory.mktemp("dflash_cache")
    old = os.environ.get("DFLASH_CACHE_DIR")
    os.environ["DFLASH_CACHE_DIR"] = str(cache)
    try:
        register_configs()
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            prepare(to_config(compose(config_name="config", overrides=FAST)), 3)
    finally:
        if old is None:
            os.environ.pop("DFLASH_CACHE_DIR")
        else:
            os.environ["DFLASH_CACHE_DIR"] = old
    return cache
