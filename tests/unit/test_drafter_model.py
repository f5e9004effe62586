"""The draft model: flex == dense SDPA, training forward == cached inference forward, export layout."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from tiny_drafter import BS, MASK_ID, SLIDING, masks_for, tiny_arch, tiny_batch

from dflash.drafter.blocks import make_blocks
from dflash.drafter.export import export_drafter, load_exported, load_into, warm_start_problems
from dflash.drafter.model import DFlashDraftModel

LAYOUTS = [({}, 1.0), ({}, 0.5), (SLIDING, 1.0), (dict(SLIDING, layer_types=["sliding_attention"] * 2), 0.5)]
LAYOUT_IDS = ["full", "full-partial", "mixed", "sliding-partial"]


# On CPU flex_attention runs unfused (it says so); the test checks its mask semantics, not its speed.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("layout,partial", LAYOUTS, ids=LAYOUT_IDS)
def test_flex_block_mask_equals_dense_sdpa(layout, partial):
    torch.manual_seed(0)
    model = DFlashDraftModel(tiny_arch(partial_rotary_factor=partial, **layout)).double()
    pos, doc, anchors, ids, aux, emb = tiny_batch()
    blocks = make_blocks(ids, pos, doc, anchors, BS, MASK_ID)
    noise = emb[blocks.block_ids]
    with torch.no_grad():  # flex_attention has no CPU backward in torch 2.13
        dense = model(noise, aux, pos, blocks.block_positions, masks_for(model, anchors, doc, "sdpa"))
        flex = model(noise, aux, pos, blocks.block_positions, masks_for(model, anchors, doc, "flex"))
    assert torch.allclose(dense, flex, atol=1e-10, rtol=0)


@pytest.mark.parametrize("layout", [{}, SLIDING], ids=["full", "mixed"])
def test_training_forward_of_a_block_equals_cached_inference_forward(layout):
    """Train/serve parity: one block in the masked training pass == the decoding pass with a KV cache
    holding exactly the context before the anchor (fed in two chunks, as accepted tokens arrive). With
    a sliding layer whose window is shorter than the context, the decoding mask and the trimmed cache
    (last W-1 rows) must cut the same keys as the training mask."""
    torch.manual_seed(1)
    model = DFlashDraftModel(tiny_arch(**layout)).float()
    pos, doc, anchors, ids, aux, emb = tiny_batch(1)
    aux, emb = aux.float(), emb.float()
    blocks = make_blocks(ids, pos, doc, anchors, BS, MASK_ID)
    noise = emb[blocks.block_ids]
    train = model(noise, aux, pos, blocks.block_positions, masks_for(model, anchors, doc))
    checked = windowed = 0
    for n, a in enumerate(anchors[0].tolist()):
        if a < 0:
            continue
        start = int((doc[0] == doc[0, a]).nonzero()[0])
        cache = model.new_cache()
        mid = (start + a) // 2
        with torch.no_grad():
            model(
                noise[:, :0], aux[:, start:mid], pos[:, start:mid], blocks.block_positions[:, :0], None, cache
            )
            sl = slice(n * BS, (n + 1) * BS)
            infer = model(
                noise[:, sl], aux[:, mid:a], pos[:, mid:a], blocks.block_positions[:, sl], None, cache
            )
        assert cache.length == a - start
        for i, w in enumerate(model.arch.layer_types):
            kept = cache.keys[i].shape[2]
            assert kept == (
                a - start if w == "full_attention" else min(a - start, SLIDING["sliding_window"] - 1)
            )
        windowed += a - start >= SLIDING["sliding_window"]
        for k in range(BS):
            torch.testing.assert_close(infer[0, k], train[0, n * BS + k].detach(), atol=1e-5, rtol=1e-5)
        checked += 1
    assert checked >= 4 and windowed >= 2  # the window cut the context of some blocks


def test_export_layout_and_bit_exact_round_trip(tmp_path):
    torch.manual_seed(2)
    model = DFlashDraftModel(tiny_arch())
    out = export_drafter(model, tmp_path / "drafter", target_num_layers=8)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == BS and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"] == {
        "target_layer_ids": [1, 3, 5],
        "mask_token_id": 119,
        "block_size": BS,
        "causal": False,
    }
    assert cfg["is_causal"] is False and cfg["layer_types"] == ["full_attention"] * 2
    assert cfg["is_neox_style"] is True and cfg["sample_from_anchor"] is False  # the serving contract
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] is None
    assert cfg["model_type"] == "qwen3" and cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        expected |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        expected |= {f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")}
    assert names == expected
    arch, state = load_exported(out)
    assert arch == model.arch
    fresh = DFlashDraftModel(arch)
    load_into(fresh, state)
    for (k, a), (k2, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)


YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4096}


@pytest.mark.parametrize(
    "layout,causal",
    [(SLIDING, None), (dict(SLIDING, layer_types=["sliding_attention"] * 2), True)],
    ids=["mixed", "all-sliding"],
)
def test_sliding_export_states_layout_causality_and_rope_and_round_trips(tmp_path, layout, causal):
    from transformers import Qwen3Config

    model = DFlashDraftModel(tiny_arch(partial_rotary_factor=0.5, rope_parameters=YARN, **layout))
    out = export_drafter(model, tmp_path / "drafter", target_num_layers=8)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == layout["layer_types"]
    assert cfg["sliding_window"] == 5 and cfg["use_sliding_window"] is True
    # one causality for every layer: stated for vLLM; a mixed layout would be mis-read by any single value
    assert cfg.get("is_causal") is causal and cfg["dflash_config"].get("causal") is causal
    assert cfg["partial_rotary_factor"] == 0.5 and cfg["rope_parameters"] == {
        **YARN,
        "partial_rotary_factor": 0.5,
    }
    assert cfg["rope_theta"] == 1e6 and cfg["rope_scaling"]["rope_type"] == "yarn"
    hf = Qwen3Config.from_dict(cfg)  # what transformers (and the z-lab reference) read from it
    assert hf.layer_types == layout["layer_types"] and hf.sliding_window == 5
    assert hf.rope_parameters["factor"] == 4.0 and hf.rope_parameters["partial_rotary_factor"] == 0.5
    arch, state = load_exported(out)
    assert arch == model.arch
    load_into(DFlashDraftModel(arch), state)


def _exported_config(**changes) -> dict:
    from dflash.drafter.export import export_config

    cfg = export_config(tiny_arch(**SLIDING), 8, torch.float32)
    for key, value in changes.items():
        if key.startswith("dflash_config."):
            cfg["dflash_config"][key.split(".", 1)[1]] = value
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"is_causal": False}, "is_causal=False makes layers [0]"),
        ({"is_causal": True}, "is_causal=True makes layers [1]"),
        ({"dflash_config.causal": True}, "dflash_config.causal=True makes layers [1]"),
        ({"use_sliding_window": False}, "use_sliding_window=False"),
        ({"dflash_config.use_swa": True}, "dflash_config.use_swa"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ],
)
def test_import_refuses_a_config_that_servers_would_read_differently(changes, needle):
    from dflash.drafter.export import arch_from_export

    assert arch_from_export(_exported_config()).layer_types == SLIDING["layer_types"]
    with pytest.raises(ValueError, match=re.escape(needle)):
        arch_from_export(_exported_config(**changes))


def test_warm_start_refuses_a_different_contract():
    assert warm_start_problems(tiny_arch(), tiny_arch()) == []
    problems = warm_start_problems(
        tiny_arch(), tiny_arch(hidden_size=32, target_layer_ids=[1, 2, 3], mask_token_id=5)
    )
    text = "\n".join(problems)
    assert "hidden_size" in text and "target_layer_ids" in text and "mask_token_id" in text
    text = "\n".join(warm_start_problems(tiny_arch(**SLIDING), tiny_arch(partial_rotary_factor=0.5)))
    for field in ("layer_types", "sliding_window", "partial_rotary_factor"):
        assert f"{field} of the saved drafter" in text and f"drafter.{field}=null" in text
