"""Fine-tuning from a drafter in the published layout (issue 42, item 4): the reference run's export
rewritten as z-lab's released ``*-DFlash-b16`` configs are (no serving-contract fields, no
``dflash_config.block_size`` or ``causal``, ``auto_map`` for their remote code) is a
``drafter.init_from`` checkpoint: the run checks it against the target, loads it and trains from it,
and its first loss is below a fresh drafter's on the same packet (the reference run's step 1: same
seed, same data plan, same noise)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from faultkit import STEPS, losses
from runner import launch

pytestmark = pytest.mark.faults

OURS_ONLY = ("is_causal", "is_neox_style", "sample_from_anchor", "rope_scaling")
"""Top-level keys our exporter writes that the published DFlash-1 configs do not."""


def published_layout(export: Path, out: Path) -> Path:
    """A copy of ``export`` with the config of a published DFlash-1 drafter."""
    shutil.copytree(export, out)
    cfg = json.loads((out / "config.json").read_text())
    for key in OURS_ONLY:
        cfg.pop(key, None)
    for key in ("causal", "block_size"):
        cfg["dflash_config"].pop(key, None)
    cfg["auto_map"] = {"AutoModel": "dflash.model.DFlashDraftModel"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def test_fine_tuning_from_a_published_layout_starts_below_a_fresh_drafter(tmp_path, run_cache, reference):
    checkpoint = published_layout(reference.dir / "drafter", tmp_path / "published")
    steps = [s for s in STEPS if not s.startswith(("train.max_steps=", "train.save_every="))]
    run = launch(
        tmp_path / "run", [*steps, "train.max_steps=3", f"drafter.init_from={checkpoint}"], run_cache
    )
    assert run.returncode == 0, run.output[-4000:]
    assert f"warm start from {checkpoint}" in run.output
    warm, fresh = losses(run.dir), losses(reference.dir)
    assert sorted(warm) == [1, 2, 3]
    assert warm[1] < 0.9 * fresh[1], (warm[1], fresh[1])  # trained for 12 steps on this data: far below
    assert (run.dir / "drafter" / "config.json").is_file()  # and it exports, in our layout again
    again = json.loads((run.dir / "drafter" / "config.json").read_text())
    assert again["is_neox_style"] is True and again["dflash_config"]["block_size"] == again["block_size"]
