"""FLOPs and bytes of one packet for each role: the planner's cost model (pure Python, no torch).

A packet is what one target forward produces and one drafter step consumes: ``tokens`` tokens of
``num_seqs`` documents (packed in one row, or padded rows for targets that cannot pack), with
``num_anchors`` blocks of ``block_size`` slots sampled on it. Units: FLOP (a multiply-add is 2
FLOP; a GEMM ``[m, k] @ [k, n]`` is ``2*m*n*k``) and bytes. Only GEMM-like work is counted:
norms, RoPE, activations, softmaxes and the loss's elementwise passes are a few FLOP per element,
against ``2*H`` per element for the GEMMs that produce them, and are left out.

Notation: ``H`` hidden size, ``F`` FFN size, ``nh``/``nkv``/``hd`` query heads, key-value heads
and head dim, ``V`` vocabulary, ``n_tap`` tapped target layers, ``B`` block size.

Target (headless forward, never the lm_head), per computed token (padding included) and layer:

- full attention: projections ``2*H*(g*nh*hd + 2*nkv*hd) + 2*nh*hd*H`` (``g = 2`` when q_proj also
  emits an output gate, Qwen3.5/3.6), plus scores and weighted sum ``4*nh*hd*k`` for ``k`` keys per
  query (see :data:`AttentionKind`);
- Gated DeltaNet linear attention (hybrid Qwen3.5/3.6 layers, ``dk = nk*dk_head``,
  ``dv = nv*dv_head``): projections ``2*H*(2*dk + 2*dv + 2*nv) + 2*dv*H`` (in_proj_qkv, in_proj_z,
  in_proj_a/b, out_proj), causal conv ``2*K*(2*dk + dv)`` and the chunked delta rule
  (:func:`dflash.targets.families.delta_rule_flop_per_head` per value head: ``6*dk_h*dv_h`` for the
  state, ``2C*(3*dk_h + 2*dv_h)`` within chunks of ``C = 64``);
- SwiGLU MLP ``6*H*F``; a mixture-of-experts layer instead (``E`` experts of width ``F_e``, ``k_e``
  of them per token, a shared expert of width ``F_s``): router ``2*H*E``, routed experts
  ``k_e*6*H*F_e`` (the ACTIVE parameters: a token runs only its experts), shared expert
  ``6*H*F_s + 2*H`` (its sigmoid gate).

Target tensor parallelism (``k`` ranks per replica, :class:`dflash.targets.tp.TpLayout`): every
part the plan splits costs each rank ``1/k`` of its FLOPs (heads, FFN width, or whole experts with
expert parallelism: ``k_e/k`` experts per token per rank on average); what the plan keeps whole
(routers, gpt-oss attention) each rank computes in full. The residual stream is replicated by one
all-reduce of the ``[T, H]`` activations after every split attention, MLP, expert and shared-expert
block, plus one after the split embedding; split Gated DeltaNet projections gather their outputs
(``colwise_gather_output``: ``2*dk + 2*dv + 2*nv + H`` columns per token). A ring all-reduce of
``S`` bytes sends ``2*(k-1)/k*S`` per rank, an all-gather of ``S`` gathered bytes ``(k-1)/k*S``.

Drafter step (forward + backward), per packet:

- ``fc``: ``2*S_c*(n_tap*H)*H`` forward over the ``S_c`` context rows, and backward only its weight
  gradient (the target's taps need no gradient): 2x forward in total;
- per decoder layer, over the ``Q = blocks*B`` block tokens: q and o projections ``2*2*Q*H*nh*hd``,
  k and v over context and blocks ``2*2*(S_c + Q)*H*nkv*hd``, MLP ``6*Q*H*F``, attention
  ``4*nh*hd*k`` per block query; backward = 2x forward (input and weight gradients): 3x in total;
- DFlash2 (``drafter.family``; :mod:`dflash.drafter.families`): per layer and block token the two
  kernel projections ``2*2*H*(2*K*G)`` (3x), per supervised row the candidates' top-k pass
  ``2*H*V`` (forward only) and the selector ``2*H*r + 2*k*r`` (3x);
- the loss over the ``R`` supervised slots with the frozen lm_head, chunked: drafter logits
  ``2*R*H*V``, the logit gradient ``dh = G @ W`` ``2*R*H*V``, and the verifier logits
  ``2*U*H*V`` when a term or the metrics need them (KL, verifier-CE, accuracy against the verifier
  argmax and tau_hat): once per distinct position ``U`` the rows read (each covered by ~``R/U``
  overlapping blocks), not per row.

Attention keys per query (:data:`AttentionKind`): ``"sparse"`` kernels skip masked tiles
(flex_attention, flash-attention varlen), so a target query at position ``p`` of its document
sees ``p + 1`` keys (``(L + 1)/2`` on average for documents of ``L`` tokens) and a drafter block
query sees the context before its anchor plus its own ``B`` slots (``L/2 + B`` on average for
uniform anchors); ``"dense"`` kernels (SDPA or eager with an explicit mask, which transformers
passes for packed or padded rows) compute every query-key pair of the row. Tile rounding of
sparse kernels is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from dflash.config import LossConfig, TargetShape
from dflash.drafter.families import family_costs
from dflash.loss.terms import coefficients, needs_verifier_logits
from dflash.targets.families import KERNEL_PARTS, flop_by_part, tp_traffic_per_token
from dflash.targets.tp import TpLayout

if TYPE_CHECKING:
    from dflash.drafter.arch import DrafterArch

AttentionKind = Literal["sparse", "dense"]
"""How many keys an attention kernel computes per query: only the visible ones, or the whole row."""

LOSS_GEMMS = ("drafter_logits", "logit_grad", "verifier_logits", "candidate_logits", "selector")
"""The loss's GEMMs; the last two are DFlash2's (the no-grad top-k pass over the vocabulary and the
selector's projection and edge scores, forward + backward; 0 for DFlash-1)."""


@dataclass(frozen=True)
class PacketShape:
    """One packet in the units of the formulas.

    ``tokens`` real tokens of ``num_seqs`` documents; ``num_anchors`` blocks with a loss (all
    documents together). The optional fields default to what the packet itself implies:

    - ``loss_rows``: supervised slots (default ``num_anchors * (block_size - 1)``: every slot
      after the given one of every block);
    - ``verifier_rows``: the distinct positions those slots' verifier rows are at (default
      :func:`verifier_positions`: anchors uniform over the packet);
    - ``target_tokens`` / ``target_row_tokens``: tokens the target computes and the length of one
      of its rows (default: one packed row, ``tokens``; padded rows: ``num_seqs * L_max`` and
      ``L_max``);
    - ``drafter_context_tokens`` / ``drafter_blocks``: context rows and blocks the drafter
      computes (default ``tokens`` and ``num_anchors``; a static flex shape pads them to
      ``data.token_budget`` and ``drafter.max_anchors_per_packet``, padding blocks seeing only
      their own slots);
    - ``anchor_context``: mean context keys a real block sees (default ``tokens / num_seqs / 2``:
      anchors uniform over documents of equal length);
    - ``doc_lengths``: the documents' own lengths when they differ (padded rows planned from the
      data plan, a packed row from the prepared dataset's lengths); None: ``num_seqs`` documents of
      equal length.
    """

    tokens: int
    num_seqs: int
    num_anchors: int
    loss_rows: int | None = None
    verifier_rows: int | None = None
    target_tokens: int | None = None
    target_row_tokens: int | None = None
    drafter_context_tokens: int | None = None
    drafter_blocks: int | None = None
    anchor_context: float | None = None
    doc_lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.num_seqs < 1 or self.num_anchors < 0:
            raise ValueError(f"PacketShape needs tokens >= 1, num_seqs >= 1, num_anchors >= 0: {self}")
        if self.doc_lengths is not None and (
            len(self.doc_lengths) != self.num_seqs or sum(self.doc_lengths) != self.tokens
        ):
            raise ValueError(f"PacketShape.doc_lengths must be num_seqs lengths summing to tokens: {self}")

    @property
    def mean_doc_tokens(self) -> float:
        return self.tokens / self.num_seqs


@dataclass(frozen=True)
class PacketCosts:
    """FLOPs (forward of the target; forward + backward of the drafter) and wire bytes of one packet."""

    target_flop: float
    """Headless target forward (decoder layers; no embedding lookup, no lm_head)."""
    target_attention_flop: float
    """The part of ``target_flop`` spent in attention scores and weighted sums."""
    target_flop_by_part: dict[str, float]
    """``target_flop`` by part of the decoder layers (:func:`dflash.targets.families.flop_by_part`; ``attention``
    includes ``attention_scores``, ``linear_attention`` ``delta_rule``), for the times of each kernel
    and of a tensor-parallel replica."""
    drafter_layers_flop: float
    """``fc`` and the decoder layers, forward + backward."""
    drafter_attention_flop: float
    """The part of ``drafter_layers_flop`` spent in attention scores and weighted sums."""
    drafter_loss_flop: dict[str, float]
    """The loss GEMMs by name (:data:`LOSS_GEMMS`); 0 for one that does not run."""
    hidden_bytes: int
    """Tapped and final hidden states on the wire: ``tokens * (n_tap + 1) * H * dtype_bytes``."""
    payload_bytes: int
    """Everything a packet carries: hidden states, input ids (int64), loss mask (uint8), lengths (int64)."""

    @property
    def drafter_loss_total(self) -> float:
        return sum(self.drafter_loss_flop.values())

    @property
    def drafter_flop(self) -> float:
        """One drafter step on the packet: layers + loss."""
        return self.drafter_layers_flop + self.drafter_loss_total


def tp_bytes_per_token(target: TargetShape, layout: TpLayout, dtype_bytes: int) -> dict[str, float]:
    """Bytes one rank of a ``layout.tp_size``-rank replica sends per token to replicate the residual
    stream, by kind (module docstring): ``all_reduce`` (every split part that ends with one, and the
    embedding) and ``gather`` (split linear-attention projections)."""
    k = layout.tp_size
    if k <= 1:
        return {"all_reduce": 0.0, "gather": 0.0}
    reduces, gathered = tp_traffic_per_token(target, layout.split)
    return {
        "all_reduce": 2 * (k - 1) / k * reduces * target.hidden_size * dtype_bytes,
        "gather": (k - 1) / k * gathered * dtype_bytes,
    }


def rank_flop_by_part(target_flop_by_part: dict[str, float], layout: TpLayout | None) -> dict[str, float]:
    """``PacketCosts.target_flop_by_part`` for one rank of a replica (``layout``; None: one GPU): a
    split part (and its kernel, :data:`KERNEL_PARTS`) is ``1/k`` of it."""
    if layout is None or layout.tp_size <= 1:
        return dict(target_flop_by_part)
    k = layout.tp_size
    return {
        part: flop / k if layout.split(KERNEL_PARTS.get(part, part)) else flop
        for part, flop in target_flop_by_part.items()
    }


def target_rank_flop(target_flop_by_part: dict[str, float], layout: TpLayout | None) -> float:
    """FLOPs one rank of the replica computes, from ``PacketCosts.target_flop_by_part``."""
    by_part = rank_flop_by_part(target_flop_by_part, layout)
    return sum(v for k, v in by_part.items() if k not in KERNEL_PARTS)


def target_seconds(
    target_flop_by_part: dict[str, float],
    peak_flops: float,
    *,
    mfu_target: float,
    mfu_delta_rule: float,
    layout: TpLayout | None = None,
) -> float:
    """Compute seconds of one rank's target forward at ``peak_flops`` FLOP/s: the delta rule of
    linear-attention layers at ``mfu_delta_rule``, everything else (GEMMs, attention) at ``mfu_target``."""
    by_part = rank_flop_by_part(target_flop_by_part, layout)
    delta = by_part.get("delta_rule", 0.0)
    total = sum(v for k, v in by_part.items() if k not in KERNEL_PARTS)
    return (total - delta) / (peak_flops * mfu_target) + delta / (peak_flops * mfu_delta_rule)


def target_keys_per_query(packet: PacketShape, attention: AttentionKind) -> float:
    """Mean keys a target query attends to: ``(L + 1)/2`` causal within its document (sparse; a
    packed row of documents of their own lengths: ``sum L(L+1)/2 / sum L``) or the whole row (dense)."""
    if attention == "dense":
        return float(packet.target_row_tokens or packet.tokens)
    if packet.doc_lengths is not None and packet.target_tokens in (None, packet.tokens):
        return sum(n * (n + 1) / 2 for n in packet.doc_lengths) / packet.tokens
    return (packet.mean_doc_tokens + 1) / 2


def drafter_keys_per_query(packet: PacketShape, block_size: int, attention: AttentionKind) -> float:
    """Mean keys a drafter block query attends to, over all computed blocks (padding included).

    sparse: a real block sees ``anchor_context + B`` keys, a padding block its own ``B``;
    dense: every context row and every block slot of the row, ``S_c + blocks * B``.
    """
    blocks = packet.drafter_blocks if packet.drafter_blocks is not None else packet.num_anchors
    context = packet.drafter_context_tokens or packet.tokens
    if attention == "dense":
        return float(context + blocks * block_size)
    if blocks == 0:
        return 0.0
    anchor_context = (
        packet.anchor_context if packet.anchor_context is not None else packet.mean_doc_tokens / 2
    )
    real = min(packet.num_anchors, blocks)
    return (real * anchor_context + blocks * block_size) / blocks


def loss_rows(packet: PacketShape, block_size: int) -> int:
    """R: the packet's supervised slots (``PacketShape.loss_rows`` or every slot of every block)."""
    return packet.loss_rows if packet.loss_rows is not None else packet.num_anchors * (block_size - 1)


def verifier_positions(packet: PacketShape, block_size: int) -> int:
    """U: the distinct positions the supervised slots' verifier rows are at
    (``PacketShape.verifier_rows``; default: ``num_anchors`` blocks uniform over ``tokens``, a
    position covered unless none of the ``block_size - 1`` anchors before it is drawn), at most R."""
    rows = loss_rows(packet, block_size)
    if packet.verifier_rows is not None:
        return min(packet.verifier_rows, rows)
    drawn = min(1.0, packet.num_anchors / packet.tokens)
    return min(rows, round(packet.tokens * (1 - (1 - drawn) ** (block_size - 1))))


def packet_costs(
    target: TargetShape,
    drafter: DrafterArch,
    packet: PacketShape,
    loss: LossConfig,
    *,
    target_attention: AttentionKind,
    drafter_attention: AttentionKind,
    verifier_metrics: bool = True,
    hidden_dtype_bytes: int = 2,
) -> PacketCosts:
    """The FLOPs and bytes of ``packet`` for the target and the drafter (formulas: module docstring).

    ``verifier_metrics``: the verifier logits are computed for the metrics even when no loss term
    needs them (what the trainer does: accuracy against the verifier argmax and tau_hat).
    ``hidden_dtype_bytes``: bytes per element of the hidden states on the wire (2 for bf16).
    """
    if drafter.hidden_size != target.hidden_size:
        raise ValueError(
            f"drafter hidden size {drafter.hidden_size} != target hidden size {target.hidden_size}"
        )
    per_part = flop_by_part(target, target_keys_per_query(packet, target_attention))
    t_tokens = packet.target_tokens or packet.tokens
    by_part = {k: v * t_tokens for k, v in per_part.items()}
    target_flop = sum(v for k, v in by_part.items() if k not in KERNEL_PARTS)
    target_attention_flop = by_part["attention_scores"]

    h, bs = drafter.hidden_size, drafter.block_size
    nh, nkv, hd = drafter.num_heads, drafter.num_kv_heads, drafter.head_dim
    blocks = packet.drafter_blocks if packet.drafter_blocks is not None else packet.num_anchors
    q = blocks * bs
    s_c = packet.drafter_context_tokens or packet.tokens
    attn = 4 * nh * hd * q * drafter_keys_per_query(packet, bs, drafter_attention)
    layer = 2 * 2 * q * h * nh * hd + 2 * 2 * (s_c + q) * h * nkv * hd + 6 * q * h * drafter.intermediate_size
    fc = 2 * s_c * drafter.num_taps * h * h
    family = family_costs(drafter)
    layer_flop = layer + q * family.layer_flop_per_token(drafter)
    drafter_layers_flop = 3 * drafter.num_layers * (layer_flop + attn) + 2 * fc
    drafter_attention_flop = 3 * drafter.num_layers * attn

    rows = loss_rows(packet, bs)
    gemm = 2 * rows * h * drafter.vocab_size
    verifier = needs_verifier_logits(coefficients(loss), verifier_metrics)
    loss_flop = {
        "drafter_logits": gemm,
        "logit_grad": gemm,
        "verifier_logits": 2 * verifier_positions(packet, bs) * h * drafter.vocab_size if verifier else 0,
        "candidate_logits": rows * family.head_no_grad_flop_per_row(drafter),
        "selector": 3 * rows * family.head_flop_per_row(drafter),
    }

    hidden = packet.tokens * (drafter.num_taps + 1) * h * hidden_dtype_bytes
    payload = hidden + packet.tokens * (8 + 1) + packet.num_seqs * 8
    return PacketCosts(
        target_flop=float(target_flop),
        target_attention_flop=float(target_attention_flop),
        target_flop_by_part=by_part,
        drafter_layers_flop=float(drafter_layers_flop),
        drafter_attention_flop=float(drafter_attention_flop),
        drafter_loss_flop={k: float(v) for k, v in loss_flop.items()},
        hidden_bytes=int(hidden),
        payload_bytes=int(payload),
    )
