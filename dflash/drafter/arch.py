"""The drafter's architecture record and how a run derives it.

``DrafterArch`` is everything that fixes the drafter's tensors and its train/serve contract (what
``config.json`` of an export carries). ``build_arch`` derives it from the config, the target's
``config.json`` (``TargetMeta``) and, for a warm start, the exported drafter's own arch;
``resolve_mask_token_id`` picks the MASK token; ``rope_from_config`` reads a target's (or an
export's) RoPE settings as the drafter uses them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from dflash.config import DRAFTER_LAYER_TYPES, FULL_ATTENTION, SLIDING_ATTENTION, Config, DrafterConfig
from dflash.config.schema import DrafterFamilyName

if TYPE_CHECKING:
    from dflash.targets.families import TargetMeta


@dataclass
class DrafterArch:
    """Everything that fixes the drafter's tensors and its train/serve contract."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6}
    )
    partial_rotary_factor: float = 1.0
    initializer_range: float = 0.02
    layer_types: list[str] = field(default_factory=list)
    """``full_attention`` / ``sliding_attention`` per layer; empty = all full (filled in)."""
    sliding_window: int | None = None
    """W of the sliding layers (None iff there is none)."""
    family: str = "dflash"
    """The drafter family (``dflash.drafter.families``): ``dflash`` (DFlash-1) or ``dflash2``."""
    conv_kernel_size: int = 2
    """dflash2: taps of each block-local dynamic convolution (slot t mixes slots t-K+1..t)."""
    conv_group_size: int = 16
    """dflash2: channels that share one dynamic coefficient (divides hidden_size)."""
    selector_rank: int = 256
    """dflash2: rank r of the candidate selector's codebooks and hidden projection."""
    selector_top_k: int = 16
    """dflash2: candidates K per slot (the top-K of the drafter's logits)."""

    def __post_init__(self) -> None:
        ids = [int(i) for i in self.target_layer_ids]
        if not ids or min(ids) < 0 or ids != sorted(set(ids)):
            raise ValueError(
                f"target_layer_ids={self.target_layer_ids}: tap ids must be distinct decoder layers >= 0 in "
                "increasing order (vLLM and SGLang collect the taps in layer order)"
            )
        names = [f.value for f in DrafterFamilyName]
        if self.family not in names:
            raise ValueError(f"family={self.family!r}: must be one of {names}")
        if self.family == "dflash2":
            if (
                self.conv_kernel_size < 1
                or self.conv_group_size < 1
                or self.hidden_size % self.conv_group_size
            ):
                raise ValueError(
                    f"conv_kernel_size={self.conv_kernel_size} / conv_group_size={self.conv_group_size}: need "
                    f"both >= 1 and a group size that divides hidden_size={self.hidden_size}"
                )
            if self.selector_rank < 1 or not 1 <= self.selector_top_k <= self.vocab_size:
                raise ValueError(
                    f"selector_rank={self.selector_rank} / selector_top_k={self.selector_top_k}: need a rank >= 1 "
                    f"and 1 <= top_k <= vocab_size={self.vocab_size}"
                )
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.num_layers
        bad = sorted({t for t in self.layer_types if t not in DRAFTER_LAYER_TYPES})
        if bad or len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types={self.layer_types}: need {self.num_layers} entries from {list(DRAFTER_LAYER_TYPES)}"
            )
        sliding = SLIDING_ATTENTION in self.layer_types
        if sliding != (self.sliding_window is not None):
            raise ValueError(
                f"sliding_window={self.sliding_window} with layer_types={self.layer_types}: a window is "
                "needed exactly when a layer is sliding_attention"
            )
        if self.sliding_window is not None and self.sliding_window < max(self.block_size, 2):
            raise ValueError(f"sliding_window={self.sliding_window} must be >= block_size={self.block_size}")
        if "partial_rotary_factor" in self.rope_parameters:
            raise ValueError("rope_parameters holds partial_rotary_factor: give it as the field of its own")
        rotary = int(self.head_dim * self.partial_rotary_factor)
        if rotary < 2 or rotary % 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} rotates {rotary} of head_dim={self.head_dim} "
                "dims; RoPE needs an even number >= 2"
            )

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None for a full-attention layer)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def qwen3_config(self) -> Qwen3Config:
        """The Qwen3 config of the drafter layers (what the public ``config.json`` carries)."""
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
            initializer_range=self.initializer_range,
            attention_bias=False,
            tie_word_embeddings=False,
            layer_types=list(self.layer_types),
            use_sliding_window=self.sliding_window is not None,
            sliding_window=self.sliding_window,
            max_window_layers=self.num_layers,
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict, without the fields of another family (a DFlash-1 arch reads as it did
        before families existed, so its run contract and checkpoints are unchanged)."""
        d = asdict(self)
        own = family_fields(self.family)
        for name in {f for fields in FAMILY_FIELDS.values() for f in fields} - set(own):
            d.pop(name)
        if self.family == "dflash":
            d.pop("family")
        return d


FAMILY_FIELDS: dict[str, tuple[str, ...]] = {
    "dflash2": ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
}
"""The ``DrafterArch`` fields each family adds to the shared ones (written to ``dflash_config``); a
family without any has no entry."""


def family_fields(family: str) -> tuple[str, ...]:
    """The ``DrafterArch`` fields ``family`` adds (``dflash_config`` keys of its export)."""
    return FAMILY_FIELDS.get(family, ())


ROPE_KEYS_DROPPED = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
"""Rope keys the drafter's ``rope_parameters`` leave out: the partial factor is a field of its own, and
the drafter's positions are text positions, where M-RoPE (equal t/h/w positions) is plain RoPE."""


def rope_from_config(config: dict) -> tuple[dict[str, Any], float]:
    """(rope_parameters, partial_rotary_factor) as the drafter uses them, from a target's text config
    or an exported drafter's config: theta and scaling (YaRN, llama3, ...) kept, the legacy
    ``rope_scaling``/``rope_theta``/``type`` keys read, M-RoPE reduced to RoPE over text positions."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    legacy_type = rope.pop("type", "default")
    rope.setdefault("rope_type", legacy_type)
    rope.setdefault("rope_theta", config.get("rope_theta", 1e6))
    if rope["rope_type"] == "mrope":  # older VLM configs name the M-RoPE sections as a rope type
        rope["rope_type"] = "default"
    partial = float(config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    return {k: v for k, v in rope.items() if k not in ROPE_KEYS_DROPPED}, partial


def mask_token_problem(tid: int, tokenizer: Any, vocab_size: int) -> str | None:
    """Why ``tid`` cannot be the MASK token of a target with this tokenizer and ``vocab_size`` embedding
    rows (None when it can). A MASK is the tokenizer's mask token, another special token, or an embedding
    row past the tokenizer; never pad, eos or bos, nor a token of ordinary text, whose embedding the
    drafter would read as that text in every MASK slot (tau drops, silently)."""
    if not 0 <= tid < vocab_size:
        return f"outside the target vocabulary [0, {vocab_size})"
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(tokenizer, name, None) == tid:
            return f"the tokenizer's {name} ({tokenizer.convert_ids_to_tokens(tid)!r})"
    if tid >= len(tokenizer) or tid == getattr(tokenizer, "mask_token_id", None):
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(tid)
    if added is not None and getattr(added, "special", False):
        return None
    return f"the text token {tokenizer.convert_ids_to_tokens(tid)!r} (not a special token)"


def default_mask_token_id(tokenizer: Any, vocab_size: int) -> int | None:
    """The MASK a run picks when neither the config nor a warm start names one: the tokenizer's mask
    token, else the first embedding row past the tokenizer (None: neither is usable)."""
    for tid in (getattr(tokenizer, "mask_token_id", None), len(tokenizer)):
        if tid is not None and mask_token_problem(tid, tokenizer, vocab_size) is None:
            return int(tid)
    return None


def resolve_mask_token_id(
    configured: int | None, from_checkpoint: int | None, tokenizer: Any, vocab_size: int
) -> int:
    """Config, then the drafter checkpoint, then ``default_mask_token_id``; ValueError naming the source
    and the fix when the first of them that is set fails ``mask_token_problem``. A saved id that fails
    it is passed over when the config names a valid one (the warm start then learns the new MASK)."""
    default = default_mask_token_id(tokenizer, vocab_size)
    fix = (
        f"set drafter.mask_token_id={default}"
        if default is not None
        else "set drafter.mask_token_id=<an unused row>"
    )
    if configured is not None:
        problem = mask_token_problem(configured, tokenizer, vocab_size)
        if problem:
            raise ValueError(f"mask token id {configured} from drafter.mask_token_id is {problem}; {fix}")
        return int(configured)
    if from_checkpoint is not None:
        problem = mask_token_problem(from_checkpoint, tokenizer, vocab_size)
        if problem:
            raise ValueError(
                f"mask token id {from_checkpoint} from the drafter.init_from checkpoint (dflash_config.mask_token_id) "
                f"is {problem}, a MASK that degrades acceptance silently; {fix} to warm-start with a new MASK "
                "(learned anew), or warm-start from an export with a valid one"
            )
        return int(from_checkpoint)
    if default is None:
        raise ValueError(
            f"no MASK token: the tokenizer has {len(tokenizer)} tokens and the target embedding {vocab_size} rows, "
            f"so there is no unused row; set drafter.mask_token_id=<a special token that is not pad/eos/bos>"
        )
    return default


def build_arch(
    cfg: Config,
    meta: TargetMeta,
    layer_ids: list[int],
    mask_token_id: int,
    saved: DrafterArch | None = None,
) -> DrafterArch:
    """The drafter architecture: shape from the config or the target, attention layout and partial
    rotary from the config, else from the ``drafter.init_from`` checkpoint (``saved``), else the defaults
    (all full attention, the target's partial rotary factor). ValueError on an inconsistent layout."""
    d = cfg.drafter
    rope, target_partial = rope_from_config(meta.text_config)
    src = saved if saved is not None and saved.num_layers == d.num_layers else None
    if d.layer_types is not None:
        layer_types = [str(t) for t in d.layer_types]
    else:
        layer_types = list(src.layer_types) if src else [FULL_ATTENTION] * d.num_layers
    window = d.sliding_window
    if window is None and src is not None and SLIDING_ATTENTION in layer_types:
        window = src.sliding_window
    partial = d.partial_rotary_factor
    if partial is None:
        partial = saved.partial_rotary_factor if saved is not None else target_partial
    return DrafterArch(
        hidden_size=meta.hidden_size,
        intermediate_size=d.intermediate_size or meta.intermediate_size,
        num_layers=d.num_layers,
        num_heads=d.num_heads or meta.num_heads,
        num_kv_heads=d.num_kv_heads or meta.num_kv_heads,
        head_dim=d.head_dim or meta.head_dim,
        vocab_size=meta.vocab_size,
        target_layer_ids=list(layer_ids),
        block_size=d.block_size,
        mask_token_id=mask_token_id,
        rms_norm_eps=meta.rms_norm_eps,
        max_position_embeddings=meta.max_position_embeddings,
        rope_parameters=rope,
        partial_rotary_factor=partial,
        initializer_range=d.init_std,
        layer_types=layer_types,
        sliding_window=window,
        family=str(d.family),
        **{name: getattr(d, name) for name in family_fields(str(d.family))},
    )


def arch_problems(cfg: DrafterConfig, meta: TargetMeta) -> list[str]:
    """Problems of the drafter settings that only the target's config shows (still no weights)."""
    p: list[str] = []
    if cfg.hidden_size is not None and cfg.hidden_size != meta.hidden_size:
        p.append(
            f"drafter.hidden_size={cfg.hidden_size} differs from the target's hidden_size={meta.hidden_size}; "
            f"the drafter reuses the target's embedding and lm_head, so set drafter.hidden_size=null"
        )
    heads = cfg.num_heads or meta.num_heads
    kv = cfg.num_kv_heads or meta.num_kv_heads
    if heads % kv:
        p.append(f"drafter.num_heads={heads} is not a multiple of drafter.num_kv_heads={kv}")
    head_dim = cfg.head_dim or meta.head_dim
    partial = cfg.partial_rotary_factor or rope_from_config(meta.text_config)[1]
    rotary = int(head_dim * partial)
    if rotary < 2 or rotary % 2:
        p.append(
            f"drafter.partial_rotary_factor={partial} rotates {rotary} of the drafter's head_dim={head_dim} dims; "
            "RoPE needs an even number >= 2: set drafter.partial_rotary_factor (e.g. 1.0)"
        )
    return p
