"""The target's document-masked attention on CUDA (what ``target.attn_implementation=auto`` runs
there): a packed row of documents and right-padded rows through flex_attention (a compiled
``BlockMask`` from the documents' lengths), and flash-attn's varlen kernel when the package is
installed, against each document alone through SDPA. Run with ``pytest -m gpu``; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from tiny_targets import DOCS, alone, batched, make, seqs_of

from dflash.config import TargetConfig
from dflash.config.resolve import target_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOLS = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _flash_available() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


def _assert_equals_each_document_alone(
    attn: str, dtype: torch.dtype, model_type: str = "qwen3", **overrides
) -> None:
    kernel = make(model_type, attn, dtype, "cuda", **overrides)
    reference = make(model_type, "sdpa", dtype, "cuda", **overrides)
    for lengths in (DOCS, [40, 3, 21]):  # a second packet of other lengths: new masks, same kernels
        seqs = seqs_of(lengths)
        ref_aux, ref_final = alone(reference, seqs)
        for pack in (True, False):
            aux, final = batched(kernel, seqs, pack)
            torch.testing.assert_close(aux.float(), ref_aux.float(), **TOLS[dtype])
            torch.testing.assert_close(final.float(), ref_final.float(), **TOLS[dtype])


def test_auto_resolves_to_a_document_masked_kernel_on_cuda():
    cfg = TargetConfig(name="t", path="unused")
    assert target_attention(cfg, "cuda", "qwen3") == (
        "flash_attention_2" if _flash_available() else "flex_attention"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_flex_attention_equals_each_document_alone(model_type, dtype):
    _assert_equals_each_document_alone("flex_attention", dtype, model_type)


def test_flex_attention_moe_equals_each_document_alone():
    _assert_equals_each_document_alone(
        "flex_attention", torch.float32, "qwen3_moe", num_experts=4, num_experts_per_tok=2
    )


@pytest.mark.skipif(not _flash_available(), reason="flash-attn is not installed")
@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_flash_attention_2_equals_each_document_alone(model_type):
    _assert_equals_each_document_alone("flash_attention_2", torch.bfloat16, model_type)
