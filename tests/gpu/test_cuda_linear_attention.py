"""Hybrid targets (Qwen3.5/3.6 Gated DeltaNet) on CUDA: a packed row through the kernels the GPU
extra installs (flash-linear-attention's varlen delta rule, causal-conv1d under the zero-gap
convolution; ``dflash.targets.linear_attention``) equals each document alone. Without the extra the
same test runs the per-document torch fallback. Run with ``pytest -m gpu``; skipped elsewhere."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tiny_targets import DOCS, HYBRID, alone, batched, make, seqs_of

from dflash.targets.linear_attention import fast_delta_rule, install_varlen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOLS = {torch.float32: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def test_the_kernel_named_is_the_one_installed():
    model = make("qwen3_5_text", "sdpa", torch.bfloat16, "cuda", **HYBRID)
    kernel = install_varlen(model)
    has_fla = importlib.util.find_spec("fla") is not None
    assert fast_delta_rule(torch.device("cuda")) == has_fla
    assert kernel is not None and kernel.startswith("flash-linear-attention" if has_fla else "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_packed_hybrid_documents_equal_each_document_alone_on_cuda(model_type, dtype):
    extra = (
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if "moe" in model_type else {}
    )
    model = make(model_type, "sdpa", dtype, "cuda", **HYBRID, **extra)
    install_varlen(model)
    for lengths in (DOCS, [70, 3, 129]):  # documents across the kernels' 64-token chunks
        seqs = seqs_of(lengths)
        ref_aux, ref_final = alone(model, seqs)
        for pack in (True, False):
            aux, final = batched(model, seqs, pack)
            torch.testing.assert_close(aux.float(), ref_aux.float(), **TOLS[dtype])
            torch.testing.assert_close(final.float(), ref_final.float(), **TOLS[dtype])
