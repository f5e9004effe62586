"""CUDA paths that CPU CI cannot run: the chunked loss on CUDA (fp32, bf16 inputs with fp32
accumulation, compiled block math) against the CPU fp64 result, and compiled flex_attention against
dense SDPA (forward and backward, full and sliding-window layers, fp32 and under bf16 autocast, eager
layers and each layer compiled). Run with ``pytest -m gpu`` on a GPU host; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from tiny_drafter import BS, MASK_ID, SLIDING, masks_for, tiny_arch, tiny_batch

from dflash.drafter.blocks import make_blocks
from dflash.drafter.model import DFlashDraftModel
from dflash.loss.terms import BY_NAME, needs_verifier_logits
from dflash.loss.verifier import verifier_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MIXES = [
    dict(ce=1.0),
    dict(ce=1.0, kl=1.0),
    dict(ce=0.5, kl=1.0, verifier_ce=0.3, temperature=2.0),
]


def _inputs(rows: int = 300, hidden: int = 64, vocab: int = 5000, seed: int = 0):
    """fp64 CPU inputs; a quarter of the rows have weight 0 (and an invalid label)."""
    g = torch.Generator().manual_seed(seed)
    w_head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * (3 / hidden**0.5)
    h_d = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    h_v = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.rand(rows, generator=g, dtype=torch.float64)
    weights[::4] = 0
    labels[::4] = -100
    return h_d, h_v, w_head, labels, weights


def _run(h_d, h_v, w_head, labels, weights, device, dtype, **kw):
    """Loss, gradient w.r.t. drafter_hidden and stats of ``verifier_loss`` on ``device`` / ``dtype``."""
    hd = h_d.detach().to(device, dtype, copy=True).requires_grad_()  # a fresh leaf, never the input
    coefs = {name: kw.get(name, term.default) for name, term in BY_NAME.items()}
    needs_verifier = needs_verifier_logits(coefs, verifier_metrics=False)
    out = verifier_loss(
        hd,
        h_v.to(device, dtype) if needs_verifier else None,
        w_head.to(device, dtype),
        labels.to(device),
        weights.to(device, torch.float32 if dtype != torch.float64 else dtype),
        **kw,
    )
    out.loss.backward()
    return out.loss.detach().double().cpu(), hd.grad.double().cpu(), out.stats


@pytest.mark.parametrize("chunk", [64, 1000])
@pytest.mark.parametrize("mix", MIXES, ids=["ce", "ce+kl", "all,T=2"])
def test_cuda_fp32_equals_the_cpu_fp64_loss(mix, chunk):
    inputs = _inputs()
    ref_loss, ref_grad, ref_stats = _run(*inputs, "cpu", torch.float64, **mix)
    loss, grad, stats = _run(*inputs, "cuda", torch.float32, chunk_size=chunk, **mix)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-4 * ref_grad.abs().max().item())
    assert torch.equal(stats.drafter_argmax.cpu(), ref_stats.drafter_argmax)
    assert torch.equal(stats.data_hit.cpu(), ref_stats.data_hit)


@pytest.mark.parametrize("mix", MIXES[1:], ids=["ce+kl", "all,T=2"])
def test_cuda_bf16_inputs_accumulate_in_fp32(mix):
    # The reference runs in fp64 on the same bf16-rounded values, so only accumulation differs.
    h_d, h_v, w_head, labels, weights = (
        x.bfloat16().double() if x.is_floating_point() else x for x in _inputs()
    )
    ref_loss, ref_grad, _ = _run(h_d, h_v, w_head, labels, weights, "cpu", torch.float64, **mix)
    hd = h_d.detach().to("cuda", torch.bfloat16, copy=True).requires_grad_()
    out = verifier_loss(
        hd,
        h_v.to("cuda", torch.bfloat16),
        w_head.to("cuda", torch.bfloat16),
        labels.cuda(),
        weights.float().cuda(),
        chunk_size=128,
        **mix,
    )
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and hd.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss.double().cpu(), ref_loss, rtol=1e-4, atol=0)
    # bf16 gradient: G is rounded to bf16 for the G @ W GEMM and dh is stored in bf16
    torch.testing.assert_close(
        hd.grad.double().cpu(), ref_grad, rtol=3e-2, atol=3e-2 * ref_grad.abs().max().item()
    )


def test_cuda_compiled_block_math_equals_eager():
    inputs = _inputs()
    mix = MIXES[2]
    eager = _run(*inputs, "cuda", torch.float32, chunk_size=96, **mix)
    compiled = _run(*inputs, "cuda", torch.float32, chunk_size=96, compile=True, **mix)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-4, atol=1e-4 * eager[1].abs().max().item())


@pytest.mark.parametrize("layout", [{}, SLIDING], ids=["full", "sliding"])
def test_compiled_flex_attention_equals_dense_sdpa_forward_and_backward(layout):
    torch.manual_seed(0)
    model = DFlashDraftModel(tiny_arch(**layout)).float().cuda()
    pos, doc, anchors, ids, aux, emb = (t.cuda() for t in tiny_batch())
    aux, emb = aux.float(), emb.float()
    blocks = make_blocks(ids, pos, doc, anchors, BS, MASK_ID)
    noise = emb[blocks.block_ids]
    outs, grads = {}, {}
    for kind in ("sdpa", "flex"):
        model.zero_grad(set_to_none=True)
        out = model(noise, aux, pos, blocks.block_positions, masks_for(model, anchors, doc, kind))
        out.square().mean().backward()
        outs[kind] = out.detach()
        grads[kind] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(outs["flex"], outs["sdpa"], atol=1e-4, rtol=1e-4)
    assert grads["flex"].keys() == grads["sdpa"].keys() and grads["sdpa"]
    for name, g in grads["sdpa"].items():
        torch.testing.assert_close(grads["flex"][name], g, atol=1e-4 * (1 + g.abs().max().item()), rtol=1e-3)


def _bf16_step(model, noise, aux, pos, blocks, masks):
    """One training forward and backward under bf16 autocast: (fp32 output, parameter gradients)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", torch.bfloat16):
        out = model(noise, aux, pos, blocks.block_positions, masks)
    out.float().square().mean().backward()
    return out.detach().float(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-layers", "compiled-layers"])
@pytest.mark.parametrize("layout", [{}, SLIDING], ids=["full", "sliding"])
def test_bf16_autocast_compiled_flex_equals_dense_sdpa_forward_and_backward(layout, compiled):
    """The training path as the trainer runs it on a GPU: fp32 master weights under bf16 autocast, the
    target's taps in bf16, q/k/v in bf16 into compiled flex_attention, eager layers or each layer
    compiled (``compile_layers``, static shapes, with per-layer checkpointing around it), against
    eager dense SDPA under the same autocast. bf16 tolerances; no graph break in a compiled layer."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = DFlashDraftModel(tiny_arch(**layout)).cuda()
    pos, doc, anchors, ids, aux, emb = (t.cuda() for t in tiny_batch())
    aux, emb = aux.bfloat16(), emb.float()
    blocks = make_blocks(ids, pos, doc, anchors, BS, MASK_ID)
    noise = emb[blocks.block_ids]
    dense, dense_grads = _bf16_step(model, noise, aux, pos, blocks, masks_for(model, anchors, doc, "sdpa"))
    if compiled:
        model.compile_layers(dynamic=False)
        model.checkpoint_layers = True
    flex, flex_grads = _bf16_step(model, noise, aux, pos, blocks, masks_for(model, anchors, doc, "flex"))
    scale = dense.abs().max().item()
    torch.testing.assert_close(flex, dense, atol=3e-2 * scale, rtol=3e-2)
    assert flex_grads.keys() == dense_grads.keys() and dense_grads
    for name, g in dense_grads.items():
        assert flex_grads[name].dtype == torch.float32  # fp32 master gradients
        torch.testing.assert_close(flex_grads[name], g, atol=5e-2 * (1e-6 + g.abs().max().item()), rtol=5e-2)
    if compiled:
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] >= model.arch.num_layers


def _cuda_packet(seed: int):
    pos, doc, anchors, ids, aux, emb = (t.cuda() for t in tiny_batch(seed))
    blocks = make_blocks(ids, pos, doc, anchors, BS, MASK_ID)
    return emb.float()[blocks.block_ids], aux.float(), pos, blocks.block_positions, anchors, doc


def test_compiled_layers_with_flex_equal_eager_layers_on_cuda():
    """fp32, compiled flex in both: each layer compiled (static shapes) equals the eager layers in
    forward and backward to fp32 rounding, and the next packet (same shapes, new anchors, a new block
    mask and mask_mod closure, as every training step builds) compiles nothing new."""
    from torch._dynamo.utils import counters

    noise, aux, pos, block_pos, anchors, doc = _cuda_packet(0)
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = DFlashDraftModel(tiny_arch(**SLIDING)).cuda()
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            model.compile_layers(dynamic=False)
        out = model(noise, aux, pos, block_pos, masks_for(model, anchors, doc, "flex"))
        out.square().mean().backward()
        runs.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    graphs = counters["stats"]["unique_graphs"]
    noise, aux, pos, block_pos, anchors, doc = _cuda_packet(1)
    assert anchors.shape == _cuda_packet(0)[4].shape
    model(noise, aux, pos, block_pos, masks_for(model, anchors, doc, "flex")).sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs
    (eager, eager_grads), (comp, comp_grads) = runs
    torch.testing.assert_close(comp, eager, atol=1e-4, rtol=1e-4)
    for name, g in eager_grads.items():
        torch.testing.assert_close(comp_grads[name], g, atol=1e-4 * (1 + g.abs().max().item()), rtol=1e-3)


@pytest.mark.parametrize("autocast", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_chunked_step_with_compiled_flex_equals_the_whole_packet(autocast):
    """The trainer's CUDA step (compiled layers, compiled flex on the static shape, padded context and
    chunks padded to ``StepPlan.chunk_anchors`` blocks) in 3 chunks equals the whole packet at once:
    the loss and every gradient, to fp32 rounding, or under bf16 autocast to its rounding."""
    import dataclasses

    from tiny_drafter import CHUNK_ANCHORS, CHUNK_BS, chunk_arch, chunk_packet

    from dflash.config import LossConfig
    from dflash.drafter.step import StepPlan, objective_step, packet_anchors

    p = chunk_packet()
    dev = {k: v.cuda() for k, v in p.items() if k not in ("positions", "loss_mask")}
    plan = StepPlan(LossConfig(), CHUNK_BS, "flex", "cuda", autocast, (48, 16), None, None, 0, 1.0)
    runs = []
    for chunks in (1, 3):
        torch.manual_seed(0)
        model = DFlashDraftModel(chunk_arch("dflash")).cuda()
        model.compile_layers(dynamic=False)
        step = dataclasses.replace(plan, block_chunks=chunks)
        anchors = packet_anchors(step, p["positions"], p["loss_mask"], torch.tensor(CHUNK_ANCHORS), 12)
        out = objective_step(
            model,
            dev["embed"],
            dev["head"],
            dev["aux"],
            dev["final"],
            dev["ids"],
            p["loss_mask"][0].cuda(),
            anchors,
            step,
        )
        out.loss.backward()
        runs.append((out.loss.detach().float(), {n: q.grad.float() for n, q in model.named_parameters()}))
    (whole, whole_grads), (chunked, chunked_grads) = runs
    tol = 1e-5 if autocast == torch.float32 else 2e-2
    torch.testing.assert_close(chunked, whole, rtol=tol, atol=0)
    for name, g in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], g, rtol=tol, atol=tol * (1 + float(g.abs().max())))
