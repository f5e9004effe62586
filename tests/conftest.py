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

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny target + tokenizer (conf/target/tiny.yaml), built once for the session."""
    from dflash.config import TinyTargetConfig
    from dflash.target.tiny import ensure_tiny_target

    return ensure_tiny_target(tmp_path_factory.mktemp("tiny") / "target", TinyTargetConfig())
