"""The draft model: flex == dense SDPA, training forward == cached inference forward, export layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash.drafter.blocks import build_mask, doc_ids_from_positions, make_blocks, sample_anchors
from dflash.drafter.export import export_drafter, load_exported, load_into, warm_start_problems
from dflash.drafter.model import DFlashDraftModel, DrafterArch, KVCache

BS = 4


def _arch(**kw) -> DrafterArch:
    base = dict(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                vocab_size=120, target_layer_ids=[1, 3, 5], block_size=BS, mask_token_id=119,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    base.update(kw)
    return DrafterArch(**base)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(14), torch.arange(10)]).unsqueeze(0)
    S = pos.shape[1]
    doc = doc_ids_from_positions(pos)
    mask = torch.ones(1, S, dtype=torch.long)
    mask[0, :3] = 0
    anchors = sample_anchors(mask, doc, 4, g)
    ids = torch.randint(0, 118, (1, S), generator=g)
    aux = torch.randn(1, S, 3 * 64, generator=g, dtype=torch.float64)
    emb = torch.randn(120, 64, generator=g, dtype=torch.float64)
    return pos, doc, anchors, ids, aux, emb


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_flex_block_mask_equals_dense_sdpa(partial):
    torch.manual_seed(0)
    model = DFlashDraftModel(_arch(partial_rotary_factor=partial)).double()
    pos, doc, anchors, ids, aux, emb = _batch()
    blocks = make_blocks(ids, pos, doc, anchors, BS, 119)
    noise = emb[blocks.block_ids]
    with torch.no_grad():  # flex_attention has no CPU backward in torch 2.13
        dense = model(noise, aux, pos, blocks.block_positions, build_mask(anchors, doc, BS, "sdpa"))
        flex = model(noise, aux, pos, blocks.block_positions, build_mask(anchors, doc, BS, "flex"))
    assert torch.allclose(dense, flex, atol=1e-10, rtol=0)


def test_training_forward_of_a_block_equals_cached_inference_forward():
    """Train/serve parity: one block in the masked training pass == the decoding pass with a KV cache
    holding exactly the context before the anchor (fed in two chunks, as accepted tokens arrive)."""
    torch.manual_seed(1)
    model = DFlashDraftModel(_arch()).float()
    pos, doc, anchors, ids, aux, emb = _batch(1)
    aux, emb = aux.float(), emb.float()
    blocks = make_blocks(ids, pos, doc, anchors, BS, 119)
    noise = emb[blocks.block_ids]
    train = model(noise, aux, pos, blocks.block_positions, build_mask(anchors, doc, BS, "sdpa"))
    checked = 0
    for n, a in enumerate(anchors[0].tolist()):
        if a < 0:
            continue
        start = int((doc[0] == doc[0, a]).nonzero()[0])
        cache = KVCache(model.arch.num_layers)
        mid = (start + a) // 2
        with torch.no_grad():
            model(noise[:, :0], aux[:, start:mid], pos[:, start:mid], blocks.block_positions[:, :0], None, cache)
            sl = slice(n * BS, (n + 1) * BS)
            infer = model(noise[:, sl], aux[:, mid:a], pos[:, mid:a], blocks.block_positions[:, sl], None, cache)
        assert cache.length == a - start
        for k in range(BS):
            torch.testing.assert_close(infer[0, k], train[0, n * BS + k].detach(), atol=1e-5, rtol=1e-5)
        checked += 1
    assert checked >= 4


def test_export_layout_and_bit_exact_round_trip(tmp_path):
    torch.manual_seed(2)
    model = DFlashDraftModel(_arch())
    out = export_drafter(model, tmp_path / "drafter", target_num_layers=8)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == BS and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3, 5], "mask_token_id": 119, "block_size": BS}
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


def test_warm_start_refuses_a_different_contract():
    assert warm_start_problems(_arch(), _arch()) == []
    problems = warm_start_problems(_arch(), _arch(hidden_size=32, target_layer_ids=[1, 2, 3], mask_token_id=5))
    text = "\n".join(problems)
    assert "hidden_size" in text and "target_layer_ids" in text and "mask_token_id" in text
