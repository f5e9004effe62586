"""Tiny random transformers targets and the two ways of running a batch of documents through
them: each document alone (the reference) and the batch as the target ranks lay it out
(``build_batch`` + masks from the lengths). Shared by tests/unit and tests/gpu
``test_target_attention.py`` / ``test_cuda_target_attention.py``."""

from __future__ import annotations

import copy

import torch

from dflash.targets.attention import document_inputs
from dflash.targets.forward import build_batch, gather_tokens, target_forward
from dflash.targets.loader import base_model

SMALL = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
DOCS = [17, 5, 30, 1, 12]
"""Longer and shorter than gpt-oss's window below, one of a single token."""
TAPS = [0, 2, 3]
TOL = dict(rtol=1e-5, atol=1e-5)
GPT_OSS = dict(
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2,
)
HYBRID = dict(
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16
)


def make(model_type: str, attn: str, dtype: torch.dtype = torch.float32, device: str = "cpu", **overrides):
    """A tiny random ``*ForCausalLM`` (seed 0, so every ``attn`` gets the same weights), norms perturbed,
    in ``dtype`` on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype, attn_implementation=attn)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(device).eval().requires_grad_(False)


def seqs_of(lengths: list[int], seed: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SMALL["vocab_size"], (n,), generator=g) for n in lengths]


def alone(model, seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """Every document in a forward of its own (no mask, no packing): the reference."""
    dev = next(model.parameters()).device
    outs = [target_forward(model, s[None].to(dev), None, TAPS) for s in seqs]
    return torch.cat([a[0] for a, _ in outs]), torch.cat([f[0] for _, f in outs])


def batched(model, seqs, pack: bool, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch as the target ranks run it: ``build_batch``, masks from the lengths, padding removed."""
    p = next(model.parameters())
    ids, mask, pos, keep = (
        None if t is None else t.to(p.device) for t in build_batch(seqs, pack=pack, pad_id=7)
    )
    lens = [len(s) for s in seqs]
    assert document_inputs(base_model(model).config, lens, ids, mask, pos, p.dtype) is not None
    aux, final = target_forward(model, ids, mask, TAPS, position_ids=pos, seq_lens=lens, **kw)
    return gather_tokens(aux, keep), gather_tokens(final, keep)
