"""The target's attention: the kernel ``target.attn_implementation`` resolves to, and the masks made
from the documents' lengths (``dflash.targets.attention``) against each document run alone (fp32).

transformers' flex_attention path runs on CPU too (inductor compiles it); its test is slow.
"""

from __future__ import annotations

import pytest
import torch
from tiny_targets import DOCS, GPT_OSS, HYBRID, TAPS, TOL, alone, batched, make, seqs_of

from dflash.config import TargetConfig
from dflash.config.resolve import target_attention
from dflash.targets.attention import document_inputs
from dflash.targets.forward import build_batch, target_forward
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


def test_a_packed_hybrid_row_is_left_to_transformers():
    """Packed documents would share a linear-attention state: no masks are made for such a row."""
    model = make("qwen3_5_text", "sdpa", **HYBRID)
    ids, mask, pos, _ = build_batch(seqs_of(DOCS), pack=True, pad_id=7)
    assert document_inputs(base_model(model).config, DOCS, ids, mask, pos, torch.float32) is None


@pytest.mark.slow
def test_flex_attention_on_cpu_equals_each_document_alone():
    """transformers' flex_attention (what auto runs on CUDA), compiled by inductor on CPU: packed and
    padded batches equal each document through SDPA alone; a second packet of other lengths reuses
    the compiled kernels (slow: it compiles them)."""
    flex, sdpa = make("qwen3", "flex_attention"), make("qwen3", "sdpa")
    for lengths in (DOCS, [40, 3, 21]):
        seqs = seqs_of(lengths)
        ref_aux, ref_final = alone(sdpa, seqs)
        for pack in (True, False):
            aux, final = batched(flex, seqs, pack)
            torch.testing.assert_close(aux, ref_aux, **TOL)
            torch.testing.assert_close(final, ref_final, **TOL)


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
