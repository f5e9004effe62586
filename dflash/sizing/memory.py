"""Memory per GPU for each role (GiB by item): the planner's memory model (pure Python, no torch).

The element counts below are what the code allocates, read off the real-size rehearsal
(:mod:`dflash.plan.rehearse`: the training step of each role on fake tensors with the GPU code paths),
which ``tests/unit/test_rehearse.py`` holds them to within 5% per role for every shipped experiment.
Notation: ``H`` hidden, ``A = nh*hd`` query width, ``K = nkv*hd`` key/value width, ``F`` FFN, ``V``
vocabulary, ``n_tap`` taps, ``a`` target dtype bytes, ``P`` trainable drafter parameters, ``T``
packet tokens, ``Q = blocks * block_size`` block tokens and ``S`` context rows of the drafter (both
padded to the static flex shape), ``R`` loss rows, ``C`` loss chunk rows.

Target rank: weights (every parameter in the target dtype; the lm_head is loaded, never run; all
experts of a mixture-of-experts target; on a tensor-parallel replica each rank holds ``1/k`` of every
part the plan splits, :class:`dflash.targets.tp.TpLayout`, and the rest whole), the
``max_in_flight`` packets not yet acknowledged, and the forward of the next packet: the tap buffer
``T*n_tap*H*a`` plus the largest working set of one layer (inference mode keeps nothing between layers):

- MLP: ``(4H + 3F)*a`` per computed token (input, residual, norm output; gate/up, SiLU, product;
  a mixture of experts ``3*(k_e*F_e + F_s) + E`` in place of ``3F``; a split part's share on a TP rank);
- full attention: ``(3H + (g + 2)*A + K)*a`` per token (``g = 2`` with an output gate: q, gate,
  repeated k and v, RoPE'd q and k) plus, with a dense-attention kernel, per row of ``r`` tokens the
  boolean mask and the additive mask SDPA makes of it before its CUDA kernels: ``r*r*(2 + a)`` (the
  boolean ``r*r`` in every other stage too: it is made once per forward);
- Gated DeltaNet (hybrid targets, transformers' torch fallback, fp32): ``4*nv*(10*dv + 3*64)`` per
  token plus its conv and gate rows ``(2*dk + 2*dv)*a`` and ``3H*a``.

Drafter rank (bf16 autocast, the GPU default; fp32 runs count 4 bytes and no casts):

- weights, gradients and the optimizer's state: ``4P + 4P + 8P`` (fp32 master weights, AdamW's two
  moments; ``optim=muon``: ``4P`` of state, one momentum buffer per matrix, and ``P`` counts only
  matrices, DFlash2's codebooks and convolution base kernels keeping AdamW's ``8`` per parameter), divided by the
  drafters that share them with ``drafter.shard`` (:func:`drafter_state`:
  ``optimizer`` also holds the whole weights for the step, ``full`` four layer-sized buffers in backward);
- the frozen embedding and lm_head ``2*V*H*a`` (a co-located rank uses the target's own);
- one packet (the one being trained on; the next one's receive posts only its header), and, when
  it holds fewer tokens than the static shape ``S``, its hidden states grown to ``S`` rows
  (``S*(n_tap + 1)*H*a``, live for the whole step);
- activations saved for backward, per layer ``Q*(20H + 10A + 10K + 8F + 12nh + 4nkv + 16) +
  S*(10K + 4nkv)`` bytes (fp32 residual stream and norms, one bf16 copy per GEMM-input group: the
  normed states for q, k and v, the MLP input for gate and up; bf16 GEMM outputs, flex's output and
  log-sum-exp) plus the bf16 copy of the layer's weights that autocast caches, and once ``S*8H`` (the
  context norm and the context's one bf16 copy, read by every layer's k and v; ``fc`` reads the
  packet's bf16 taps themselves), ``Q*10H`` (noise embedding, final norm), ``2*n_tap*H*H`` (fc's bf16
  weight) and RoPE tables ``8*rd*(Q + S)``;
- with per-layer checkpointing (``drafter.activation_checkpointing``) the layers keep only their
  inputs ``(L + 1)*Q*4H`` (and the context, already counted); the peak is the larger of the loss (weight casts
  still cached) and the backward of one layer (its activations recomputed, ``Q*(4H + 4F)`` of gradients);
- the loss workspace: ``(C + C_v + 2*256)*V*4`` (the drafter logit chunk, the verifier's chunk of
  the ``C_v = min(C, C*U/R + B)`` distinct positions a chunk's rows read (``U`` of them in all), the
  256-row scratch and the rows' gathered verifier softmax; ``(2C + 256)*V*4`` when no two rows share
  a position, ``C*V*4`` without a verifier), the bf16 copy of a gradient chunk ``C*V*2``, the
  gathered drafter rows and their gradient ``2*R*H*4`` and ``C*H*4``.

Co-located rank: the target's weights, the drafter's state, one packet, and the larger of the target
forward and the drafter step's transient (activations and loss workspace).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash.config import TargetShape
from dflash.config.resolve import drafter_sharded
from dflash.drafter.families import family_costs
from dflash.sizing.costs import AttentionKind, PacketShape, loss_rows, verifier_positions
from dflash.targets.families import described_fields, params_by_part, weights_message, working_bytes_per_token
from dflash.targets.tp import TpLayout

if TYPE_CHECKING:
    from dflash.drafter.arch import DrafterArch

GIB = 2**30
STATE_BYTES_PER_PARAM = {"adamw": 8, "muon": 4}
"""fp32 optimizer state per trainable parameter by ``optim.name``: AdamW's two moments, Muon's one
momentum buffer (the norms, which AdamW updates under Muon too, are not counted in ``P``)."""
CUDA_ROW_BLOCK = 256
"""Rows of the loss's elementwise scratch on CUDA (``dflash.loss.verifier``)."""
SHARD_MODES = ("none", "optimizer", "full")


@dataclass(frozen=True)
class RunDtypes:
    """Element sizes of a run and where its kernels run."""

    target_bytes: int = 2
    """bf16 target (weights, hidden states on the wire, frozen embedding and lm_head)."""
    autocast: bool = True
    """The drafter computes under bf16 autocast (fp32 master weights); False: fp32 throughout."""
    cuda: bool = True
    """CUDA kernels (the loss's bf16 GEMM operands); False: CPU ones."""


@dataclass(frozen=True)
class DrafterSettings:
    """Memory levers of a drafter rank."""

    checkpoint: bool = False
    """Per-layer activation checkpointing."""
    shard: str = "none"
    """``drafter.shard``: none, optimizer (AdamW state and gradients sharded) or full (weights too)."""
    num_drafters: int = 1
    """Drafters the state is sharded over."""
    optimizer: str = "adamw"
    """``optim.name``: the optimizer state per parameter (:data:`STATE_BYTES_PER_PARAM`)."""
    block_chunks: int = 1
    """``drafter.block_chunks`` resolved: the packet's blocks in this many chunks."""

    @property
    def sharded(self) -> bool:
        """FSDP2 over the drafters (:func:`dflash.config.resolve.drafter_sharded`); else replicated,
        whose step skips a static shape's empty chunks (:attr:`dflash.drafter.step.StepPlan.skip_empty_chunks`)."""
        return drafter_sharded(self.shard, self.num_drafters)


PLAIN = DrafterSettings()
"""No checkpointing, no sharding."""


def target_rank_params(target: TargetShape, layout: TpLayout | None) -> float:
    """Parameters one rank of a ``layout.tp_size``-rank replica holds (``layout=None``: the whole target)."""
    parts = params_by_part(target)
    if layout is None:
        return float(sum(parts.values()))
    return sum(v / layout.tp_size if layout.split(k) else float(v) for k, v in parts.items())


def drafter_layer_params(drafter: DrafterArch) -> int:
    """Weights of one drafter decoder layer (q, k, v, o projections and the SwiGLU MLP)."""
    h = drafter.hidden_size
    nh, nkv, hd = drafter.num_heads, drafter.num_kv_heads, drafter.head_dim
    return 2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * drafter.intermediate_size


def drafter_num_params(drafter: DrafterArch) -> int:
    """Trainable drafter parameters: decoder layers and ``fc`` (the norms are negligible), and the
    family's own (DFlash2: convolutions and selector, ``dflash.drafter.families``)."""
    own = int(family_costs(drafter).extra_params(drafter))
    return (
        drafter.num_layers * drafter_layer_params(drafter) + drafter.num_taps * drafter.hidden_size**2 + own
    )


def payload_bytes(packet: PacketShape, num_taps: int, hidden: int, dtype_bytes: int) -> int:
    """One packet's tensors: hidden states, input ids (int64), loss mask (uint8), lengths and ids (int64)."""
    t = packet.tokens
    return t * (num_taps + 1) * hidden * dtype_bytes + 9 * t + 16 * packet.num_seqs


def target_working_bytes(
    target: TargetShape,
    packet: PacketShape,
    *,
    attention: AttentionKind,
    a: int,
    layout: TpLayout | None = None,
) -> float:
    """The largest working set of one target layer in a headless forward (bytes; the stages of
    :func:`dflash.targets.families.working_bytes_per_token`); on a tensor-parallel rank (``layout``)
    a split part's rows are its share ``1/k``; a dense-attention kernel adds its masks."""

    def share(part: str) -> float:
        return 1 / layout.tp_size if layout is not None and layout.split(part) else 1.0

    tokens = packet.target_tokens or packet.tokens
    stages = {k: tokens * v for k, v in working_bytes_per_token(target, a, share).items()}
    if attention == "dense":
        row = packet.target_row_tokens or packet.tokens
        mask = (tokens // row) * row * row  # the boolean mask lives through every layer
        stages = {k: v + mask for k, v in stages.items()}
        stages["attention"] += mask * (1 + a)
    return max(stages.values())


def target_memory(
    target: TargetShape,
    packet: PacketShape,
    num_taps: int,
    *,
    attention: AttentionKind,
    max_in_flight: int,
    dtypes: RunDtypes,
    layout: TpLayout | None = None,
) -> dict[str, float]:
    """GiB by item on a target rank: ``weights``, ``activations`` (the packet being made: its tap
    buffer and the largest layer working set), ``packets`` (``max_in_flight`` still in flight);
    ``layout``: on one rank of a tensor-parallel replica (its sender holds the packets in flight)."""
    a = dtypes.target_bytes
    tokens = packet.target_tokens or packet.tokens
    taps = tokens * num_taps * target.hidden_size * a
    working = target_working_bytes(target, packet, attention=attention, a=a, layout=layout)
    return {
        "weights": target_rank_params(target, layout) * a / GIB,
        "activations": (taps + working) / GIB,
        "packets": max_in_flight * payload_bytes(packet, num_taps, target.hidden_size, a) / GIB,
    }


def drafter_state(drafter: DrafterArch, settings: DrafterSettings) -> dict[str, float]:
    """GiB of fp32 ``weights``, ``gradients`` and ``optimizer_state`` per drafter rank at the loss.

    ``optimizer`` shards gradients and moments over the drafters and holds the whole weights from the
    first forward to the end of backward (FSDP2 without resharding after forward); ``full`` shards the
    weights too and gathers one layer at a time (:func:`shard_backward_bytes`). A sharded step in
    ``block_chunks > 1`` chunks also holds the whole gradient, unreduced, from the first chunk's
    backward to the last's (:func:`dflash.distributed.sharding.unsynced_backward`).
    """
    p = drafter_num_params(drafter)
    m = settings.num_drafters if settings.sharded else 1
    mode = settings.shard if settings.sharded else "none"
    weights = {"none": 4 * p, "optimizer": 4 * p + 4 * p / m, "full": 4 * p / m}[mode]
    adamw = family_costs(drafter).adamw_params(drafter)  # AdamW's under either optimizer
    state = (
        STATE_BYTES_PER_PARAM[settings.optimizer] * (p - adamw) + STATE_BYTES_PER_PARAM["adamw"] * adamw
    ) / m
    unreduced = 4 * p if m > 1 and settings.block_chunks > 1 else 0
    return {
        "weights": weights / GIB,
        "gradients": (4 * p / m + unreduced) / GIB,
        "optimizer_state": state / GIB,
    }


def shard_backward_bytes(drafter: DrafterArch, settings: DrafterSettings) -> float:
    """What ``full`` sharding adds to the backward of a layer: four fp32 layer-sized buffers (its
    gathered weights, the next layer's gathered ahead, its whole gradient and the reduce-scatter's);
    three in chunks, whose whole gradient is part of the unreduced one (:func:`drafter_state`)."""
    full = settings.shard == "full" and settings.sharded
    buffers = 3 if settings.block_chunks > 1 else 4
    return 4 * buffers * drafter_layer_params(drafter) if full else 0.0


def _layer_activation_bytes(drafter: DrafterArch, q: int, s: int, autocast: bool) -> float:
    """Bytes one drafter layer saves for backward (module doc), its weight casts included."""
    h, f = drafter.hidden_size, drafter.intermediate_size
    nh, nkv = drafter.num_heads, drafter.num_kv_heads
    a, k = nh * drafter.head_dim, nkv * drafter.head_dim
    small = q * (12 * nh + 4 * nkv + 16) + s * 4 * nkv  # norm statistics, flex's log-sum-exp
    if autocast:
        big = q * (20 * h + 10 * a + 10 * k + 8 * f) + s * 10 * k
        return big + small + 2 * drafter_layer_params(drafter)
    return q * 4 * (6 * h + 4 * a + 4 * k + 4 * f) + s * 4 * 4 * k + small


def drafter_activations(
    drafter: DrafterArch, q: int, s: int, dtypes: RunDtypes, checkpoint: bool
) -> tuple[float, float]:
    """``(at the loss, in backward)`` bytes of drafter activations (module doc)."""
    h, f, n_tap, layers = drafter.hidden_size, drafter.intermediate_size, drafter.num_taps, drafter.num_layers
    rd = int(drafter.head_dim * getattr(drafter, "partial_rotary_factor", 1.0))
    c = 2 if dtypes.autocast else 4  # bytes of a GEMM output
    casts = 2 * drafter_num_params(drafter) if dtypes.autocast else 0
    # the context norm and (autocast) the context's one bf16 copy, or the fp32 copy of the taps; RoPE tables
    once = s * (8 * h if dtypes.autocast else 4 * n_tap * h + 12 * h) + 8 * rd * (q + s)
    ends = q * (8 + dtypes.target_bytes) * h  # the noise embedding, the final norm
    extra = family_costs(drafter).layer_activation_bytes_per_token(drafter)
    layer = _layer_activation_bytes(drafter, q, s, dtypes.autocast) + q * extra
    if not checkpoint:
        full = (
            once
            + ends
            + layers * layer
            + (casts - layers * 2 * drafter_layer_params(drafter) if casts else 0)
        )
        return full, full
    # the layers keep their inputs (the context is already in ``once``)
    saved = once + layers * q * 4 * h
    at_loss = saved + q * 4 * h + ends + casts
    # one layer recomputed (its output is not kept) and the gradients of its input and MLP rows
    backward = saved + layer - q * 4 * h + q * (4 * h + 2 * c * f)
    return at_loss, backward


def loss_workspace_bytes(
    drafter: DrafterArch,
    rows: int,
    chunk_rows: int,
    *,
    verifier_logits: bool,
    dtypes: RunDtypes,
    positions: int | None = None,
) -> float:
    """Bytes of the chunked loss at its peak (module doc); ``positions``: the distinct verifier
    positions ``U`` of the rows (None: one per row)."""
    v, h, a = drafter.vocab_size, drafter.hidden_size, dtypes.target_bytes
    chunk = min(chunk_rows, max(rows, 1))
    per_chunk = (
        chunk if positions is None else min(chunk, -(-chunk * positions // max(rows, 1)) + drafter.block_size)
    )
    block = min(CUDA_ROW_BLOCK if dtypes.cuda else 128, chunk)
    scratch = (1 if per_chunk == chunk else 2) * block if verifier_logits else 0
    logits = (chunk + (per_chunk if verifier_logits else 0) + scratch) * v * 4
    if a < 4:
        logits += chunk * v * 2 if dtypes.cuda else v * h * 4  # the bf16 gradient chunk / an fp32 head
    rows_bytes = 2 * rows * h * 4 + chunk * h * 4
    selector = rows * family_costs(drafter).head_activation_bytes_per_row(drafter)
    return logits + rows_bytes + selector


@dataclass(frozen=True)
class BlockChunk:
    """The largest of a packet's ``drafter.block_chunks`` chunks of whole blocks."""

    blocks: int
    """Its blocks (padded ones included under a static shape)."""
    rows: int
    """Its supervised slots (the packet's share)."""
    positions: int
    """The distinct verifier positions its rows read: its share of the packet's, and the ``bs - 1``
    a block that starts in the previous chunk shares with it."""


def block_chunk(packet: PacketShape, block_size: int, chunks: int) -> BlockChunk:
    """:class:`BlockChunk` of ``packet`` in ``chunks`` chunks (1: the whole packet)."""
    blocks = packet.drafter_blocks if packet.drafter_blocks is not None else packet.num_anchors
    rows, positions = loss_rows(packet, block_size), verifier_positions(packet, block_size)
    if chunks <= 1 or blocks == 0:
        return BlockChunk(blocks, rows, positions)
    size = -(-blocks // chunks)
    share = -(-rows * size // blocks)
    return BlockChunk(size, min(rows, share), min(share, -(-positions * size // blocks) + block_size - 1))


def drafter_memory(
    drafter: DrafterArch,
    packet: PacketShape,
    *,
    loss_chunk_rows: int,
    verifier_logits: bool,
    dtypes: RunDtypes,
    settings: DrafterSettings = PLAIN,
) -> dict[str, float]:
    """GiB by item on a drafter rank at its peak: ``weights``, ``gradients``, ``optimizer_state``,
    ``embed_and_head``, ``activations``, ``loss_workspace``, ``packets``. ``loss_chunk_rows``: the
    loss chunk ``C`` (``dflash.loss.verifier.default_chunk_size`` or ``loss.chunk_size``)."""
    h, bs = drafter.hidden_size, drafter.block_size
    s = packet.drafter_context_tokens or packet.tokens
    chunk = block_chunk(packet, bs, settings.block_chunks)
    at_loss, backward = drafter_activations(drafter, chunk.blocks * bs, s, dtypes, settings.checkpoint)
    # a packet short of the static shape is grown to it: a copy of its hidden states for the step
    grown = s * (drafter.num_taps + 1) * h * dtypes.target_bytes if s > packet.tokens else 0
    # with chunks, the context's keys (fp32 after RoPE) and values every chunk reads, and the sum of
    # what the chunks before the last left on them (fp32)
    kv = drafter.num_layers * s * drafter.num_kv_heads * drafter.head_dim
    kept = kv * (4 + (2 if dtypes.autocast else 4) + 8) if settings.block_chunks > 1 else 0
    at_loss += grown + kept
    backward += grown + kept + shard_backward_bytes(drafter, settings)
    workspace = loss_workspace_bytes(
        drafter,
        chunk.rows,
        loss_chunk_rows,
        verifier_logits=verifier_logits,
        dtypes=dtypes,
        positions=chunk.positions,
    )
    if at_loss + workspace >= backward:
        activations, loss = at_loss, workspace
    else:
        activations, loss = backward, 0.0
    return {
        **drafter_state(drafter, settings),
        "embed_and_head": 2 * drafter.vocab_size * h * dtypes.target_bytes / GIB,
        "activations": activations / GIB,
        "loss_workspace": loss / GIB,
        "packets": payload_bytes(packet, drafter.num_taps, h, dtypes.target_bytes) / GIB,
    }


def colocated_memory(target_items: dict[str, float], drafter_items: dict[str, float]) -> dict[str, float]:
    """GiB by item on a co-located rank: the target and a drafter replica on one device.

    The drafter uses the target's embedding and lm_head (no copy); the target's activations are
    freed before the drafter step, so the peak is in the target forward (its tap buffer and layer
    working set) or in the drafter step (its activations and loss workspace, and the packet the
    forward made, handed over in memory), whichever is larger."""
    drafter_transient = drafter_items["activations"] + drafter_items["loss_workspace"]
    in_target = target_items["activations"] >= drafter_transient + drafter_items["packets"]
    return {
        "target_weights": target_items["weights"],
        "drafter_weights": drafter_items["weights"],
        "gradients": drafter_items["gradients"],
        "optimizer_state": drafter_items["optimizer_state"],
        "activations_peak": target_items["activations"] if in_target else drafter_transient,
        "packets": 0.0 if in_target else drafter_items["packets"],
    }


def memory_per_role(
    target: TargetShape,
    drafter: DrafterArch,
    packet: PacketShape,
    *,
    target_attention: AttentionKind,
    max_in_flight: int,
    loss_chunk_rows: int,
    verifier_logits: bool,
    dtypes: RunDtypes,
    settings: DrafterSettings = PLAIN,
    drafter_packet: PacketShape | None = None,
) -> dict[str, dict[str, float]]:
    """GiB by item for each role: ``target``, ``drafter`` and ``colocated`` (both on one GPU);
    ``packet`` is the target's, ``drafter_packet`` (default ``packet``) the drafter step's
    (:class:`dflash.sizing.packets.Packets`)."""
    t = target_memory(
        target,
        packet,
        drafter.num_taps,
        attention=target_attention,
        max_in_flight=max_in_flight,
        dtypes=dtypes,
    )
    d = drafter_memory(
        drafter,
        drafter_packet or packet,
        loss_chunk_rows=loss_chunk_rows,
        verifier_logits=verifier_logits,
        dtypes=dtypes,
        settings=settings,
    )
    return {"target": t, "drafter": d, "colocated": colocated_memory(t, d)}


EVAL_ITEMS = ("eval_target", "eval_decode")
"""Items :func:`eval_memory` adds to a drafter rank when ``eval.every > 0`` (the rehearsal runs the
training step only, so its comparison leaves them out)."""


def target_cache_bytes(target: TargetShape, tokens: int, a: int) -> int:
    """The target's decode cache for one sequence of ``tokens`` (``a`` bytes per element): keys and
    values of its full-attention layers, and per linear-attention layer the fp32 recurrent state and
    the convolution window."""
    full = target.num_layers - target.num_linear_layers
    kv = full * 2 * target.num_kv_heads * target.head_dim * tokens * a
    nv, dk, dv = target.linear_num_value_heads, target.linear_key_head_dim, target.linear_value_head_dim
    conv = (2 * target.linear_num_key_heads * dk + nv * dv) * target.linear_conv_kernel_dim * a
    return kv + target.num_linear_layers * (nv * dk * dv * 4 + conv)


def eval_decode_bytes(target: TargetShape, tokens: int, a: int) -> float:
    """The working set of one held-out conversation's speculative decode (batch 1, ``tokens`` = prompt
    + ``eval.max_new_tokens`` + a block): the target's cache (:func:`target_cache_bytes`) and the
    prefill's largest layer working set (its lm_head runs on the last position only)."""
    return target_cache_bytes(target, tokens, a) + tokens * max(working_bytes_per_token(target, a).values())


def eval_memory(items: dict[str, float], target_copy_gib: float, decode_bytes: float) -> dict[str, float]:
    """A drafter rank's ``items`` with the periodic eval (``eval.every > 0``): ``eval_target``, the copy
    of the whole target the rank loads to verify with (GiB, resident from start-up; 0 on a co-located
    rank, which verifies with its own), and ``eval_decode``, what the decode's working set
    (:func:`eval_decode_bytes`) needs beyond the training step's transient items, which are free
    between steps."""
    transient = sum(items.get(k, 0.0) for k in ("activations", "loss_workspace", "activations_peak"))
    return {
        **items,
        "eval_target": target_copy_gib,
        "eval_decode": max(0.0, decode_bytes / GIB - transient),
    }


def trained_bytes_per_param(optimizer: str) -> int:
    """fp32 weights, gradients and the optimizer state of ``optim.name`` per trained parameter."""
    return 4 + 4 + STATE_BYTES_PER_PARAM[optimizer]


def drafter_weights_problem(
    source: str, drafter: DrafterArch, bytes_per_param: float, capacity_bytes: float, capacity: str
) -> str | None:
    """Why the drafter's weights (``bytes_per_param`` each: :func:`trained_bytes_per_param` for a trained
    drafter) cannot fit the device, checked before anything is allocated; None when they fit."""
    total = drafter_num_params(drafter)
    mlp = drafter.num_layers * 3 * drafter.hidden_size * drafter.intermediate_size
    shares = {"the MLP (3 x num_hidden_layers x hidden_size x intermediate_size)": float(mlp)}
    shares["the attention weights"] = float(total - mlp)
    return weights_message(
        "drafter",
        source,
        described_fields(drafter),
        float(total),
        shares,
        bytes_per_param,
        capacity_bytes,
        capacity,
    )
