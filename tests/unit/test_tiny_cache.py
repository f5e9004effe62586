"""The tiny target is cached per spec (issue 32, item 10): conf/target/tiny.yaml names one directory
per spec under ``paths.cache_dir/tiny_targets``, so switching between the dense and the hybrid tiny
target never rebuilds the other; a build that trains shows a progress bar on the console."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.cli import compose_config
from dflash.config import Config, TinyTargetConfig, register_configs, to_config
from dflash.config.resolve import resolve_path
from dflash.targets.tiny import tiny_target_path

SMALL = {
    "num_layers": 4,  # the hybrid: full attention every 4th layer
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 16,
    "train_steps": 3,
}
"""A spec that trains (3 steps) in a second or two."""


def _config(cache: Path, *overrides: str) -> Config:
    register_configs()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_CACHE_DIR", str(cache))
        return to_config(
            compose_config("config", [*(f"target.tiny.{k}={v}" for k, v in SMALL.items()), *overrides])
        )


def _build(cfg: Config) -> Path:
    """What every app does with target.tiny: build (or reuse) the target where target.path says."""
    t = cfg.target
    return Path(tiny_target_path(t, resolve_path(t.path), resolve_path(cfg.paths.cache_dir)))


def _stamp(d: Path) -> tuple[int, int]:
    marker = (d / "dflash_tiny_done.json").stat()
    return marker.st_ino, marker.st_mtime_ns


def test_two_specs_two_directories_and_switching_never_rebuilds(tmp_path, capfd):
    cache = tmp_path / "cache"
    dense = _config(cache)
    hybrid = _config(cache, "target.tiny.model_type=qwen3_5_text")
    assert _config(cache, "target.tiny.init_std=2e-2").target.path == dense.target.path  # the same spec
    d, h = Path(dense.target.path), Path(hybrid.target.path)
    assert d != h and d.parent == h.parent == cache / "tiny_targets"
    assert d.name.startswith("qwen3-") and h.name.startswith("qwen3_5_text-")
    assert d == cache / TinyTargetConfig(**SMALL).cache_subdir()

    assert _build(dense) == d
    out = capfd.readouterr().out
    assert "tiny target qwen3: training (once per spec)" in out and "3/3" in out  # the console line
    assert _build(hybrid) == h
    assert "tiny target qwen3_5_text: training (once per spec)" in capfd.readouterr().out
    before = {d: _stamp(d), h: _stamp(h)}
    for cfg in (dense, hybrid, dense, hybrid):  # switching back and forth reuses both builds
        _build(cfg)
    assert {d: _stamp(d), h: _stamp(h)} == before
    assert "training" not in capfd.readouterr().out
    assert sorted(p.name for p in (cache / "tiny_targets").iterdir() if not p.name.startswith(".")) == sorted(
        [d.name, h.name]
    )


def test_the_default_spec_keeps_its_shipped_build_directory_name():
    """The default spec's directory is a function of its key alone (the shipped build's marker
    records the same key), stable across launches and processes."""
    spec = TinyTargetConfig()
    assert spec.cache_subdir() == TinyTargetConfig(**spec.key()).cache_subdir()
    assert (
        spec.cache_subdir().startswith("tiny_targets/qwen3-")
        and len(spec.cache_subdir()) == len("tiny_targets/qwen3-") + 12
    )


def test_the_build_log_says_whether_the_target_was_trained(tmp_path, caplog):
    """``target.tiny.train_steps=0`` builds random weights: the log says so, not "trained in 3 s"."""
    import logging

    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="dflash.targets.tiny"):
        _build(_config(cache, "target.tiny.train_steps=0"))
        _build(_config(cache))
    lines = [r.getMessage() for r in caplog.records if "tiny target at" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "built untrained (target.tiny.train_steps=0: random weights) in" in lines[0]
    assert "built and trained (3 steps) in" in lines[1]
