"""Target families: the one table of a target's layer parts, and one record per family.

Every count the planner, the rehearsal and the loaders make of a target comes from :data:`PARTS`,
one row per part of the ``*ForCausalLM`` (its module prefix in transformers' tensor-parallel plans,
how many layers hold it, its parameters, what one token runs through, the FLOPs beyond the GEMMs,
its working set in a forward and the collective a split part ends with). A family
(:class:`TargetFamily`) names its model types and what differs beyond the shape: the extra fields
of its tiny builds, the transformers config the real-size rehearsal builds from ``target.shape``,
the config.json keys it spells its own way. Families: dense (Qwen3, Llama and any model type not
listed), Qwen3-MoE, gpt-oss (MoE, attention sinks), hybrid (Qwen3.5/3.6: Gated DeltaNet linear
attention in three of four layers) and hybrid MoE.

Formulas (one token, bytes ``a`` per element of the target dtype; ``H`` hidden, ``A = nh*hd`` query
width, ``K = nkv*hd`` key/value width, ``g = 2`` with an output gate, ``dk = nk*dk_head``, ``dv =
nv*dv_head``; FLOPs are ``2 * active parameters`` plus the extras):

- full attention: ``H(gA + 2K) + AH`` per layer; extra ``4*A*k`` for ``k`` keys per query;
  working set ``(g + 2)*A + K`` elements in the attention stage;
- Gated DeltaNet: ``H(2dk + 2dv + 2nv) + dv*H + Kc(2dk + dv)``; extra the chunked delta rule
  ``nv * (6*dk_head*dv_head + 2C*(3*dk_head + 2*dv_head) + 2C^2/3)`` (:func:`delta_rule_flop_per_head`); working set ``(2dk + 2dv)*a + 4*(10*dv + 3*nv*64)`` bytes (the torch
  fallback's fp32 chunks of 64);
- MLP ``3HF`` (none in a mixture-of-experts layer); experts ``E*3H*Fe`` held, ``ke*3H*Fe`` run;
  router ``HE``; shared expert ``3H*Fs + H``; FFN-stage working set ``3F`` (or ``3*ke*Fe + 3*Fs + E``);
- embedding and lm_head ``V*H`` each (the lm_head 0 when tied); neither runs on a target rank.

The largest working set of a layer is the largest stage: FFN ``4H`` + its parts, attention ``3H``
+ its part, linear attention ``3H*a`` + its part (only with linear layers). Pure Python: no torch;
transformers is imported only to build configs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from dflash.config import TargetShape, TinyTargetConfig

DELTA_CHUNK = 64
"""Chunk length of the chunked delta rule (flash-linear-attention's kernels and transformers' torch
fallback alike)."""
KERNEL_PARTS = {"attention_scores": "attention", "delta_rule": "linear_attention"}
"""FLOPs of a part's own kernel beyond its projections (already inside the part's figure), given
alone too, since they run at their own efficiency: sub-part -> part."""
Share = Callable[[str], float]
"""part name -> the share of it one rank holds (1/k where a tensor-parallel replica splits it, else 1)."""


def delta_rule_flop_per_head(dk: int, dv: int, chunk: int = DELTA_CHUNK) -> float:
    """FLOPs per token of one value head of the chunked gated delta rule (key dim ``dk``, value dim
    ``dv``, chunks of ``C`` tokens): per chunk, ``K K^T`` (``2C^2 dk``), the triangular solve
    (``2C^3/3``), ``W = A K`` and ``U = A V`` (``2C^2 (dk + dv)``), the new values ``U - W S`` and
    the state update ``S += K^T V'`` (``4C dk dv``), the output ``Q S + (Q K^T) V'`` (``2C dk dv +
    2C^2 (dk + dv)``); divided by ``C``: ``6 dk dv + 2C (3 dk + 2 dv) + 2C^2/3``."""
    return 6 * dk * dv + 2 * chunk * (3 * dk + 2 * dv) + 2 * chunk * chunk / 3


def _whole(part: str) -> float:
    return 1.0


def _zero(s: TargetShape, *rest: Any) -> float:
    return 0.0


def _full_layers(s: TargetShape) -> int:
    return s.num_layers - s.num_linear_layers


def _dk_dv(s: TargetShape) -> tuple[int, int]:
    return s.linear_num_key_heads * s.linear_key_head_dim, s.linear_num_value_heads * s.linear_value_head_dim


def _gate(s: TargetShape) -> int:
    return 2 if s.attn_output_gate else 1


@dataclass(frozen=True)
class LayerPart:
    """One part of the target and how it counts (module docstring)."""

    name: str
    prefixes: tuple[str, ...]
    """Module prefixes after ``layers.*.`` in transformers' TP plans (``()``: no decoder-layer module)."""
    layers: Callable[[TargetShape], int]
    """How many times the model holds it (decoder layers holding it; 1 for embedding and lm_head)."""
    params: Callable[[TargetShape], int]
    """Parameters per holder (all experts)."""
    active: Callable[[TargetShape], int] | None = None
    """Parameters one token runs through per holder (None: ``params``)."""
    extra_flop: Callable[[TargetShape, float], float] = _zero
    """FLOPs per token per holder beyond ``2 * active`` (``(shape, keys per query)``)."""
    stage: str | None = None
    """The forward stage whose working set it adds to: ``ffn``, ``attention``, ``linear``."""
    working: Callable[[TargetShape, float, int], float] = _zero
    """``(shape, share, a)`` -> working-set bytes per token of this part in its stage."""
    all_reduces: bool = False
    """A split part ends with an all-reduce of the ``[T, H]`` residual stream."""
    gathered: Callable[[TargetShape], int] | None = None
    """A split part gathers these many columns per token instead (``colwise_gather_output``)."""

    def active_params(self, s: TargetShape) -> int:
        return (self.active or self.params)(s)


PARTS: dict[str, LayerPart] = {
    p.name: p
    for p in (
        LayerPart(
            "attention",
            ("self_attn.",),
            layers=_full_layers,
            params=lambda s: (
                s.hidden_size * (_gate(s) * s.num_heads * s.head_dim + 2 * s.num_kv_heads * s.head_dim)
                + s.num_heads * s.head_dim * s.hidden_size
            ),
            extra_flop=lambda s, keys: 4 * s.num_heads * s.head_dim * keys,
            stage="attention",
            working=lambda s, share, a: (
                ((_gate(s) + 2) * s.num_heads * s.head_dim * share + s.num_kv_heads * s.head_dim * share) * a
            ),
            all_reduces=True,
        ),
        LayerPart(
            "linear_attention",
            ("linear_attn.",),
            layers=lambda s: s.num_linear_layers,
            params=lambda s: (
                s.hidden_size * (2 * sum(_dk_dv(s)) + 2 * s.linear_num_value_heads)
                + _dk_dv(s)[1] * s.hidden_size
                + s.linear_conv_kernel_dim * (2 * _dk_dv(s)[0] + _dk_dv(s)[1])
            ),
            extra_flop=lambda s, keys: (
                s.linear_num_value_heads
                * delta_rule_flop_per_head(s.linear_key_head_dim, s.linear_value_head_dim)
            ),
            stage="linear",
            working=lambda s, share, a: (
                4 * (10 * _dk_dv(s)[1] * share + 3 * s.linear_num_value_heads * share * DELTA_CHUNK)
                + 2 * sum(_dk_dv(s)) * share * a
            ),
            gathered=lambda s: 2 * sum(_dk_dv(s)) + 2 * s.linear_num_value_heads + s.hidden_size,
        ),
        LayerPart(
            "mlp",
            ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
            layers=lambda s: 0 if s.num_experts else s.num_layers,
            params=lambda s: 3 * s.hidden_size * s.intermediate_size,
            stage="ffn",
            working=lambda s, share, a: 0 if s.num_experts else 3 * s.intermediate_size * share * a,
            all_reduces=True,
        ),
        LayerPart(
            "experts",
            ("mlp.experts",),
            layers=lambda s: s.num_layers if s.num_experts else 0,
            params=lambda s: s.num_experts * 3 * s.hidden_size * s.moe_intermediate_size,
            active=lambda s: s.num_experts_per_tok * 3 * s.hidden_size * s.moe_intermediate_size,
            stage="ffn",
            working=lambda s, share, a: (
                3 * s.num_experts_per_tok * s.moe_intermediate_size * share * a if s.num_experts else 0
            ),
            all_reduces=True,
        ),
        LayerPart(
            "router",
            (),
            layers=lambda s: s.num_layers if s.num_experts else 0,
            params=lambda s: s.hidden_size * s.num_experts,
            stage="ffn",
            working=lambda s, share, a: s.num_experts * a,
        ),
        LayerPart(
            "shared_expert",
            ("mlp.shared_expert.",),
            layers=lambda s: s.num_layers if s.shared_expert_intermediate_size else 0,
            params=lambda s: 3 * s.hidden_size * s.shared_expert_intermediate_size + s.hidden_size,
            stage="ffn",
            working=lambda s, share, a: (
                3 * s.shared_expert_intermediate_size * share * a if s.num_experts else 0
            ),
            all_reduces=True,
        ),
        LayerPart(
            "embedding",
            (),
            layers=lambda s: 1,
            params=lambda s: s.vocab_size * s.hidden_size,
            active=lambda s: 0,
            all_reduces=True,
        ),
        LayerPart(
            "lm_head",
            (),
            layers=lambda s: 1,
            params=lambda s: 0 if s.tie_word_embeddings else s.vocab_size * s.hidden_size,
            active=lambda s: 0,
        ),
    )
}
"""Every part of a target, in the order the planner prints them."""
DECODER_PARTS = ("attention", "linear_attention", "mlp", "experts", "router", "shared_expert")
STAGE_BASE = {"ffn": 4, "attention": 3}
"""Elements per token every stage holds besides its parts (input, residual, norm output)."""


def params_by_part(s: TargetShape) -> dict[str, int]:
    """Parameters of the target ``*ForCausalLM`` by part (matrices only; norms and biases are
    negligible; all experts; ``lm_head`` 0 when tied)."""
    return {name: p.layers(s) * p.params(s) for name, p in PARTS.items()}


def num_params(s: TargetShape) -> int:
    return sum(params_by_part(s).values())


def active_params(s: TargetShape) -> int:
    """Parameters one token runs through in the decoder layers (``num_experts_per_tok`` experts)."""
    return sum(PARTS[n].layers(s) * PARTS[n].active_params(s) for n in DECODER_PARTS)


def flop_by_part(s: TargetShape, keys_per_query: float) -> dict[str, float]:
    """FLOPs of one token through all decoder layers by part, each including its own kernel, which
    :data:`KERNEL_PARTS` also give alone (``attention_scores``, ``delta_rule``)."""
    out = {
        n: float(
            PARTS[n].layers(s) * (2 * PARTS[n].active_params(s) + PARTS[n].extra_flop(s, keys_per_query))
        )
        for n in DECODER_PARTS
    }
    for sub, part in KERNEL_PARTS.items():
        out[sub] = float(PARTS[part].layers(s) * PARTS[part].extra_flop(s, keys_per_query))
    return out


def working_bytes_per_token(s: TargetShape, a: int, share: Share = _whole) -> dict[str, float]:
    """Bytes per computed token of each forward stage's working set (module docstring); ``share``:
    the share of each part one tensor-parallel rank computes."""
    stages: dict[str, float] = {
        "ffn": STAGE_BASE["ffn"] * s.hidden_size * a,
        "attention": STAGE_BASE["attention"] * s.hidden_size * a,
    }
    if s.num_linear_layers:
        stages["linear"] = 3 * s.hidden_size * a
    for n in DECODER_PARTS:
        p = PARTS[n]
        if p.stage in stages:
            stages[p.stage] += p.working(s, share(n), a)
    return stages


def tp_traffic_per_token(s: TargetShape, split: Callable[[str], bool]) -> tuple[int, int]:
    """``(all-reduces of the [T, H] stream, gathered columns)`` per token of a replica that splits
    the parts ``split`` names."""
    reduces = sum(p.layers(s) for n, p in PARTS.items() if p.all_reduces and split(n))
    gathered = sum(p.layers(s) * p.gathered(s) for n, p in PARTS.items() if p.gathered and split(n))
    return reduces, gathered


@dataclass
class TargetMeta(TargetShape):
    """The one record of a target's shape: every ``TargetShape`` field (what the planner's cost
    model reads), filled from the target's ``config.json`` (``dflash.targets.loader.read_target_meta``)
    or, without one on this machine, from ``target.shape`` (``from_shape``), and what the drafter's
    arch and the loaders read beyond it. Never read from weights."""

    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 0
    text_config: dict = field(default_factory=dict)
    """The text config as a plain dict (rope parameters, partial_rotary_factor, layer_types, ...);
    empty for a target known only by ``target.shape``."""

    @classmethod
    def from_shape(cls, shape: TargetShape) -> TargetMeta:
        """A target known only by ``target.shape`` (the defaults for the fields it lacks; without a
        ``model_type``, the first of the family its shape implies: hybrid shapes are Qwen3.5)."""
        values = {f.name: getattr(shape, f.name) for f in fields(TargetShape)}
        values["model_type"] = shape.model_type or family_of(None, shape).model_types[0]
        return cls(**values)

    @property
    def is_hybrid_linear_attention(self) -> bool:
        """Qwen3.5/3.6-style targets: linear-attention layers keep a recurrent state per row."""
        layer_types = self.text_config.get("layer_types") or []
        return any("linear" in str(t) for t in layer_types) or self.num_linear_layers > 0


def _no_tiny_kwargs(spec: TinyTargetConfig) -> dict[str, Any]:
    return {}


def _moe_tiny_kwargs(spec: TinyTargetConfig) -> dict[str, Any]:
    return dict(
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
    )


def _linear_tiny_kwargs(spec: TinyTargetConfig) -> dict[str, Any]:
    return dict(
        linear_num_key_heads=spec.num_kv_heads,
        linear_num_value_heads=spec.num_heads,
        linear_key_head_dim=spec.head_dim,
        linear_value_head_dim=spec.head_dim,
    )


def _fake_common(s: TargetShape, max_positions: int) -> dict[str, Any]:
    return dict(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        tie_word_embeddings=s.tie_word_embeddings,
        max_position_embeddings=max_positions,
    )


def _fake_moe(s: TargetShape) -> dict[str, Any]:
    return dict(
        num_experts=s.num_experts,
        num_experts_per_tok=s.num_experts_per_tok,
        moe_intermediate_size=s.moe_intermediate_size,
    )


def _fake_linear(s: TargetShape) -> dict[str, Any]:
    """A full-attention layer every ``L / (L - linear)`` layers (the Qwen3.5/3.6 layout)."""
    every = s.num_layers // (s.num_layers - s.num_linear_layers)
    return dict(
        layer_types=[
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(s.num_layers)
        ],
        linear_num_key_heads=s.linear_num_key_heads,
        linear_num_value_heads=s.linear_num_value_heads,
        linear_key_head_dim=s.linear_key_head_dim,
        linear_value_head_dim=s.linear_value_head_dim,
        linear_conv_kernel_dim=s.linear_conv_kernel_dim,
    )


@dataclass(frozen=True)
class TargetFamily:
    """What a family of model types has beyond the part table."""

    name: str
    model_types: tuple[str, ...]
    """transformers text ``model_type`` values (the first builds the rehearsal's fake config)."""
    moe: bool = False
    """Its decoder layers are mixtures of experts (``num_experts > 0``)."""
    linear_attention: bool = False
    """Some decoder layers keep a recurrent state (Gated DeltaNet)."""
    tiny_kwargs: Callable[[TinyTargetConfig], dict[str, Any]] = _no_tiny_kwargs
    """Config fields of a tiny build beyond the dense ones (``dflash.targets.tiny``)."""
    fake_kwargs: Callable[[TargetShape], dict[str, Any]] = lambda s: {}
    """Config fields of the rehearsal's build from ``target.shape`` beyond the dense ones."""
    config_aliases: dict[str, str] = field(default_factory=dict)
    """``TargetShape`` field -> the config.json key this family spells it with."""
    rehearsal_attention: str = "sdpa"
    """The attention the real-size rehearsal runs (a family without SDPA names another)."""
    output_gate: bool = False
    """Full-attention q_proj emits an output gate when config.json does not say."""


DENSE = TargetFamily("dense", ("qwen3", "llama"))
QWEN3_MOE = TargetFamily(
    "qwen3_moe", ("qwen3_moe",), moe=True, tiny_kwargs=_moe_tiny_kwargs, fake_kwargs=_fake_moe
)
GPT_OSS = TargetFamily(
    "gpt_oss",
    ("gpt_oss",),
    moe=True,
    tiny_kwargs=lambda spec: {**_moe_tiny_kwargs(spec), "intermediate_size": spec.moe_intermediate_size},
    fake_kwargs=_fake_moe,
    config_aliases={"moe_intermediate_size": "intermediate_size"},
    rehearsal_attention="eager",  # attention sinks: transformers has no SDPA path for it
)
HYBRID = TargetFamily(
    "hybrid",
    ("qwen3_5_text",),
    linear_attention=True,
    tiny_kwargs=_linear_tiny_kwargs,
    fake_kwargs=_fake_linear,
    output_gate=True,
)
HYBRID_MOE = TargetFamily(
    "hybrid_moe",
    ("qwen3_5_moe_text", "qwen3_next"),
    moe=True,
    linear_attention=True,
    tiny_kwargs=lambda spec: {
        **_linear_tiny_kwargs(spec),
        **_moe_tiny_kwargs(spec),
        "shared_expert_intermediate_size": spec.moe_intermediate_size,
    },
    fake_kwargs=lambda s: {
        **_fake_linear(s),
        **_fake_moe(s),
        "shared_expert_intermediate_size": s.shared_expert_intermediate_size,
    },
    output_gate=True,
)
FAMILIES: tuple[TargetFamily, ...] = (DENSE, QWEN3_MOE, GPT_OSS, HYBRID, HYBRID_MOE)
"""Every family; a model type none lists is dense."""


def family_of(model_type: str | None, shape: TargetShape | None = None) -> TargetFamily:
    """The family of ``model_type``; without one (a planner shape), the family its shape implies."""
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    if model_type is None and shape is not None:
        moe, linear = shape.num_experts > 0, shape.num_linear_layers > 0
        return next(f for f in FAMILIES if (f.moe, f.linear_attention) == (moe, linear))
    return DENSE


def fake_config(s: TargetShape, max_positions: int) -> tuple[str, dict[str, Any]]:
    """``(model_type, config kwargs)`` of a random transformers model of ``target.shape`` (the
    real-size rehearsal builds it under fake tensors)."""
    fam = family_of(s.model_type, s)
    model_type = s.model_type or fam.model_types[0]
    kwargs = {**_fake_common(s, max_positions), **fam.fake_kwargs(s)}
    if s.num_experts and "shared_expert_intermediate_size" not in kwargs:
        kwargs["shared_expert_intermediate_size"] = s.shared_expert_intermediate_size
    return model_type, kwargs


COMMON_ALIASES = {"num_experts": "num_local_experts"}
"""``TargetShape`` field -> another name transformers' configs give it (its ``to_dict`` writes the
attribute-mapped name: Qwen3-MoE's ``num_experts`` is ``num_local_experts`` in transformers 5.25)."""


def meta_from_config(text: dict[str, Any]) -> TargetMeta:
    """The shape of a transformers text config (``config.get_text_config().to_dict()``)."""
    model_type = str(text.get("model_type"))
    fam = family_of(model_type)
    aliases = {**COMMON_ALIASES, **fam.config_aliases}

    def get(name: str, default: Any = None) -> Any:
        """The value under the family's spelling first (gpt-oss's expert width is its intermediate_size),
        then under ``name``."""
        for key in (aliases.get(name), name):
            if key is not None and text.get(key) is not None:
                return text[key]
        return default

    num_heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    intermediate = int(text.get("intermediate_size") or text.get("moe_intermediate_size") or 4 * hidden)
    num_linear = sum("linear" in str(x) for x in text.get("layer_types") or [])
    num_experts = int(get("num_experts") or 0)

    def linear(key: str) -> int:
        return int(text.get(key) or 0) if num_linear else 0

    def moe(key: str, fallback: int = 0) -> int:
        return int(get(key) or fallback) if num_experts else 0

    return TargetMeta(
        model_type=model_type,
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=num_heads,
        num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
        head_dim=int(text.get("head_dim") or hidden // num_heads),
        vocab_size=int(text["vocab_size"]),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        attn_output_gate=bool(text.get("attn_output_gate", fam.output_gate)),
        num_linear_layers=num_linear,
        linear_num_key_heads=linear("linear_num_key_heads"),
        linear_num_value_heads=linear("linear_num_value_heads"),
        linear_key_head_dim=linear("linear_key_head_dim"),
        linear_value_head_dim=linear("linear_value_head_dim"),
        linear_conv_kernel_dim=linear("linear_conv_kernel_dim"),
        num_experts=num_experts,
        num_experts_per_tok=moe("num_experts_per_tok"),
        moe_intermediate_size=moe("moe_intermediate_size", intermediate),
        shared_expert_intermediate_size=moe("shared_expert_intermediate_size"),
        rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
        max_position_embeddings=int(text.get("max_position_embeddings") or 0),
        text_config=dict(text),
    )


def weights_message(
    what: str,
    source: str,
    described: str,
    total: float,
    shares: dict[str, float],
    bytes_per_param: float,
    capacity_bytes: float,
    capacity: str,
) -> str | None:
    """Why ``total`` parameters of ``bytes_per_param`` cannot fit ``capacity_bytes`` (None when they
    fit), naming the shape's fields (``described``) and the largest of ``shares`` (parameters by
    group), checked before anything is allocated."""
    need = total * bytes_per_param
    if need <= capacity_bytes:
        return None
    largest = max(shares, key=lambda k: shares[k])
    gib = 2**30
    return (
        f"{source}: {described} imply {need / gib:.1f} GiB of {what} weights ({total:.3g} parameters x "
        f"{bytes_per_param:g} bytes; {shares[largest] * bytes_per_param / gib:.1f} GiB of it {largest}), more "
        f"than the {capacity_bytes / gib:.1f} GiB of {capacity}: nothing was allocated; fix those fields"
    )


_GROUPS = {
    "the MLP (3 x num_hidden_layers x hidden_size x intermediate_size)": ("mlp",),
    "the experts (num_hidden_layers x num_experts x 3 x hidden_size x moe_intermediate_size)": (
        "experts",
        "router",
        "shared_expert",
    ),
    "the embedding and lm_head (vocab_size x hidden_size)": ("embedding", "lm_head"),
    "the attention weights": ("attention", "linear_attention"),
}
_CONFIG_NAMES = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "num_experts": "num_experts",
    "moe_intermediate_size": "moe_intermediate_size",
}


def described_fields(shape: Any) -> str:
    """``num_hidden_layers=.., hidden_size=.., ...``: the config.json fields a weight count reads
    (the expert fields only when the shape has experts)."""
    names = [n for n in _CONFIG_NAMES if hasattr(shape, n)]
    if not getattr(shape, "num_experts", 0):
        names = [n for n in names if n not in ("num_experts", "moe_intermediate_size")]
    return ", ".join(f"{_CONFIG_NAMES[n]}={getattr(shape, n)}" for n in names)


def target_weights_problem(
    source: str, s: TargetShape, bytes_per_param: float, capacity_bytes: float, capacity: str
) -> str | None:
    """Why the target weights ``s`` implies cannot fit ``capacity_bytes`` (None when they fit)."""
    parts = params_by_part(s)
    shares = {label: float(sum(parts[p] for p in group)) for label, group in _GROUPS.items()}
    return weights_message(
        "target",
        source,
        described_fields(s),
        float(sum(parts.values())),
        shares,
        bytes_per_param,
        capacity_bytes,
        capacity,
    )
