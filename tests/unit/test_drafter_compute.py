"""The drafter's compute under bf16 autocast: the casts it makes (one bf16 copy per GEMM-input group,
no fp32 round trip of the target's hidden states) and the flex path against dense SDPA there."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from tiny_drafter import BS, MASK_ID, SLIDING, masks_for, tiny_arch, tiny_batch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.drafter import attention
from dflash.drafter import model as model_module
from dflash.drafter.blocks import make_blocks
from dflash.drafter.model import DFlashDraftModel


class _Casts(TorchDispatchMode):
    """Every dtype-changing copy (``aten._to_copy``: ``Tensor.to`` and autocast's casts both land
    there) as ``(source dtype, result dtype, source shape)``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype != args[0].dtype:
            self.seen.append((args[0].dtype, out.dtype, tuple(args[0].shape)))
        return out


def _bf16_forward(num_layers: int, kind: str = "sdpa", layout: dict | None = None):
    """One training forward of a fresh fp32 drafter under CPU bf16 autocast, the taps in bf16 as a
    GPU target sends them: ``(output, casts, shapes)``; casts are counted on the SDPA path only (the
    counter does not take flex's higher-order op)."""
    torch.manual_seed(0)
    model = DFlashDraftModel(tiny_arch(num_layers=num_layers, **(layout or {})))
    pos, doc, anchors, ids, aux, emb = tiny_batch()
    blocks = make_blocks(ids, pos, doc, anchors, BS, MASK_ID)
    noise, taps = emb[blocks.block_ids].float(), aux.bfloat16()
    masks = masks_for(model, anchors, doc, kind)
    casts = _Casts()
    with torch.autocast("cpu", torch.bfloat16), casts if kind == "sdpa" else nullcontext():
        out = model(noise, taps, pos, blocks.block_positions, masks)
    h = model.arch.hidden_size
    return out, casts.seen, dict(taps=tuple(taps.shape), q=(1, noise.shape[1], h), s=(1, taps.shape[1], h))


def test_one_bf16_copy_per_gemm_input_group_and_no_fp32_round_trip_of_the_taps():
    """A layer makes exactly 17 casts, the fewest its math allows:

    - 7 weight casts (q, k, v, o, gate, up, down), one each: autocast caches a weight's bf16 copy for
      the forward, so k_proj and v_proj, each applied to the context and to the block, cast once;
    - 2 activation copies: the normed block states (read by q, k and v) and the MLP input (read by gate
      and up). Left to autocast every GEMM casts its own input: 3 + 2 copies, each saved for backward;
    - 6 inside the three q/k RMSNorm calls (q, the context's k, the block's k): up to fp32 for the
      variance and the rounding back to bf16 before the fp32 weight (transformers' Qwen3RMSNorm);
    - 2 for attention: q and k leave the norm and RoPE in fp32 and take v's dtype (bf16).

    Once per forward, 6 more: fc's weight, hidden_norm's two, the context's one bf16 copy (read by the
    k and v of every layer, where autocast would cast it twice per layer) and the RoPE positions of
    the blocks and of the context (int64 -> fp32). The bf16 taps go to fc as they are: no cast of a
    tensor of their shape at all (the old fp32 round trip cast them up and autocast cast them back).
    """
    _, one, shapes = _bf16_forward(1)
    _, three, _ = _bf16_forward(3)
    assert (len(three) - len(one)) / 2 == 17, three
    assert len(one) == 6 + 17, one
    assert not [c for c in three if c[2] == shapes["taps"]], three
    block_copies = [c for c in three if c[:2] == (torch.float32, torch.bfloat16) and c[2] == shapes["q"]]
    context_copies = [c for c in three if c[:2] == (torch.float32, torch.bfloat16) and c[2] == shapes["s"]]
    # fp32 -> bf16 at the context's shape: hidden_norm's rounding and the one copy
    assert len(block_copies) == 2 * 3 and len(context_copies) == 2, three


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("layout", [{}, SLIDING], ids=["full", "mixed"])
def test_flex_under_bf16_autocast_equals_dense_sdpa(layout, monkeypatch):
    """The GPU path's dtypes on CPU: q, k and v reach flex_attention in bf16 (compiled flex takes no
    mixed dtypes) and it agrees with dense SDPA on the same bf16 inputs within bf16 rounding, both
    close to the fp32 forward. Forward only: flex has no CPU backward (the backward is in tests/gpu)."""
    dtypes = []

    def attend(q, k, v, mask, scale):
        dtypes.append((q.dtype, k.dtype, v.dtype))
        return attention.attend(q, k, v, mask, scale)

    monkeypatch.setattr(model_module, "attend", attend)
    with torch.no_grad():
        flex, _, _ = _bf16_forward(2, "flex", layout)
        dense, _, _ = _bf16_forward(2, "sdpa", layout)
        assert dtypes == [(torch.bfloat16,) * 3] * 4
        torch.manual_seed(0)
        model = DFlashDraftModel(tiny_arch(num_layers=2, **layout))
        pos, doc, anchors, ids, aux, emb = tiny_batch()
        blocks = make_blocks(ids, pos, doc, anchors, BS, MASK_ID)
        fp32 = model(
            emb[blocks.block_ids].float(),
            aux.bfloat16(),
            pos,
            blocks.block_positions,
            masks_for(model, anchors, doc),
        )
    assert flex.dtype == dense.dtype == torch.float32  # the final norm's fp32 weight
    scale = fp32.abs().max().item()
    torch.testing.assert_close(flex, dense, atol=2e-2 * scale, rtol=2e-2)
    for out in (flex, dense):
        torch.testing.assert_close(out, fp32, atol=6e-2 * scale, rtol=6e-2)
    assert not torch.equal(flex, fp32)  # autocast was on


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_compiled_layers_equal_eager_forward_and_backward(checkpointed):
    """``compile_layers`` (Inductor on CPU, static shapes, fp32, dense masks, a sliding and a full
    layer): the same output and parameter gradients as eager, also with per-layer activation
    checkpointing wrapped around the compiled layers (backward runs the compiled forward again), one
    graph per layer without a graph break, and the parameter names unchanged. Decoding with a cache
    takes the eager path. Slow: Inductor compiles every layer for the first case (the second finds
    its graphs in Inductor's cache)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    pos, doc, anchors, ids, aux, emb = tiny_batch()
    blocks = make_blocks(ids, pos, doc, anchors, BS, MASK_ID)
    noise, taps = emb[blocks.block_ids].float(), aux.float()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = DFlashDraftModel(tiny_arch(**SLIDING))
        names = [n for n, _ in model.named_parameters()]
        if compiled:
            model.compile_layers()
        model.checkpoint_layers = checkpointed
        out = model(noise, taps, pos, blocks.block_positions, masks_for(model, anchors, doc))
        out.square().mean().backward()
        assert [n for n, _ in model.named_parameters()] == names
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager, eager_grads), (comp, comp_grads) = results
    torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)
    for name, g in eager_grads.items():
        torch.testing.assert_close(comp_grads[name], g, rtol=1e-4, atol=1e-5 * (1 + g.abs().max().item()))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2  # one per layer (their windows differ)
    compiled_frames = counters["stats"]["unique_graphs"]
    with torch.no_grad():  # one block decoded with a cache: eager, nothing new compiled
        cache = model.new_cache()
        model(noise[:, :BS], taps[:, :10], pos[:, :10], pos[:, 10 : 10 + BS], None, cache)
    assert counters["stats"]["unique_graphs"] == compiled_frames
