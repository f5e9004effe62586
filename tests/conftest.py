"""Shared fixtures: offline environment and the tiny targets, put in place once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # `make test`: the cores shared among the workers
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    )

SHARED_GROUP = "tests/faults"
"""The tests that share session fixtures (the reference runs, the background hung run): one worker."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest work first, so that under pytest-xdist no worker is left with a long tail: the fault
    scenarios (one work unit), then the slow tests that need no session cache, then the other slow
    tests, then the rest; in file order within each."""

    def rank(item: pytest.Item) -> int:
        if item.nodeid.startswith(SHARED_GROUP + "/"):
            return 0
        if item.get_closest_marker("slow") is None:
            return 3
        return 2 if "session_cache" in getattr(item, "fixturenames", ()) else 1

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (`make test`); plain pytest runs without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Work units for pytest-xdist: a test module each (its module fixtures are built once), all of
    ``tests/faults`` one unit; handed out in collection order (longest first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesInOrder(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SHARED_GROUP if nodeid.startswith(SHARED_GROUP + "/") else super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return ModulesInOrder(config, log)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny forwards on shared cores: one intra-op thread, so threads never spin against each other."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's DFLASH_CACHE_DIR: the tiny target is put here once (the shipped build), and every
    fixture and torchrun job of the session finds it. ``DFLASH_TEST_CACHE_DIR`` names a directory
    to reuse across sessions instead (every artefact in it is keyed on what it was built from)."""
    reuse = os.environ.get("DFLASH_TEST_CACHE_DIR")
    if reuse:
        Path(reuse).mkdir(parents=True, exist_ok=True)
        return Path(reuse)
    if "PYTEST_XDIST_WORKER" in os.environ:  # one cache for all workers (its builds are file-locked)
        shared = tmp_path_factory.getbasetemp().parent / "dflash_cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("dflash_cache")


HYBRID = dict(
    model_type="qwen3_5_text",
    num_layers=6,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    train_steps=0,  # random weights: the hybrid tests check lossless decoding and replay, not learning
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
def tiny_target_dir(session_cache: Path) -> Path:
    """The default tiny target + tokenizer (conf/target/tiny.yaml): the shipped build
    (dflash/targets/prebuilt), copied once for the session where the training config looks for it
    (``${paths.cache_dir}/tiny_targets/qwen3-<spec hash>``)."""
    from dflash.config import TinyTargetConfig
    from dflash.targets.tiny import ensure_tiny_target

    spec = TinyTargetConfig()
    return ensure_tiny_target(session_cache / spec.cache_subdir(), spec)


@pytest.fixture(scope="session")
def tiny_moe_target_dir(session_cache: Path) -> Path:
    """The tiny Qwen3-MoE target of conf/target/tiny_moe.yaml (8 experts, 2 per token, random
    weights) + tokenizer, built once where that config looks for it."""
    from omegaconf import OmegaConf
    from testpaths import REPO

    from dflash.config import TinyTargetConfig
    from dflash.targets.tiny import ensure_tiny_target

    spec = TinyTargetConfig(**OmegaConf.to_container(OmegaConf.load(REPO / "conf/target/tiny_moe.yaml").tiny))
    return ensure_tiny_target(session_cache / spec.cache_subdir(), spec)


@pytest.fixture(scope="session")
def run_cache(session_cache: Path, tiny_target_dir: Path) -> Path:
    """A DFLASH_CACHE_DIR holding what the fast torchrun jobs of tests/runner.py need, built once
    in-process (tiny target, regenerated corpus, tokenized data) so the ranks only load it."""
    from runner import prepare_fast

    setup = prepare_fast(session_cache)
    assert Path(setup.target_path) == tiny_target_dir, (
        "conf/target/tiny.yaml differs from TinyTargetConfig(): prepare built a second tiny target"
    )
    return session_cache
