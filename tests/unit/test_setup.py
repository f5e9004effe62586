"""Checks that need the target's config.json and tokenizer: all before any weight is read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from testpaths import REPO
from transformers import AutoTokenizer

from dflash.config import register_configs, to_config
from dflash.setup import prepare, resolve_mask_token_id


@pytest.fixture(scope="module")
def weightless_target(tiny_target_dir, tmp_path_factory) -> Path:
    """The tiny target's config.json and tokenizer WITHOUT model.safetensors: any weight load fails."""
    d = tmp_path_factory.mktemp("weightless")
    for f in tiny_target_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
    return d


def _cfg(target: Path, overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = to_config(
            compose(
                config_name="config",
                overrides=[
                    f"target.path={target}",
                    "target.tiny=null",
                    "data.path=/nonexistent.jsonl",
                    *overrides,
                ],
            )
        )
    return cfg


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["target.layer_ids=[1,2,9]"],
            "target.layer_ids=[1, 2, 9]: layers [9] outside the target's 6 decoder layers",
        ),
        (["drafter.hidden_size=256"], "drafter.hidden_size=256 differs from the target's hidden_size=128"),
        (
            ["drafter.mask_token_id=5000"],
            "mask token id 5000 from drafter.mask_token_id is outside the target vocabulary [0, 2112)",
        ),
        (["drafter.mask_token_id=2"], "is the tokenizer's eos_token_id"),
        (["drafter.num_heads=3"], "drafter.num_heads=3 is not a multiple of drafter.num_kv_heads=2"),
    ],
)
def test_target_dependent_errors_before_any_weight_loads(weightless_target, overrides, needle):
    with pytest.raises(ValueError) as err:
        prepare(_cfg(weightless_target, overrides), 3)
    assert needle in str(err.value)


def test_several_problems_reported_together(weightless_target):
    with pytest.raises(ValueError, match="2 config problem") as err:
        prepare(_cfg(weightless_target, ["target.layer_ids=[7]", "drafter.hidden_size=64"]), 3)
    assert "target.layer_ids" in str(err.value) and "drafter.hidden_size" in str(err.value)


def test_mask_token_resolution_order(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    n = len(tok)
    assert resolve_mask_token_id(None, None, tok, n + 64) == n  # first row past the tokenizer
    assert resolve_mask_token_id(None, n + 5, tok, n + 64) == n + 5  # the drafter checkpoint
    assert resolve_mask_token_id(n + 7, n + 5, tok, n + 64) == n + 7  # the config wins
    with pytest.raises(ValueError, match="no unused row"):
        resolve_mask_token_id(None, None, tok, n)  # nothing left but pad/eos: refuse
    with pytest.raises(ValueError, match="pad_token_id"):
        resolve_mask_token_id(tok.pad_token_id, None, tok, n + 64)
