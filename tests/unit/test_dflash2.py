"""DFlash2 (drafter.family=dflash2): identity init == the DFlash-1 drafter it extends (logits and greedy
decode), block-local convolutions (training forward == cached decoding, no block reads another),
the selector chain against a brute-force walk, and the served export layout."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_drafter import BS, MASK_ID, SLIDING, masks_for, tiny_arch, tiny_batch

from dflash.drafter.blocks import make_blocks
from dflash.drafter.dflash2 import DFlash2DraftModel
from dflash.drafter.export import (
    export_drafter,
    exported_arch,
    load_exported,
    load_into,
    tensor_problems,
    warm_start_problems,
)
from dflash.drafter.families import build_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

DF2 = dict(family="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=5)


def pair(seed: int = 3, **layout) -> tuple[torch.nn.Module, DFlash2DraftModel]:
    """A DFlash-1 drafter and the DFlash2 drafter of the same seed (the same DFlash-1 tensors)."""
    one, two = build_drafter(tiny_arch(**layout)), build_drafter(tiny_arch(**{**layout, **DF2}))
    one.reset_parameters(seed=seed)
    two.reset_parameters(seed=seed)
    assert isinstance(two, DFlash2DraftModel)
    return one, two


def perturb(model: DFlash2DraftModel, seed: int, scale: float = 0.3) -> None:
    """Move every DFlash2 parameter off its identity init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.family_modules():
            for p in m.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def forward(model, dtype=torch.float64, seed: int = 0, layout_model=None):
    pos, doc, anchors, ids, aux, emb = tiny_batch(seed)
    blocks = make_blocks(ids, pos, doc, anchors, BS, MASK_ID)
    noise = emb[blocks.block_ids].to(dtype)
    return model(noise, aux.to(dtype), pos, blocks.block_positions, masks_for(model, anchors, doc))


@pytest.mark.parametrize("layout", [{}, SLIDING], ids=["full", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identity_init_gives_the_dflash1_hidden_states_exactly(layout, dtype):
    one, two = pair(**layout)
    common = one.state_dict()
    assert all(torch.equal(common[k], two.state_dict()[k]) for k in common)  # same seed, same draws
    with torch.no_grad():
        h1, h2 = forward(one.to(dtype), dtype), forward(two.to(dtype), dtype)
    assert torch.equal(h1, h2)
    perturb(two, 0)
    with torch.no_grad():
        assert (forward(two, dtype) - h1).abs().max() > 1e-2  # the convolutions are live


def test_identity_selector_picks_the_argmax_and_a_trained_one_walks_the_chain():
    _, two = pair()
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, BS - 1, 64, generator=g)
    head = torch.randn(120, 64, generator=g)
    first = torch.randint(0, 120, (3,), generator=g)
    with torch.no_grad():
        assert torch.equal(two.propose(hidden, first, head), (hidden @ head.T).argmax(-1))
        perturb(two, 1, scale=1.0)
        got = two.propose(hidden, first, head)
        sel = two.candidate_selector
        logits = hidden @ head.T
        for b in range(3):  # brute force: every candidate's score, one slot after another
            prev = int(first[b])
            for t in range(BS - 1):
                cands = logits[b, t].topk(sel.top_k).indices
                u = sel.hidden_projection(hidden[b, t]) * sel.predecessor_codebook[prev]
                scores = logits[b, t, cands] + sel.successor_codebook[cands] @ u
                prev = int(cands[scores.argmax()])
                assert int(got[b, t]) == prev
    assert not torch.equal(got, logits.argmax(-1))  # the selector changed some pick


@pytest.mark.parametrize("layout", [{}, SLIDING], ids=["full", "mixed"])
def test_convolutions_are_block_local_in_training_and_decoding(layout):
    """Training forward of each block == the cached decoding forward of that block alone, with the
    convolutions and selector off their identity init; and a block's slots never change another's."""
    _, two = pair(**layout)
    perturb(two, 2)
    two = two.double()
    pos, doc, anchors, ids, aux, emb = tiny_batch(1)
    blocks = make_blocks(ids, pos, doc, anchors, BS, MASK_ID)
    noise = emb[blocks.block_ids]
    with torch.no_grad():
        train = two(noise, aux, pos, blocks.block_positions, masks_for(two, anchors, doc))
        other = noise.clone()
        other[:, BS : 2 * BS] += 1.0  # block 1's inputs only
        moved = two(other, aux, pos, blocks.block_positions, masks_for(two, anchors, doc))
    changed = (moved - train).abs().amax(-1)[0] > 0
    assert changed[BS : 2 * BS].all() and not changed[:BS].any() and not changed[2 * BS :].any()
    checked = 0
    for n, a in enumerate(anchors[0].tolist()):
        if a < 0:
            continue
        start = int((doc[0] == doc[0, a]).nonzero()[0])
        sl = slice(n * BS, (n + 1) * BS)
        with torch.no_grad():
            infer = two(
                noise[:, sl],
                aux[:, start:a],
                pos[:, start:a],
                blocks.block_positions[:, sl],
                None,
                two.new_cache(),
            )
        torch.testing.assert_close(infer[0], train[0, sl], atol=1e-10, rtol=0)
        checked += 1
    assert checked >= 3


def test_export_is_the_served_layout_and_round_trips(tmp_path):
    _, two = pair()
    perturb(two, 3)
    out = export_drafter(two, tmp_path / "d2", target_num_layers=8)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    dc = cfg["dflash_config"]
    assert {k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 5,
    }
    assert dc["mask_token_id"] == MASK_ID and dc["target_layer_ids"] == [1, 3, 5]
    assert cfg["is_neox_style"] is True and cfg["sample_from_anchor"] is False  # as trained (vLLM reads both)
    arch, state = load_exported(out)
    assert arch == two.arch
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    assert shapes["layers.1.attention_conv.base_kernel"] == (2, 2, 64)
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 2 * 4, 64)  # side x tap x group
    assert shapes["candidate_selector.predecessor_codebook"] == (120, 8)  # no ".weight", as served
    assert shapes["candidate_selector.successor_codebook"] == (120, 8)
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, 64)
    back = build_drafter(arch)
    load_into(back, state)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in two.state_dict().items())
    assert tensor_problems(out, arch) == []
    one_arch = tiny_arch()
    assert tensor_problems(out, one_arch)  # a DFlash-1 drafter does not take these tensors
    assert "drafter.family=dflash2" in warm_start_problems(exported_arch(out), one_arch)[0]
    cfg["dflash_config"].pop("selector_rank")
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="dflash_config.selector_rank"):
        exported_arch(out)


def test_identity_dflash2_drafts_exactly_what_dflash1_drafts(tiny_target_dir):
    """Speculative decoding on the tiny target: the same drafted blocks, outputs and tau at identity
    init; a selector moved off it drafts differently (and stays lossless)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.drafter.arch import rope_from_config
    from dflash.eval.spec_decode import speculative_generate
    from dflash.targets.loader import load_embed_and_head

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    embed, head = load_embed_and_head(str(tiny_target_dir))
    c = target.config
    rope, partial = rope_from_config(c.to_dict())
    shape = dict(
        hidden_size=c.hidden_size,
        intermediate_size=128,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        target_layer_ids=[1, 2, 4],
        mask_token_id=len(tok),
        rope_parameters=rope,
        partial_rotary_factor=partial,
    )
    one, two = pair(seed=4, **shape)
    prompt = tok("def foo(x):\n    return", add_special_tokens=False)["input_ids"]

    def run(drafter):
        blocks: list[list[int]] = []
        res = speculative_generate(
            target,
            drafter.eval(),
            embed,
            head,
            prompt,
            max_new_tokens=24,
            eos_token_ids=set(),
            layer_ids=[1, 2, 4],
            block_size=BS,
            on_step=lambda s: blocks.append(s.block),
        )
        return res, blocks

    (r1, b1), (r2, b2) = run(one), run(two)
    assert b1 == b2 and r1.output_ids == r2.output_ids and r1.accept_lengths == r2.accept_lengths
    perturb(two, 6, scale=1.0)
    r3, b3 = run(two)
    assert b3 != b1 and r3.output_ids == r1.output_ids  # other drafts, the same (lossless) output
