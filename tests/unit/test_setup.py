"""Checks that need the target's config.json and tokenizer: all before any weight is read."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from dflash.cli import compose_config
from dflash.config import register_configs, to_config
from dflash.drafter.arch import build_arch, resolve_mask_token_id
from dflash.drafter.export import export_config, warm_start_problems
from dflash.targets.loader import read_target_meta
from dflash.train.setup import prepare

MIXED = ["sliding_attention", "full_attention"]


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
    return to_config(
        compose_config(
            "config",
            [f"target.path={target}", "target.tiny=null", "data.path=/nonexistent.jsonl", *overrides],
        )
    )


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
        (
            ["drafter.partial_rotary_factor=0.3"],
            "drafter.partial_rotary_factor=0.3 rotates 9 of the drafter's",
        ),
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


def test_drafter_layout_comes_from_the_config_then_init_from_then_the_defaults(weightless_target):
    meta = read_target_meta(str(weightless_target))
    plain = build_arch(_cfg(weightless_target, []), meta, [1, 2, 4], 7)
    assert plain.layer_types == ["full_attention"] * 2 and plain.sliding_window is None
    assert plain.partial_rotary_factor == 1.0  # the tiny Qwen3 target rotates whole heads
    saved = replace(plain, layer_types=MIXED, sliding_window=64, partial_rotary_factor=0.5)
    carried = build_arch(_cfg(weightless_target, []), meta, [1, 2, 4], 7, saved)
    assert (carried.layer_types, carried.sliding_window, carried.partial_rotary_factor) == (MIXED, 64, 0.5)
    assert warm_start_problems(saved, carried) == []
    own = build_arch(
        _cfg(weightless_target, ["drafter.layer_types=[full_attention,full_attention]"]),
        meta,
        [1, 2, 4],
        7,
        saved,
    )
    assert own.sliding_window is None and "layer_types of the saved drafter" in "\n".join(
        warm_start_problems(saved, own)
    )
    widened = build_arch(_cfg(weightless_target, ["drafter.sliding_window=128"]), meta, [1, 2, 4], 7, saved)
    assert widened.layer_types == MIXED and widened.sliding_window == 128


def test_qwen3_6_27b_experiment_builds_the_published_drafter(tmp_path):
    """experiment=qwen3_6_27b_7x1 against a config-only Qwen3.6-27B-shaped target (a Qwen3.5 VLM config:
    64 hybrid layers, M-RoPE over a quarter of each head, theta 1e7) exports the layout of the published
    z-lab/Qwen3.6-27B-DFlash (as in SpecForge configs/qwen3.6-27b-dflash.json)."""
    from transformers import Qwen3_5Config

    text = dict(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
    )
    Qwen3_5Config(text_config=text, vision_config={"depth": 1}).save_pretrained(tmp_path)
    register_configs()
    cfg = to_config(compose_config("config", ["experiment=qwen3_6_27b_7x1", "data.path=/d"]))
    meta = read_target_meta(str(tmp_path))
    arch = build_arch(cfg, meta, list(cfg.target.layer_ids), cfg.drafter.mask_token_id)
    exported = export_config(arch, meta.num_layers, torch.bfloat16)
    published = {
        "num_hidden_layers": 5,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "sliding_window": 2048,
        "use_sliding_window": True,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "num_target_layers": 64,
        "block_size": 16,
        "rope_theta": 10_000_000,
        "rope_scaling": None,
    }
    assert {k: exported[k] for k in published} == published
    assert exported["dflash_config"]["target_layer_ids"] == [1, 16, 31, 46, 61]
    assert exported["dflash_config"]["mask_token_id"] == 248070
    assert "partial_rotary_factor" not in exported and "is_causal" not in exported
    assert exported["rope_parameters"] == {"rope_type": "default", "rope_theta": 10_000_000}


def test_an_init_from_export_whose_tensors_do_not_fit_is_refused_before_anything_starts(
    weightless_target, tmp_path
):
    """Issue 19 item 12: a drafter shape mismatch in drafter.init_from failed after the process group
    (in load_into); now resolve_drafter reads the export's safetensors header and names the tensors."""
    from safetensors.torch import load_file, save_file

    from dflash.drafter.export import export_drafter
    from dflash.drafter.model import DFlashDraftModel
    from dflash.drafter.resolve import resolve_drafter
    from dflash.targets.info import resolve_target

    cfg = _cfg(weightless_target, [])
    target = resolve_target(cfg.target)
    _, arch = resolve_drafter(cfg, target)
    out = export_drafter(
        DFlashDraftModel(arch), tmp_path / "export", target_num_layers=target.meta.num_layers
    )
    tensors = load_file(str(out / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :-8].contiguous()
    del tensors["norm.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        resolve_drafter(_cfg(weightless_target, [f"drafter.init_from={out}"]), target)
    text = str(err.value)
    assert "model.safetensors lacks norm.weight" in text and "has fc.weight of shape" in text


def test_a_hostile_target_config_is_refused_on_every_rank_before_anything_is_allocated(
    weightless_target, tmp_path
):
    """Issue 19 item 9: intermediate_size 10^9 in the target's config.json requested 512 GB on every
    rank; prepare (every rank, before the process group) refuses it naming the field and the GiB."""
    import json

    hostile = tmp_path / "hostile"
    shutil.copytree(weightless_target, hostile)
    config = json.loads((hostile / "config.json").read_text())
    config["intermediate_size"] = 10**9
    (hostile / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        prepare(_cfg(hostile, []), 3)
    text = str(err.value)
    assert "intermediate_size=1000000000" in text and "GiB of target weights" in text
    assert "GiB of drafter weights" in text and "nothing was allocated" in text


def _warm_start_from(tmp_path: Path, target: Path, edit: dict) -> Path:
    """An export of a drafter for ``target`` (a tiny one, taps [1, 2, 4], MASK 2048) whose
    ``dflash_config`` ``edit`` changed."""
    import json

    from suite_fixtures import export_tiny_drafter

    d = export_tiny_drafter(target, tmp_path / "drafter")
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"].update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _resolve(target: Path, overrides: list[str]):
    from dflash.drafter.resolve import resolve_drafter
    from dflash.targets.info import resolve_target

    cfg = _cfg(
        target, ["drafter.num_layers=1", "drafter.intermediate_size=256", "drafter.block_size=4", *overrides]
    )
    return resolve_drafter(cfg, resolve_target(cfg.target))


def test_a_warm_start_from_an_export_with_eos_as_mask_is_one_consistent_message(weightless_target, tmp_path):
    """Before: "is the tokenizer's eos_token_id" and "set drafter.mask_token_id to the saved id", both."""
    d = _warm_start_from(tmp_path, weightless_target, {"mask_token_id": 2})
    with pytest.raises(ValueError) as err:
        _resolve(weightless_target, [f"drafter.init_from={d}"])
    msg = str(err.value)
    assert "\n" not in msg and "dflash_config.mask_token_id=2 is the tokenizer's eos_token_id" in msg
    assert "set drafter.mask_token_id=2048 to warm-start with a new MASK" in msg and "saved" not in msg
    # the fix it names passes: the warm start then learns the new MASK
    _, arch = _resolve(weightless_target, [f"drafter.init_from={d}", "drafter.mask_token_id=2048"])
    assert arch.mask_token_id == 2048
    text = _warm_start_from(tmp_path / "text", weightless_target, {"mask_token_id": 5})
    with pytest.raises(ValueError, match="mask_token_id=5 is the text token '#'"):
        _resolve(weightless_target, [f"drafter.init_from={text}"])


def test_a_warm_start_refuses_unsorted_taps_and_a_second_block_size(weightless_target, tmp_path):
    unsorted = _warm_start_from(tmp_path / "u", weightless_target, {"target_layer_ids": [4, 1, 2]})
    with pytest.raises(
        ValueError, match=r"dflash_config.target_layer_ids=\[4, 1, 2\]: not in increasing order"
    ):
        _resolve(weightless_target, [f"drafter.init_from={unsorted}"])
    block = _warm_start_from(tmp_path / "b", weightless_target, {"block_size": 16})
    with pytest.raises(
        ValueError, match=r"block_size=4 \(top level\) and dflash_config.block_size=16 differ"
    ):
        _resolve(weightless_target, [f"drafter.init_from={block}"])
    anchor = _warm_start_from(tmp_path / "a", weightless_target, {"sample_from_anchor": True})
    with pytest.raises(ValueError, match=r"dflash_config.sample_from_anchor=true: the export says"):
        _resolve(weightless_target, [f"drafter.init_from={anchor}"])


def test_warm_start_hints_name_only_ids_that_pass(weightless_target, tmp_path):
    """The saved taps are suggested when they are layers of this target, never otherwise."""
    d = _warm_start_from(tmp_path, weightless_target, {})
    with pytest.raises(ValueError, match=r"set target.layer_ids=\[1, 2, 4\]") as err:
        _resolve(weightless_target, [f"drafter.init_from={d}", "target.layer_ids=[1,2,3]"])
    assert "mask" not in str(err.value)
    _, arch = _resolve(weightless_target, [f"drafter.init_from={d}", "target.layer_ids=[1,2,4]"])
    assert arch.target_layer_ids == [1, 2, 4]
    saved = replace(arch, target_layer_ids=[1, 2, 9])
    (problem,) = warm_start_problems(saved, arch, 6)
    assert "not layers of this 6-layer target" in problem and "[1, 2, 9]" not in problem.split(";")[1]
