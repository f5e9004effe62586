"""RoPE carried from the target into the drafter (theta, YaRN/llama3 scaling, partial rotary, M-RoPE of
VLM-wrapped targets): the drafter's rotary embedding, built from the target's config.json the way a run
builds it, equals the target's own rotary embedding and rotation at the same positions."""

from __future__ import annotations

import sys

import pytest
import torch

from dflash.drafter.arch import DrafterArch, rope_from_config
from dflash.drafter.model import RotaryEmbedding, apply_rope
from dflash.targets.loader import base_model, read_target_meta

SHAPE = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    tie_word_embeddings=False,
)
LINEAR = dict(
    linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=8, linear_value_head_dim=8
)
MROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000,
    "partial_rotary_factor": 0.25,
    "mrope_interleaved": True,
    "mrope_section": [1, 1, 2],
}


def _qwen3_yarn():
    from transformers import AutoConfig

    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4096}
    return AutoConfig.for_model("qwen3", max_position_embeddings=16384, rope_parameters=rope, **SHAPE)


def _llama3_scaled():
    from transformers import AutoConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return AutoConfig.for_model("llama", max_position_embeddings=131072, rope_parameters=rope, **SHAPE)


def _qwen3_5_text():
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_5_text", rope_parameters=dict(MROPE), **SHAPE, **LINEAR)


def _qwen3_5_vlm():
    from transformers import Qwen3_5Config

    text = {**SHAPE, **LINEAR, "rope_parameters": dict(MROPE)}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)


TARGETS = {"qwen3-yarn": _qwen3_yarn, "llama3-scaled": _llama3_scaled, "qwen3_5-text": _qwen3_5_text}
TARGETS["qwen3_5-vlm"] = _qwen3_5_vlm


@pytest.mark.parametrize("name", list(TARGETS))
def test_drafter_rope_equals_the_targets_own(name, tmp_path):
    from transformers import AutoModelForCausalLM

    config = TARGETS[name]()
    config.save_pretrained(tmp_path)
    meta = read_target_meta(str(tmp_path))  # the run's path: config.json -> text config -> drafter
    rope, partial = rope_from_config(meta.text_config)
    assert "mrope_section" not in rope and "partial_rotary_factor" not in rope
    arch = DrafterArch(
        hidden_size=meta.hidden_size,
        intermediate_size=8,
        num_layers=1,
        num_heads=meta.num_heads,
        num_kv_heads=meta.num_kv_heads,
        head_dim=meta.head_dim,
        vocab_size=meta.vocab_size,
        target_layer_ids=[0],
        block_size=4,
        mask_token_id=0,
        max_position_embeddings=meta.max_position_embeddings,
        rope_parameters=rope,
        partial_rotary_factor=partial,
    )
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rotary = base_model(target).rotary_emb
    x = torch.zeros(1, 1, dtype=torch.float32)
    positions = torch.cat([torch.arange(40), 10_000 + torch.arange(40), 60_000 + torch.arange(40)]).unsqueeze(
        0
    )
    ours = RotaryEmbedding(arch)(x, positions)
    theirs = rotary(x, positions)  # M-RoPE targets broadcast text positions to (t, h, w) themselves
    assert ours[0].shape == theirs[0].shape == (1, positions.shape[1], int(meta.head_dim * partial))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    q = torch.randn(1, 2, positions.shape[1], meta.head_dim)
    k = torch.randn(1, 1, positions.shape[1], meta.head_dim)
    apply_target = sys.modules[type(base_model(target)).__module__].apply_rotary_pos_emb
    q_t, k_t = apply_target(q, k, *theirs)
    torch.testing.assert_close(apply_rope(q, *ours), q_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rope(k, *ours), k_t, atol=1e-5, rtol=1e-5)
