"""The target's attention: the kernel ``target.attn_implementation`` resolves to, and the masks made
from the documents' lengths (``dflash.targets.attention``) against each document run alone (fp32).

transformers' flex_attention path runs on CPU with the flex kernel run eagerly (see ``eager_flex``);
the compiled kernel is checked on CUDA (tests/gpu/test_cuda_target_attention.py).
"""

from __future__ import annotations

import pytest
import torch
from tiny_targets import DOCS, GPT_OSS, HYBRID, SMALL, TAPS, TOL, alone, batched, make, seqs_of

from dflash.config import TargetConfig
from dflash.config.resolve import target_attention
from dflash.targets.attention import document_inputs
from dflash.targets.forward import build_batch, target_forward
from dflash.targets.linear_attention import has_linear_attention, install_varlen
from dflash.targets.loader import base_model, load_target


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize(
    "model_type,attn",
    [("qwen3", "sdpa"), ("qwen3", "eager"), ("llama", "sdpa"), ("llama", "eager"), ("qwen3_moe", "sdpa")],
)
def test_the_batch_equals_each_document_alone(model_type, attn, pack):
    model = make(
        model_type,
        attn,
        **({"num_experts": 4, "num_experts_per_tok": 2} if model_type == "qwen3_moe" else {}),
    )
    seqs = seqs_of(DOCS)
    aux, final = batched(model, seqs, pack)
    ref_aux, ref_final = alone(model, seqs)
    torch.testing.assert_close(aux, ref_aux, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)


def test_gpt_oss_packed_documents_stay_apart_in_sliding_and_full_layers():
    """gpt-oss (sliding and full layers, attention sinks: eager on CPU) builds its masks without the
    position ids, so transformers alone lets packed documents see each other; the masks made from the
    lengths keep each document (and each window) to itself."""
    model = make("gpt_oss", "eager", **GPT_OSS)
    seqs = seqs_of(DOCS)
    ref_aux, _ = alone(model, seqs)
    for pack in (True, False):
        aux, _ = batched(model, seqs, pack)
        torch.testing.assert_close(aux, ref_aux, **TOL)
    ids, _, pos, _ = build_batch(seqs, pack=True, pad_id=7)
    leak, _ = target_forward(model, ids, None, TAPS, position_ids=pos)
    assert not torch.allclose(leak[0], ref_aux, atol=1e-3)


def test_hybrid_padded_rows_need_no_padding_mask():
    """Qwen3.5/3.6 (linear attention, no packing): right-padded rows without any mask equal each
    document alone, since every layer (attention, Gated DeltaNet, its convolution) is causal."""
    model = make("qwen3_5_text", "sdpa", **HYBRID)
    seqs = seqs_of(DOCS)
    ids, mask, pos, _ = build_batch(seqs, pack=False, pad_id=7)
    out = document_inputs(base_model(model).config, DOCS, ids, mask, pos, torch.float32)
    assert out is not None and out["attention_mask"] == {"full_attention": None, "linear_attention": None}
    aux, final = batched(model, seqs, pack=False)
    ref_aux, ref_final = alone(model, seqs)
    torch.testing.assert_close(aux, ref_aux, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)
    with pytest.raises(ValueError, match="do not hold documents"):
        document_inputs(base_model(model).config, [3, 4], ids, mask, pos, torch.float32)


def test_packed_hybrid_documents_equal_each_document_alone():
    """Qwen3.5/3.6 (Gated DeltaNet in 3 of 4 layers) on a packed row: the convolution window and
    the recurrent state restart at every document (``dflash.targets.linear_attention``), so every
    document's taps equal it alone. Without the lengths (transformers' own kernels, what ran before)
    the state runs across the documents."""
    model = make("qwen3_5_text", "sdpa", **HYBRID)
    assert install_varlen(model) is not None and has_linear_attention(model)
    seqs = seqs_of(DOCS)
    ref_aux, ref_final = alone(model, seqs)
    aux, final = batched(model, seqs, pack=True)
    torch.testing.assert_close(aux, ref_aux, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)
    ids, _, pos, keep = build_batch(seqs, pack=True, pad_id=7)
    leaked, _ = target_forward(model, ids, None, TAPS, position_ids=pos)  # no lengths: transformers alone
    first = DOCS[0]
    torch.testing.assert_close(leaked[0, :first], ref_aux[:first], **TOL)  # the first document has no past
    assert (leaked[0, first:] - ref_aux[first:]).abs().max() > 1e-3


def test_hybrid_moe_packs_too():
    model = make(
        "qwen3_5_moe_text", "sdpa", **HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    install_varlen(model)
    seqs = seqs_of([9, 14, 6])
    aux, final = batched(model, seqs, pack=True)
    ref_aux, ref_final = alone(model, seqs)
    torch.testing.assert_close(aux, ref_aux, **TOL)


@pytest.fixture
def eager_flex(monkeypatch):
    """transformers' flex_attention path with the flex kernel run eagerly (torch's reference
    implementation of the same call) instead of compiled by inductor.

    Why not the compiled kernel here: inductor's CPU flex template of torch 2.13 is wrong on AVX2
    code paths. Seen on AVX2 EPYC hosts and reproduced on an AVX-512 host with
    ``ATEN_CPU_CAPABILITY=avx2``: one causal BlockMask, B=3 rows of 40 tokens, the compiled kernel
    against SDPA gives errors of 1.6 (or NaN) on some rows and ~1e-7 on the others, while the same
    call eagerly matches SDPA to 1e-7; the AVX-512 code path is right. What this test must prove is our
    mask (the BlockMask CUDA runs: tests/gpu runs it compiled there), so it runs the kernel eagerly."""
    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention.flex_attention import flex_attention

    def eager(query, key, value, training=False, **kwargs):
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", eager)


@pytest.mark.parametrize("lengths", [DOCS, [40, 3, 21]], ids=["docs", "other_lengths"])
def test_flex_attention_on_cpu_equals_each_document_alone(eager_flex, lengths):
    """transformers' flex_attention (what auto runs on CUDA) with our BlockMasks: packed and padded
    batches equal each document through SDPA alone."""
    import warnings

    flex, sdpa = make("qwen3", "flex_attention"), make("qwen3", "sdpa")
    seqs = seqs_of(lengths)
    ref_aux, ref_final = alone(sdpa, seqs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's "use torch.compile" advice, once per call
        for pack in (True, False):
            aux, final = batched(flex, seqs, pack)
            torch.testing.assert_close(aux, ref_aux, **TOL)
            torch.testing.assert_close(final, ref_final, **TOL)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_flex_block_mask_skips_only_masked_tiles(pack):
    """The BlockMask our layout hands flex equals the dense boolean mask pair by pair (its
    ``mask_mod``), and its tile lists are what a compiled kernel trusts without looking: a tile it
    skips holds no visible pair, a tile it marks full holds no hidden one (block size 8 here, so a
    short packet has tiles of every kind)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3", **SMALL)
    config._attn_implementation = "flex_attention"
    lengths = [17, 5, 30, 1, 12, 19]
    seqs = seqs_of(lengths)
    ids, mask, pos, _ = build_batch(seqs, pack=pack, pad_id=7)
    out = document_inputs(config, lengths, ids, mask, pos, torch.float32)
    assert out is not None
    block_mask = out["attention_mask"]["full_attention"]  # qwen3 names its layer types
    rows, length = ids.shape
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    if pack:
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        dense = (q >= k) & (doc[:, None] == doc[None, :])
    else:  # one document per row: causal (the padding after a document is dropped)
        dense = q >= k
    zero = torch.zeros((), dtype=torch.int64)
    got = block_mask.mask_mod(zero, zero, q.expand(length, length), k.expand(length, length))
    assert torch.equal(got, dense)
    tiles = create_block_mask(block_mask.mask_mod, 1, None, length, length, device="cpu", BLOCK_SIZE=8)
    pad = (-length) % 8
    padded = torch.nn.functional.pad(dense, (0, pad, 0, pad))
    per_tile = padded.view(-1, 8, padded.shape[1] // 8, 8).transpose(1, 2)
    any_visible, all_visible = per_tile.any(-1).any(-1), per_tile.all(-1).all(-1)
    computed = tiles.to_dense()[0, 0].bool()
    assert torch.equal(computed, any_visible), "a skipped tile holds a visible pair, or a computed one none"
    full = _full_tiles(tiles, computed.shape)
    assert not (full & ~all_visible).any(), "a tile marked full hides a pair"
    assert full.any() and (computed & ~full).any()  # both kinds occur, so both checks bite


def _full_tiles(block_mask, shape: tuple[int, int]) -> torch.Tensor:
    """[q tiles, kv tiles] bool: the tiles ``block_mask`` lists as full (computed without its mask_mod)."""
    full = torch.zeros(shape, dtype=torch.bool)
    counts, index = block_mask.full_kv_num_blocks[0, 0], block_mask.full_kv_indices[0, 0]
    for row in range(shape[0]):
        full[row, index[row, : int(counts[row])]] = True
    return full


# ----------------------------------------------------------------------------------------------
# target.attn_implementation


def tcfg(**kw) -> TargetConfig:
    return TargetConfig(name="t", path="unused", **kw)


def test_auto_is_document_masked_on_cuda_and_sdpa_elsewhere():
    from transformers.utils import is_flash_attn_2_available

    packed = "flash_attention_2" if is_flash_attn_2_available() else "flex_attention"
    assert target_attention(tcfg(), "cuda", "qwen3") == packed
    assert target_attention(tcfg(dtype="float32"), "cuda", "llama") == "flex_attention"  # flash-attn: 16-bit
    assert target_attention(tcfg(), "cpu", "qwen3") == "sdpa"
    assert target_attention(tcfg(pack=False), "cuda", "qwen3_5_text") == "sdpa"  # one document per row
    assert target_attention(tcfg(), "cuda", "qwen3", pack=False) == "sdpa"  # decoding
    if not is_flash_attn_2_available():  # transformers runs Qwen3.5 without flex
        assert target_attention(tcfg(), "cuda", "qwen3_5_text") == "sdpa"
    for name in ("sdpa", "eager", "flex_attention", "flash_attention_2"):
        assert target_attention(tcfg(attn_implementation=name), "cuda", "qwen3") == name
        assert target_attention(tcfg(attn_implementation=name), "cpu", "qwen3") == name


def test_load_target_runs_the_resolved_kernel(tmp_path):
    make("qwen3", "eager").save_pretrained(tmp_path / "t")
    for attn, want in (("auto", "sdpa"), ("eager", "eager")):
        cfg = TargetConfig(name="t", path=str(tmp_path / "t"), dtype="float32", attn_implementation=attn)
        model = load_target(cfg, torch.device("cpu"), torch.float32)
        assert model.config._attn_implementation == want


def test_a_hybrid_checkpoint_under_a_dense_target_config_packs_without_leaking(tmp_path):
    """``target=qwen3_8b target.path=<a Qwen3.5 dir>``: the config says nothing about linear
    attention (and packs), the checkpoint has it; the loader reads that from the model itself, so
    the packed documents still equal each document alone."""
    from dflash.cli import compose_config
    from dflash.config import register_configs, to_config

    make("qwen3_5_text", "sdpa", **HYBRID).save_pretrained(tmp_path / "hybrid")
    register_configs()
    cfg = to_config(
        compose_config(
            "config", ["target=qwen3_8b", f"target.path={tmp_path / 'hybrid'}", "target.dtype=float32"]
        )
    )
    assert cfg.target.pack
    model = load_target(cfg.target, torch.device("cpu"), torch.float32)
    seqs = seqs_of(DOCS)
    ref_aux, _ = alone(model, seqs)
    aux, _ = batched(model, seqs, pack=True)
    torch.testing.assert_close(aux, ref_aux, **TOL)
