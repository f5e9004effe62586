"""The drafter step on one packet: the one function the trainer, the real-size rehearsal and the
periodic eval run, so the rehearsal cannot drift from what trains.

:class:`StepPlan` is what a run's step needs, resolved once (the attention kernel and the autocast
of the device, the static shape a compiled flex kernel needs, how anchors are drawn);
:func:`plan_anchors` draws a packet's anchors on the host from its host copies (no device read,
and what the host then knows, the supervised rows and the positions their verifier rows read, goes
with them); :func:`objective_step`
runs blocks -> drafter -> chunked verifier-logit loss under the plan's autocast and returns the
objective's loss and metric sums (:class:`dflash.drafter.objective.ObjectiveOutput`). The backward
stays with the caller: the trainer's gradient reduction, the rehearsal's memory accounting, none in
the eval.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.config import Config, LossConfig
from dflash.config.resolve import drafter_attention, torch_dtype
from dflash.drafter.blocks import eligible_anchors, offered_anchors, sample_anchors
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.objective import (
    ObjectiveOutput,
    dflash_loss,
    pad_to_static,
    sum_outputs,
    supervised_positions,
)
from dflash.targets.packing import doc_ids_from_positions, packet_positions


def anchor_generator(seed: int, packet: int) -> torch.Generator:
    """Anchors of packet g depend only on (seed, g): resume samples exactly what a straight run does."""
    return torch.Generator().manual_seed(seed * 1_000_003 + packet)


NOISE_ROWS = 4096
"""Rows of context hidden states one noise draw covers (bounds the temporary to ``NOISE_ROWS x n_tap*H``)."""
NOISE_STREAM = 1 << 48
"""Offsets the noise generator's seed from the anchors' (the same (seed, g) would correlate them)."""


def add_hidden_noise_(aux_hidden: Tensor, std: float, seed: int, packet: int) -> Tensor:
    """Add ``std`` x N(0, 1) to ``aux_hidden`` [T, n_tap*H] in place and return it: the noise of packet
    g depends only on (seed, g, the device type), drawn in its dtype on its device, ``NOISE_ROWS`` rows
    at a time, so a resumed run adds exactly what a straight run does. In place: a received packet's
    hidden states serve its step alone (its buffer is released after the step's compute)."""
    generator = torch.Generator(device=aux_hidden.device).manual_seed(
        seed * 1_000_003 + packet + NOISE_STREAM
    )
    for start in range(0, aux_hidden.shape[0], NOISE_ROWS):
        rows = aux_hidden[start : start + NOISE_ROWS]
        noise = torch.randn(rows.shape, generator=generator, device=rows.device, dtype=rows.dtype)
        rows.add_(noise, alpha=std)
    return aux_hidden


@dataclass(frozen=True)
class StepPlan:
    """What every packet's step of a run shares."""

    loss: LossConfig
    block_size: int
    attention: str
    """``sdpa`` or ``flex`` (``drafter.attention`` resolved for the device the run plans for)."""
    autocast_device: str
    """The device type the step's tensors are on (autocast's device)."""
    autocast_dtype: torch.dtype
    """float32: no autocast."""
    static_shape: tuple[int, int] | None
    """``(context rows, blocks)`` every step is padded to (a compiled flex kernel compiles once)."""
    num_anchors: int | None
    """Anchors drawn per sample; None: every eligible anchor (the eval)."""
    max_anchors: int | None
    seed: int
    normalizer: float | None
    """The loss is ``sum_r w_r l_r / normalizer`` (None: this packet's ``sum_r w_r``)."""
    block_chunks: int = 1
    """The packet's blocks run in this many chunks of whole blocks (:func:`objective_step`); 1: all
    at once. More needs a ``normalizer`` (a chunk's loss is then a part of the packet's sum)."""
    hidden_noise_std: float = 0.0
    """Training: the standard deviation of the Gaussian noise added to the context hidden states
    (:func:`add_hidden_noise_`; ``drafter.hidden_noise_std``); 0 in the eval."""
    skip_empty_chunks: bool = False
    """Chunks holding no anchor are not run (:func:`packet_anchors`): a drafter whose step has no
    collective inside it (replicated), so that a static shape costs the blocks a packet has, rounded
    up to a chunk, not the cap's. A sharded drafter (FSDP2: collectives per layer and chunk) runs
    them all, as every drafter must run as many."""

    def __post_init__(self) -> None:
        if self.block_chunks < 1:
            raise ValueError(f"block_chunks={self.block_chunks}: must be >= 1")
        if self.block_chunks > 1 and self.normalizer is None:
            raise ValueError(
                "block_chunks > 1 needs a normalizer: the packet's own weight sum is not known per chunk"
            )

    def chunk_anchors(self, num_anchors: int) -> int:
        """Anchors per chunk for a packet of ``num_anchors`` (the static cap with flex)."""
        total = self.static_shape[1] if self.static_shape is not None else num_anchors
        return max(1, -(-total // self.block_chunks))

    @classmethod
    def for_training(
        cls,
        cfg: Config,
        block_size: int,
        *,
        device: str,
        token_budget: int,
        tensors_on: str | None = None,
        block_chunks: int = 1,
        skip_empty_chunks: bool = False,
    ) -> StepPlan:
        """The trainer's step on ``device`` (``tensors_on``: where the tensors live when it differs,
        the rehearsal's CPU fake tensors of a planned GPU) in ``block_chunks`` chunks
        (``drafter.block_chunks`` resolved; ``skip_empty_chunks``: the drafter is not sharded); the
        loss is a weighted sum (``normalizer=1``) that the trainer divides once by the step's global
        weight sum."""
        d = cfg.drafter
        attention = drafter_attention(d.attention, device)
        cap = d.max_anchors_per_packet  # required with flex in training (dflash.config.checks)
        static = (token_budget, cap) if attention == "flex" and cap is not None else None
        return cls(
            loss=cfg.loss,
            block_size=block_size,
            attention=attention,
            autocast_device=tensors_on or device,
            autocast_dtype=torch_dtype(d.dtype, torch.device(device)),
            static_shape=static,
            num_anchors=d.num_anchors,
            max_anchors=d.max_anchors_per_packet,
            seed=cfg.train.seed,
            normalizer=1.0,
            block_chunks=block_chunks,
            hidden_noise_std=d.hidden_noise_std,
            skip_empty_chunks=skip_empty_chunks,
        )

    @classmethod
    def for_eval(cls, cfg: Config, block_size: int, *, device: str) -> StepPlan:
        """The periodic eval's estimate: every eligible anchor of a conversation, SDPA (no static
        shape), the loss normalised by the conversation's own weights."""
        return cls(
            loss=cfg.loss,
            block_size=block_size,
            attention="sdpa",
            autocast_device=device,
            autocast_dtype=torch_dtype(cfg.drafter.dtype, torch.device(device)),
            static_shape=None,
            num_anchors=None,
            max_anchors=None,
            seed=cfg.train.seed,
            normalizer=None,
        )

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.autocast_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast_device, dtype=self.autocast_dtype)


@dataclass(frozen=True)
class PacketAnchors:
    """A packet's anchors and what the host knows of them (all host tensors and ints)."""

    positions: Tensor
    """[1, T] RoPE positions restarting at 0 per document."""
    anchors: Tensor
    """[1, N] anchor positions, -1 padding."""
    verifier_positions: Tensor
    """[R] sorted: the position each supervised slot's verifier row is at (``supervised_positions``)."""
    offered: int
    """The anchors ``drafter.num_anchors`` offers before ``max_anchors_per_packet``."""
    chunks: list[tuple[Tensor, Tensor]]
    """Per chunk of whole blocks (``StepPlan.block_chunks``; one when unchunked): its anchors [1, n]
    (a slice of :attr:`anchors`) and the verifier positions of its supervised slots [R_c]."""
    packet: int | None = None
    """The packet's index g (:func:`plan_anchors`): what seeds its hidden-state noise."""

    @property
    def num_blocks(self) -> int:
        return int((self.anchors >= 0).sum())

    @property
    def num_rows(self) -> int:
        """R: the supervised slots of these blocks."""
        return int(self.verifier_positions.numel())

    @property
    def verifier_rows(self) -> int:
        """The distinct positions the supervised slots' verifier rows are at."""
        return int(torch.unique_consecutive(self.verifier_positions).numel())


def plan_anchors(plan: StepPlan, seq_lens: Tensor, loss_mask: Tensor, index: int) -> PacketAnchors:
    """The anchors of packet ``index`` from its host copies: ``seq_lens`` [S] and ``loss_mask`` [T]
    (CPU tensors; the drafter's tensors stay where they are: no device read)."""
    total = int(loss_mask.numel())
    positions = packet_positions(seq_lens, total).unsqueeze(0)
    docs = doc_ids_from_positions(positions)
    mask = loss_mask.unsqueeze(0)
    if plan.num_anchors is None:
        anchors = eligible_anchors(mask, docs)[0].nonzero().view(1, -1)
        offered = int(anchors.numel())
    else:
        offered = int(offered_anchors(mask, docs, plan.num_anchors))
        generator = anchor_generator(plan.seed, index)
        anchors = sample_anchors(mask, docs, plan.num_anchors, generator, plan.max_anchors)
    return packet_anchors(plan, positions, mask, anchors, offered, packet=index)


def packet_anchors(
    plan: StepPlan,
    positions: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    offered: int,
    *,
    packet: int | None = None,
) -> PacketAnchors:
    """:class:`PacketAnchors` of given anchors [1, N] (-1: padding) of a packet at ``positions`` /
    ``loss_mask`` [1, T] (host tensors), cut into ``plan.block_chunks`` chunks of
    ``plan.chunk_anchors(N)`` consecutive anchors (the last one holding anchors may be partial; the
    ones after it are empty): every drafter then runs as many forwards, which FSDP2's per-layer
    collectives need; with ``plan.skip_empty_chunks`` the empty ones are dropped (one chunk is kept)."""
    docs = doc_ids_from_positions(positions)
    size = plan.chunk_anchors(int(anchors.shape[1]))
    slices = [anchors[:, i * size : (i + 1) * size] for i in range(plan.block_chunks)]
    if plan.skip_empty_chunks:
        slices = [a for a in slices if bool((a >= 0).any())] or slices[:1]
    chunks = [(a, supervised_positions(loss_mask, docs, a, plan.block_size)) for a in slices]
    whole = chunks[0][1] if len(chunks) == 1 else torch.cat([p for _, p in chunks]).sort().values
    return PacketAnchors(positions, anchors, whole, offered, chunks, packet)


def objective_step(
    model: DFlashDraftModel,
    embed: Tensor,
    head: Tensor,
    aux_hidden: Tensor,
    final_hidden: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: PacketAnchors,
    plan: StepPlan,
    *,
    on_phase: Callable[[str], None] | None = None,
    selector_scale: float | None = None,
    partial_backward: Callable[[Tensor], None] | None = None,
) -> ObjectiveOutput:
    """blocks -> drafter -> chunked loss for one packet: ``aux_hidden`` [T, n_tap*H],
    ``final_hidden`` [T, H], ``input_ids`` / ``loss_mask`` [T] on the step's device; ``anchors`` from
    :func:`plan_anchors` (moved without a host sync); ``embed`` / ``head`` [V, H] frozen target
    tensors. ``on_phase(name)``: called when the drafter forward and the loss end (step timing);
    ``selector_scale``: DFlash2's selector coefficient at this step (None: ``loss.selector``).
    With ``plan.hidden_noise_std`` (training) the packet's noise is first added to ``aux_hidden``
    in place (:func:`add_hidden_noise_`).

    With several chunks (``plan.block_chunks``) the context's keys and values are computed once
    and each chunk of whole blocks runs forward, loss and, when gradients are on, backward
    (``partial_backward``, default ``Tensor.backward``: a backward that is not the packet's last)
    before the next starts, so only one chunk's activations live at a time and nothing is
    recomputed. What each chunk's backward leaves on the context's keys and values is summed and
    sent back through the context projections and ``fc`` by the returned loss's backward, together
    with the last chunk's. The returned loss has the packet's value and completes its gradient;
    every sum is the packet's."""
    device = input_ids.device
    positions = anchors.positions.to(device, non_blocking=True)
    if plan.hidden_noise_std > 0:
        if anchors.packet is None:
            raise ValueError(
                "hidden-state noise needs the packet's index: anchors from plan_anchors(..., index)"
            )
        aux_hidden = add_hidden_noise_(aux_hidden, plan.hidden_noise_std, plan.seed, anchors.packet)
    args = (
        aux_hidden.unsqueeze(0),
        final_hidden.unsqueeze(0),
        input_ids.unsqueeze(0),
        loss_mask.unsqueeze(0),
    )
    with plan.autocast():
        if plan.block_chunks == 1:
            return dflash_loss(
                model,
                *args,
                anchors.anchors.to(device, non_blocking=True),
                embed,
                head,
                plan.loss,
                position_ids=positions,
                attention=plan.attention,
                static_shape=plan.static_shape,
                on_phase=on_phase,
                normalizer=plan.normalizer,
                num_rows=anchors.num_rows,
                selector_scale=selector_scale,
                verifier_positions=anchors.verifier_positions,
            )
        return _chunked_step(
            model, embed, head, args, positions, anchors, plan, on_phase, selector_scale, partial_backward
        )


def _chunked_step(
    model, embed, head, args, positions, anchors, plan, on_phase, selector_scale, partial_backward
) -> ObjectiveOutput:
    """:func:`objective_step` over ``anchors.chunks`` (see there)."""
    aux, final, ids, mask = args
    device = ids.device
    size = plan.chunk_anchors(int(anchors.anchors.shape[1]))
    static = None
    if plan.static_shape is not None:  # the context padded once; each chunk's blocks to ``size``
        static = (plan.static_shape[0], size)
        first = anchors.chunks[0][0]  # a chunk of ``size`` anchors (or the packet's only, fewer)
        aux, ids, mask, positions, _ = pad_to_static(aux, ids, mask, positions, first, *static)
    context = model.context_states(aux, positions)
    training = any(t.requires_grad for kv in context for t in kv)
    backward = partial_backward or Tensor.backward
    leaves = [tuple(t.detach().requires_grad_() for t in kv) for kv in context] if training else context
    sums: list[Tensor] | None = None  # what the chunks before the last left on ``leaves``
    outs: list[ObjectiveOutput] = []
    for i, (chunk, rows) in enumerate(anchors.chunks):
        last = i == len(anchors.chunks) - 1
        out = dflash_loss(
            model,
            aux,
            final,
            ids,
            mask,
            chunk.to(device, non_blocking=True),
            embed,
            head,
            plan.loss,
            position_ids=positions,
            attention=plan.attention,
            static_shape=static,
            on_phase=on_phase,
            normalizer=plan.normalizer,
            num_rows=int(rows.numel()),
            selector_scale=selector_scale,
            verifier_positions=rows,
            context_kv=context if last else leaves,
        )
        if training and not last:
            if out.loss.requires_grad:  # an empty chunk has no graph
                backward(out.loss)
            out.loss = out.loss.detach()
            sums = _add_grads(sums, [t for kv in leaves for t in kv])
            if on_phase is not None:
                on_phase("backward")
        outs.append(out)
    loss = outs[-1].loss
    if sums is not None:  # the chunks' gradients on the context: a term of value exactly 0
        carrier = sum((t * g).sum() for t, g in zip([t for kv in context for t in kv], sums, strict=True))
        loss = loss + (carrier - carrier.detach())
    return sum_outputs(outs, loss)


def _add_grads(sums: list[Tensor] | None, leaves: list[Tensor]) -> list[Tensor]:
    """``sums`` plus the leaves' gradients (taken off them), at least in fp32."""
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    for t in leaves:
        t.grad = None
    if sums is None:
        return [g.to(torch.promote_types(g.dtype, torch.float32)) for g in grads]
    for s, g in zip(sums, grads, strict=True):
        s.add_(g)
    return sums
