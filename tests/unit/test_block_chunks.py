"""The block-chunked drafter step (``objective_step`` with ``StepPlan.block_chunks > 1``) against the
whole packet at once: the same loss, sums and every parameter gradient to 1e-6 relative in fp32,
with packed documents, sliding-window and full layers, padding blocks, each loss recipe and both
drafter families; and what fails when a chunk's gradient on the context is dropped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_drafter import CHUNK_ANCHORS, CHUNK_BS, CHUNK_V, chunk_arch, chunk_packet

import dflash.drafter.step as step_module
from dflash.config import LossConfig
from dflash.drafter.dflash2 import DFlash2DraftModel
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.step import StepPlan, objective_step, packet_anchors

BS, V = CHUNK_BS, CHUNK_V
RECIPES = {
    "ce": dict(ce=1.0, gamma=4.0),
    "ce_kl": dict(ce=1.0, kl=0.5, temperature=2.0),
    "dpace": dict(ce=1.0, dpace=0.5),
}


def _step(
    model, p, recipe: str, chunks: int, static: tuple[int, int] | None = None, skip: bool = False, calls=None
):
    """Loss, output and every parameter's gradient of one packet in ``chunks`` chunks (``static``:
    the static shape the trainer pads to for compiled flex, its context rows and blocks; ``skip``:
    the chunks holding no anchor are not run; ``calls``: a list the chunks run are counted in)."""
    loss_cfg = dataclasses.replace(LossConfig(), **RECIPES[recipe])
    plan = StepPlan(
        loss=loss_cfg,
        block_size=BS,
        attention="sdpa",
        autocast_device="cpu",
        autocast_dtype=torch.float32,
        static_shape=static,
        num_anchors=None,
        max_anchors=None,
        seed=0,
        normalizer=1.0,
        block_chunks=chunks,
        skip_empty_chunks=skip,
    )
    anchors = packet_anchors(plan, p["positions"], p["loss_mask"], torch.tensor(CHUNK_ANCHORS), 12)
    if calls is not None:
        calls.append(len(anchors.chunks))
    model.zero_grad(set_to_none=True)
    out = objective_step(
        model, p["embed"], p["head"], p["aux"], p["final"], p["ids"], p["loss_mask"][0], anchors, plan
    )
    out.loss.backward()
    return out, {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}


def _model(family: str) -> DFlashDraftModel:
    torch.manual_seed(0)
    cls = DFlash2DraftModel if family == "dflash2" else DFlashDraftModel
    model = cls(chunk_arch(family))
    if family == "dflash2":  # away from the identity start, so the convolutions mix the slots
        with torch.no_grad():
            for conv in model.convolutions():
                conv.kernel_projection.weight.normal_(0, 0.05)
    return model


def _assert_same(whole, chunked) -> None:
    (out_w, grads_w), (out_c, grads_c) = whole, chunked
    torch.testing.assert_close(out_c.loss, out_w.loss, rtol=1e-6, atol=0)
    for name in ("weight_sum", "tau_sum", "slot_hit", "slot_count", "term_sums", "selector_sums"):
        torch.testing.assert_close(getattr(out_c, name), getattr(out_w, name), rtol=1e-6, atol=1e-9)
    assert out_c.num_rows == out_w.num_rows
    assert grads_c.keys() == grads_w.keys()
    for name, g in grads_w.items():
        scale = float(g.abs().max())
        torch.testing.assert_close(grads_c[name], g, rtol=1e-6, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("family", ["dflash", "dflash2"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_chunked_step_equals_the_whole_packet(family, recipe):
    model, p = _model(family), chunk_packet()
    whole = _step(model, p, recipe, 1)
    assert (
        whole[1]["fc.weight"].abs().max() > 0 and whole[1]["layers.0.self_attn.k_proj.weight"].abs().max() > 0
    )
    for chunks in (2, 3, 14, 17):  # 14: one block per chunk; 17: three chunks empty
        _assert_same(whole, _step(model, p, recipe, chunks))


def test_chunks_of_a_full_static_shape_equal_the_whole_packet():
    """The static shape (compiled flex) holding as many anchors as it allows: the context padded
    once, each chunk's blocks padded to the chunk size, the padding rows unsupervised."""
    model, p = _model("dflash"), chunk_packet()
    n, tokens = len(CHUNK_ANCHORS[0]), p["positions"].shape[1]
    whole = _step(model, p, "ce", 1, static=(tokens + 6, n))
    assert whole[0].loss == _step(model, p, "ce", 1)[0].loss  # the padding changes nothing
    for chunks in (2, 3, 14):
        _assert_same(whole, _step(model, p, "ce", chunks, static=(tokens + 6, n)))


def test_skipping_the_empty_chunks_of_a_static_shape_changes_nothing():
    """A replicated drafter under a static shape of many more blocks than the packet has (a cap set
    for the epoch's largest packet) runs only the chunks holding anchors: the same loss, sums and
    gradients as running every chunk, in fewer forwards."""
    model, p = _model("dflash"), chunk_packet()
    tokens = p["positions"].shape[1]
    static = (tokens + 6, 40)  # 40 blocks: the packet's 14 (12 real) fill 3 of 8 chunks of 5
    every, skipped = [], []
    whole = _step(model, p, "ce", 8, static=static, calls=every)
    _assert_same(whole, _step(model, p, "ce", 8, static=static, skip=True, calls=skipped))
    _assert_same(_step(model, p, "ce", 1), whole)
    assert every == [8] and skipped == [3]


def test_a_dropped_context_gradient_of_a_chunk_fails_the_check(monkeypatch):
    """The check above sees a chunk whose gradient on the context keys/values is lost."""
    model, p = _model("dflash"), chunk_packet()
    whole = _step(model, p, "ce", 1)
    calls = []
    add = step_module._add_grads

    def drop_second(sums, leaves):
        calls.append(1)
        if len(calls) == 2:
            for t in leaves:
                t.grad = None
            return sums
        return add(sums, leaves)

    monkeypatch.setattr(step_module, "_add_grads", drop_second)
    chunked = _step(model, p, "ce", 3)
    assert len(calls) == 2
    with pytest.raises(AssertionError, match="fc.weight|k_proj|v_proj|k_norm"):
        _assert_same(whole, chunked)


def test_the_chunks_backward_goes_through_the_callers_backward():
    """Every chunk but the last runs ``partial_backward`` (the trainer's no-reduction backward);
    the last one's is left to the caller, with the context's."""
    model, p = _model("dflash"), chunk_packet()
    plan = dataclasses.replace(
        StepPlan(LossConfig(), BS, "sdpa", "cpu", torch.float32, None, None, None, 0, 1.0), block_chunks=4
    )
    anchors = packet_anchors(plan, p["positions"], p["loss_mask"], torch.tensor(CHUNK_ANCHORS), 12)
    assert [int(a.shape[1]) for a, _ in anchors.chunks] == [4, 4, 4, 2]  # chunks of ceil(14 / 4)
    seen = []
    out = objective_step(
        model,
        p["embed"],
        p["head"],
        p["aux"],
        p["final"],
        p["ids"],
        p["loss_mask"][0],
        anchors,
        plan,
        partial_backward=lambda loss: (seen.append(float(loss.detach())), loss.backward()),
    )
    assert len(seen) == 3 and model.fc.weight.grad is None  # fc only gets the context's gradient at the end
    out.loss.backward()
    assert model.fc.weight.grad is not None


def test_eval_without_gradients_runs_chunks_forward_only():
    model, p = _model("dflash"), chunk_packet()
    with torch.no_grad():
        whole = _step_no_grad(model, p, 1)
        chunked = _step_no_grad(model, p, 3)
    torch.testing.assert_close(chunked.loss, whole.loss, rtol=1e-6, atol=0)


def _step_no_grad(model, p, chunks):
    plan = StepPlan(
        LossConfig(), BS, "sdpa", "cpu", torch.float32, None, None, None, 0, 1.0, block_chunks=chunks
    )
    anchors = packet_anchors(plan, p["positions"], p["loss_mask"], torch.tensor(CHUNK_ANCHORS), 12)
    return objective_step(
        model, p["embed"], p["head"], p["aux"], p["final"], p["ids"], p["loss_mask"][0], anchors, plan
    )


def test_more_than_one_chunk_needs_a_normalizer():
    with pytest.raises(ValueError, match="normalizer"):
        StepPlan(LossConfig(), BS, "sdpa", "cpu", torch.float32, None, None, None, 0, None, block_chunks=2)


@pytest.mark.extended  # Inductor compiles each layer for two chunk shapes
def test_compiled_layers_run_the_chunks_as_eager_layers_do():
    """``compile_layers`` (Inductor on CPU, static shapes): the chunked step's loss and gradients equal
    the eager chunked step's, the compiled layers taking the context's keys and values (leaves for
    the first chunks, the attached tensors for the last) without a graph break."""
    from torch._dynamo.utils import counters

    p = chunk_packet()
    eager = _step(_model("dflash"), p, "ce", 3)
    torch._dynamo.reset()
    counters.clear()
    model = _model("dflash")
    model.compile_layers(dynamic=False)
    compiled = _step(model, p, "ce", 3)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(compiled[0].loss, eager[0].loss, rtol=1e-5, atol=0)
    for name, g in eager[1].items():
        torch.testing.assert_close(compiled[1][name], g, rtol=1e-4, atol=1e-5 * (1 + float(g.abs().max())))
