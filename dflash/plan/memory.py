"""Memory per GPU for each role (GiB by item): the planner's memory model (pure Python, no torch).

Exact items (what the code allocates):

- target weights: every parameter of the ``*ForCausalLM`` in the target dtype (the lm_head is
  loaded although never run; tied embeddings are counted once), ALL experts of a mixture-of-experts
  target; with a tensor-parallel replica each rank holds ``1/k`` of every part the plan splits
  (:class:`dflash.targets.tp.TpLayout`) and the rest whole;
- drafter weights, gradients and AdamW moments: fp32, 4 + 4 + 8 bytes per trainable parameter
  (the trainer keeps fp32 master weights and computes under bf16 autocast);
- the drafter's frozen embedding and lm_head copies (``2 * V * H`` in the target dtype);
- the loss workspace: ``n_buf`` fp32 ``[C, V]`` chunk buffers (2 with verifier logits, 1
  without) plus ``dh`` and the compacted rows ``[R, H]`` in fp32;
- packet buffers: a target holds the packet it builds plus ``max_in_flight`` unacknowledged ones,
  a drafter the packet it trains on plus the one it receives ahead.

Estimates (stated element counts, checked against saved-tensor sizes of the tiny drafter in
tests/unit/test_plan.py):

- drafter activations saved for backward, per decoder layer: ``10*H + 4*nh*hd + 4*nkv*hd + 4*F``
  elements per block token (norm inputs and outputs, q/k/v, attention output, MLP gate/up/product)
  and ``4*nkv*hd`` per context token (its keys and values before and after norm and RoPE), plus
  ``(n_tap + 3)*H`` per context token once (fc input and output, hidden norm); 4 bytes per element
  in fp32, about 3 under bf16 autocast (bf16 GEMM operands, fp32 norms and residual stream);
- target activations (inference mode, nothing kept between layers): the working set of one layer,
  ``4*H + (g + 1)*nh*hd + 2*nkv*hd + 3*F`` elements per computed token (a mixture of experts:
  ``3*(k_e*F_e + F_s) + E`` in place of ``3*F``; a split part's share ``1/k`` on a TP rank), plus
  for a dense-attention kernel the ``[row, row]`` mask of each row (1 byte bool + the additive mask
  SDPA derives from it in the compute dtype).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dflash.config import TargetShape
from dflash.plan.costs import AttentionKind, DrafterShape, PacketShape
from dflash.targets.tp import TpLayout

GIB = 2**30
ADAM_BYTES_PER_PARAM = 4 + 4 + 8
"""fp32 weights, fp32 gradients, fp32 AdamW first and second moments."""
AUTOCAST_ACT_BYTES = 3.0
"""Mean bytes per saved activation element under bf16 autocast (measured 2.6-3.0 on the tiny drafter)."""


@dataclass(frozen=True)
class RunDtypes:
    """Element sizes of a run: target weights and hidden states, drafter activations."""

    target_bytes: int = 2
    """bf16 target (weights, hidden states on the wire, frozen embedding and lm_head)."""
    activation_bytes: float = AUTOCAST_ACT_BYTES
    """Per saved drafter activation element: 4 in fp32, :data:`AUTOCAST_ACT_BYTES` under bf16 autocast."""


def target_params_by_part(target: TargetShape) -> dict[str, int]:
    """Parameters of the target ``*ForCausalLM`` by part (matrices only; norms and biases are
    negligible): the decoder-layer parts of :func:`dflash.plan.costs.target_flop_by_part` (all
    experts), ``embedding`` and ``lm_head`` (0 when tied: counted once)."""
    h, f = target.hidden_size, target.intermediate_size
    nh, nkv, hd = target.num_heads, target.num_kv_heads, target.head_dim
    gate = 2 if target.attn_output_gate else 1
    full = h * (gate * nh * hd + 2 * nkv * hd) + nh * hd * h
    nk, nv = target.linear_num_key_heads, target.linear_num_value_heads
    dk, dv = nk * target.linear_key_head_dim, nv * target.linear_value_head_dim
    linear = h * (2 * dk + 2 * dv + 2 * nv) + dv * h + target.linear_conv_kernel_dim * (2 * dk + dv)
    layers = target.num_layers
    shared = target.shared_expert_intermediate_size
    return {
        "attention": (layers - target.num_linear_layers) * full,
        "linear_attention": target.num_linear_layers * linear,
        "mlp": 0 if target.num_experts else layers * 3 * h * f,
        "experts": layers * target.num_experts * 3 * h * target.moe_intermediate_size,
        "router": layers * h * target.num_experts,
        "shared_expert": layers * (3 * h * shared + h) if shared else 0,
        "embedding": target.vocab_size * h,
        "lm_head": 0 if target.tie_word_embeddings else target.vocab_size * h,
    }


def target_num_params(target: TargetShape) -> int:
    """Parameters of the target ``*ForCausalLM`` (matrices only; norms and biases are negligible)."""
    return sum(target_params_by_part(target).values())


def target_active_params(target: TargetShape) -> int:
    """Parameters one token runs through: the decoder layers with only ``num_experts_per_tok``
    experts, and one embedding row (the lm_head never runs on a target rank)."""
    parts = target_params_by_part(target)
    experts = (
        target.num_layers * target.num_experts_per_tok * 3 * target.hidden_size * target.moe_intermediate_size
    )
    return sum(v for k, v in parts.items() if k not in ("experts", "embedding", "lm_head")) + experts


def target_rank_params(target: TargetShape, layout: TpLayout | None) -> float:
    """Parameters one rank of a ``layout.tp_size``-rank replica holds (``layout=None``: the whole target)."""
    parts = target_params_by_part(target)
    if layout is None:
        return float(sum(parts.values()))
    return sum(v / layout.tp_size if layout.split(k) else float(v) for k, v in parts.items())


def drafter_num_params(drafter: DrafterShape) -> int:
    """Trainable drafter parameters: decoder layers and ``fc`` (the norms are negligible)."""
    h = drafter.hidden_size
    nh, nkv, hd = drafter.num_heads, drafter.num_kv_heads, drafter.head_dim
    layer = 2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * drafter.intermediate_size
    return drafter.num_layers * layer + drafter.num_taps * h * h


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
    """GiB by item on a target rank: ``weights``, ``activations``, ``packets`` (``layout``: on one
    rank of a tensor-parallel replica; its sender holds the packets in flight)."""
    a = dtypes.target_bytes
    h, nh, nkv, hd = target.hidden_size, target.num_heads, target.num_kv_heads, target.head_dim
    gate = 2 if target.attn_output_gate else 1
    tokens = packet.target_tokens or packet.tokens

    def share(part: str) -> float:
        return 1 / layout.tp_size if layout is not None and layout.split(part) else 1.0

    attn = ((gate + 1) * nh * hd + 2 * nkv * hd) * share("attention")
    if target.num_experts:
        experts = 3 * target.num_experts_per_tok * target.moe_intermediate_size * share("experts")
        ffn = (
            experts + 3 * target.shared_expert_intermediate_size * share("shared_expert") + target.num_experts
        )
    else:
        ffn = 3 * target.intermediate_size * share("mlp")
    working = tokens * (4 * h + attn + ffn) * a
    if attention == "dense":
        row = packet.target_row_tokens or packet.tokens
        working += (tokens // row) * row * row * (1 + a)
    packet_bytes = packet.tokens * (num_taps + 1) * h * a
    return {
        "weights": target_rank_params(target, layout) * a / GIB,
        "activations": working / GIB,
        "packets": (1 + max_in_flight) * packet_bytes / GIB,
    }


def drafter_memory(
    drafter: DrafterShape,
    packet: PacketShape,
    *,
    loss_chunk_rows: int,
    verifier_logits: bool,
    dtypes: RunDtypes,
) -> dict[str, float]:
    """GiB by item on a drafter rank: ``weights``, ``gradients``, ``adamw``, ``embed_and_head``,
    ``activations``, ``loss_workspace``, ``packets``. ``loss_chunk_rows``: the loss chunk ``C``
    (``dflash.loss.verifier.default_chunk_size`` or ``loss.chunk_size``)."""
    h, bs = drafter.hidden_size, drafter.block_size
    nh, nkv, hd, f = drafter.num_heads, drafter.num_kv_heads, drafter.head_dim, drafter.intermediate_size
    params = drafter_num_params(drafter)
    blocks = packet.drafter_blocks if packet.drafter_blocks is not None else packet.num_anchors
    q = blocks * bs
    s_c = packet.drafter_context_tokens or packet.tokens
    per_block_token = 10 * h + 4 * nh * hd + 4 * nkv * hd + 4 * f
    elements = (
        drafter.num_layers * (q * per_block_token + s_c * 4 * nkv * hd) + s_c * (drafter.num_taps + 3) * h
    )
    rows = packet.loss_rows if packet.loss_rows is not None else packet.num_anchors * (bs - 1)
    chunk = min(loss_chunk_rows, max(rows, 1))
    workspace = (2 if verifier_logits else 1) * chunk * drafter.vocab_size * 4 + 2 * rows * h * 4
    packet_bytes = packet.tokens * (drafter.num_taps + 1) * h * dtypes.target_bytes
    return {
        "weights": params * 4 / GIB,
        "gradients": params * 4 / GIB,
        "adamw": params * 8 / GIB,
        "embed_and_head": 2 * drafter.vocab_size * h * dtypes.target_bytes / GIB,
        "activations": elements * dtypes.activation_bytes / GIB,
        "loss_workspace": workspace / GIB,
        "packets": 2 * packet_bytes / GIB,
    }


def colocated_memory(target_items: dict[str, float], drafter_items: dict[str, float]) -> dict[str, float]:
    """GiB by item on a co-located rank: the target and a drafter replica on one device.

    Both weight sets, the drafter's gradients, AdamW moments and frozen copies stay; the target's
    activations are freed before the drafter step, so the transient peak is the larger of the
    target's activations and the drafter's activations plus loss workspace; one packet, handed
    over in memory."""
    drafter_transient = drafter_items["activations"] + drafter_items["loss_workspace"]
    return {
        "target_weights": target_items["weights"],
        "drafter_weights": drafter_items["weights"],
        "gradients": drafter_items["gradients"],
        "adamw": drafter_items["adamw"],
        "embed_and_head": drafter_items["embed_and_head"],
        "activations_peak": max(target_items["activations"], drafter_transient),
        "packets": drafter_items["packets"] / 2,
    }


def memory_per_role(
    target: TargetShape,
    drafter: DrafterShape,
    packet: PacketShape,
    *,
    target_attention: AttentionKind,
    max_in_flight: int,
    loss_chunk_rows: int,
    verifier_logits: bool,
    dtypes: RunDtypes,
) -> dict[str, dict[str, float]]:
    """GiB by item for each role: ``target``, ``drafter`` and ``colocated`` (both on one GPU)."""
    t = target_memory(
        target,
        packet,
        drafter.num_taps,
        attention=target_attention,
        max_in_flight=max_in_flight,
        dtypes=dtypes,
    )
    d = drafter_memory(
        drafter, packet, loss_chunk_rows=loss_chunk_rows, verifier_logits=verifier_logits, dtypes=dtypes
    )
    return {"target": t, "drafter": d, "colocated": colocated_memory(t, d)}


_CONFIG_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
}
"""TargetShape / DrafterShape field -> its config.json name (the others are the same)."""
_SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
)
_MLP = "the MLP (3 x num_hidden_layers x hidden_size x intermediate_size)"
_EMBEDDINGS = "the embedding and lm_head (vocab_size x hidden_size)"


def weights_problem(
    what: str,
    source: str,
    shape: TargetShape | DrafterShape,
    bytes_per_param: float,
    capacity_bytes: float,
    capacity: str,
) -> str | None:
    """Why the weights a shape implies cannot fit the device, checked before anything is
    allocated; None when they fit.

    ``shape`` is a target's (:class:`TargetShape`, counted by :func:`target_num_params`) or a
    drafter's (a dataclass such as ``DrafterArch``, counted by :func:`drafter_num_params`);
    ``bytes_per_param`` what one parameter costs there (the dtype's size; a trained drafter
    :data:`ADAM_BYTES_PER_PARAM`). ``source`` names the file or config the shape came from,
    ``capacity`` the device memory (``host RAM``, ``free memory of cuda:0``). The message gives the
    config.json fields the count reads, the implied GiB and the share of its largest part (the MLP,
    the embeddings, the attention weights)."""
    flexible: Any = shape  # dataclasses.replace on either kind of shape
    if isinstance(shape, TargetShape):
        total = target_num_params(shape)
        shares = {
            _MLP: total - target_num_params(dataclasses.replace(shape, intermediate_size=0)),
            _EMBEDDINGS: total - target_num_params(dataclasses.replace(shape, vocab_size=0)),
        }
    else:
        total = drafter_num_params(shape)
        shares = {_MLP: total - drafter_num_params(dataclasses.replace(flexible, intermediate_size=0))}
    need = total * bytes_per_param
    if need <= capacity_bytes:
        return None
    shares["the attention weights"] = total - sum(shares.values())
    largest = max(shares, key=lambda k: shares[k])
    fields = ", ".join(
        f"{_CONFIG_NAMES.get(n, n)}={getattr(shape, n)}" for n in _SHAPE_FIELDS if hasattr(shape, n)
    )
    return (
        f"{source}: {fields} imply {need / GIB:.1f} GiB of {what} weights ({total:.3g} parameters x "
        f"{bytes_per_param:g} bytes; {shares[largest] * bytes_per_param / GIB:.1f} GiB of it {largest}), more "
        f"than the {capacity_bytes / GIB:.1f} GiB of {capacity}: nothing was allocated; fix those fields"
    )
