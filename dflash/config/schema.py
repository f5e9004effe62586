"""Typed config schemas, their resume tags, Hydra ConfigStore registration, and the user-error type.

Every YAML group in ``conf/`` is validated against the dataclasses below at compose time (a typo
or a wrong type fails before anything runs). The checks that need several fields at once are in
:mod:`dflash.config.checks` (``validate``). Each field's documentation lives beside its type.

Long because it is the one place every config field is declared and documented (one dataclass per
group); it holds no logic beyond the field metadata and ``to_config``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import signal
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

# Every leaf field says what a change of it means for a resumed run (``resume``):
#   CONTRACT   its value is part of the run contract: a resume with another value is refused
#              (unless train.allow_contract_change=true), because the checkpoint's state would
#              be mixed with a different objective, model or schedule;
#   derived(k) it is covered by the resolved contract entry k that setup computes from it (e.g. the
#              tap ids from layer_ids/num_taps), so only a change of the outcome is refused;
#   FREE       how the run is executed or observed; may change between launches.
# DataConfig fields also say whether they shape the tokenized dataset (``data``: part of the
# dataset fingerprint, the cache key). tests/unit/test_config.py fails on an untagged field.
RESUME_KINDS = ("contract", "derived", "free")
CONTRACT: dict[str, Any] = {"resume": "contract"}
FREE: dict[str, Any] = {"resume": "free"}


def derived(key: str, *, data: bool | None = None) -> dict[str, Any]:
    """Field metadata: covered by the resolved contract entry ``key`` (see ``RESOLVED_CONTRACT_KEYS``)."""
    meta: dict[str, Any] = {"resume": "derived", "covered_by": key}
    if data is not None:
        meta["data"] = data
    return meta


def data_field(resume: dict[str, Any], shapes_dataset: bool) -> dict[str, Any]:
    """DataConfig field metadata: the resume tag plus whether it is part of the dataset fingerprint."""
    return {**resume, "data": shapes_dataset}


RESOLVED_CONTRACT_KEYS = (
    "target.weights",
    "target.layer_ids",
    "target.hidden_size",
    "target.vocab_size",
    "drafter.arch",
    "data.fingerprint",
    "data.plan",
    "train.num_steps",
    "topology.packets_per_step",
)
"""Contract entries that ``dflash.train.setup.prepare`` resolves (beside the CONTRACT-tagged raw values)."""


# ----------------------------------------------------------------------------------------------
# Choices. A ``StrEnum`` field takes one of its members' names in YAML and on the command line; any
# other value fails when Hydra composes the config. Members compare equal to their strings.


class Backend(StrEnum):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class TargetDtype(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class DrafterDtype(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


class Attention(StrEnum):
    auto = "auto"
    sdpa = "sdpa"
    flex = "flex"


class Checkpointing(StrEnum):
    none = "none"
    layers = "layers"
    auto = "auto"


class DrafterShard(StrEnum):
    none = "none"
    optimizer = "optimizer"
    full = "full"


class OptimName(StrEnum):
    adamw = "adamw"
    muon = "muon"


class MuonAdjustLr(StrEnum):
    original = "original"
    match_rms_adamw = "match_rms_adamw"


class DrafterFamilyName(StrEnum):
    dflash = "dflash"
    dflash2 = "dflash2"


class SelectorLabel(StrEnum):
    data = "data"
    verifier = "verifier"


class SelectorMissing(StrEnum):
    exclude = "exclude"
    inject = "inject"


class SelectorWeighting(StrEnum):
    base = "base"
    uniform = "uniform"


class Overlong(StrEnum):
    truncate = "truncate"
    skip = "skip"


class OnNonfinite(StrEnum):
    error = "error"
    skip = "skip"


class LoggingMode(StrEnum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


class LayerType(StrEnum):
    full_attention = "full_attention"
    sliding_attention = "sliding_attention"


@dataclass
class TopologyConfig:
    """How the ranks of a launch split into targets and drafters (``topology.mode``), and their timeouts."""

    # Which rank makes a packet does not change what is trained: only how many packets an optimizer
    # step takes (num_drafters x optim.grad_accum_steps) is part of the resume contract.
    num_targets: int = field(default=2, metadata=FREE)
    """Target replicas (frozen target copies) on ranks 0..N*target_tp-1; 0 with mode=colocated."""
    num_drafters: int | None = field(default=1, metadata=derived("topology.packets_per_step"))
    """Drafter ranks N*k..N*k+M-1 (k = target_tp), training data-parallel; the first is the leader
    (checkpoints, W&B). None = every rank the targets leave (WORLD_SIZE - num_targets x target_tp;
    every rank when co-located)."""
    drafter_nodes: int | None = field(default=None, metadata=FREE)
    """Several nodes: the last ``drafter_nodes`` nodes hold only drafters (their gradient all-reduce
    stays on NVLink), the nodes before them only targets. Sets num_drafters = drafter_nodes x
    LOCAL_WORLD_SIZE and num_targets = the rest (in replicas of target_tp); leave num_drafters=null."""
    mode: str = field(default="split", metadata=FREE)
    """How the ranks split (``dflash.config.modes``): ``split`` (num_targets target replicas send
    packets to the drafters) or ``colocated`` (every rank holds the target and a drafter replica and
    makes its own packets, no send/recv: one GPU, small hosts; num_targets=0, num_drafters=null)."""
    backend: Backend = field(default=Backend.auto, metadata=FREE)
    """auto (nccl when CUDA is available, else gloo), nccl or gloo."""
    device: Device = field(default=Device.auto, metadata=FREE)
    """auto, cpu or cuda."""
    init_timeout_s: float = field(default=600.0, metadata=FREE)
    """Process-group timeout until the first step ends (model loading is slow)."""
    first_contact_timeout_s: float = field(default=120.0, metadata=FREE)
    """How long the first message on each link may take: it goes before any model loads, so a peer
    that stays silent is stuck (NCCL blocked by PCIe ACS/IOMMU, a firewall), not busy; the error
    names the likely causes and fixes."""
    step_timeout_s: float = field(default=300.0, metadata=FREE)
    """Timeout of every wait after the first step: a dead or stuck peer is reported after this. Targets
    wait twice as long for the drafter, which may itself be waiting this long on another target."""
    max_in_flight: int = field(default=2, metadata=FREE)
    """Packets a target may send before the drafter acknowledges the oldest one (backpressure)."""
    target_tp: int = field(default=1, metadata=FREE)
    """Ranks per target replica: each of the num_targets replicas holds one target sharded over
    target_tp consecutive ranks (tensor parallel; experts split by expert where transformers can),
    so the world is num_targets x target_tp + num_drafters; the replica's first rank sends its
    packets. On several nodes it must divide the GPUs of a node (a replica never spans nodes).
    Not with mode=colocated or eval.every > 0 (both run the whole target on one rank)."""


@dataclass
class TinyTargetConfig:
    """A small target built locally from a config, trained for a fixed number of steps on stdlib
    code (``dflash.targets.tiny``) and saved with save_pretrained; the whole spec is its cache key.
    The default spec's build ships with the package (the same weights on every CPU) and is copied."""

    model_type: str = field(default="qwen3", metadata=CONTRACT)
    """transformers model type of the tiny target (its family: ``dflash.targets.families``)."""
    num_layers: int = field(default=6, metadata=CONTRACT)
    """Decoder layers."""
    hidden_size: int = field(default=128, metadata=CONTRACT)
    """Hidden size."""
    intermediate_size: int = field(default=384, metadata=CONTRACT)
    """FFN width of a dense layer."""
    num_heads: int = field(default=4, metadata=CONTRACT)
    """Attention heads."""
    num_kv_heads: int = field(default=2, metadata=CONTRACT)
    """Key-value heads (grouped-query attention)."""
    head_dim: int = field(default=32, metadata=CONTRACT)
    """Dimension of one head."""
    extra_vocab: int = field(default=64, metadata=CONTRACT)
    """Embedding rows past the tokenizer's vocabulary (the first is the MASK token)."""
    init_std: float = field(default=0.02, metadata=CONTRACT)
    """Standard deviation of the random initial weights."""
    seed: int = field(default=0, metadata=CONTRACT)
    """Initialisation and training data order."""
    train_steps: int = field(default=400, metadata=CONTRACT)
    """Optimizer steps of next-token training on chat samples cut from stdlib code (0 = random weights)."""
    train_batch_size: int = field(default=4, metadata=CONTRACT)
    """Rows per training step of the tiny target."""
    train_seq_len: int = field(default=128, metadata=CONTRACT)
    """Tokens per row in its training."""
    train_lr: float = field(default=3e-3, metadata=CONTRACT)
    """Peak learning rate of its training (warmup, then cosine decay)."""
    num_experts: int = field(default=0, metadata=CONTRACT)
    """Routed experts of every decoder layer (model_type qwen3_moe, qwen3_5_moe_text, gpt_oss); 0 = dense."""
    num_experts_per_tok: int = field(default=2, metadata=CONTRACT)
    """Experts each token is routed to (MoE types)."""
    moe_intermediate_size: int = field(default=64, metadata=CONTRACT)
    """FFN width of one expert (and of qwen3_5_moe_text's shared expert)."""

    def key(self) -> dict[str, Any]:
        """The cache key of a build: every field, the expert fields only for an MoE spec (so a dense
        spec keeps the key it had before those fields existed)."""
        key = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if not self.num_experts:
            for k in TINY_MOE_FIELDS:
                key.pop(k)
        return key

    def cache_subdir(self) -> str:
        """Where under ``paths.cache_dir`` this spec's build lives (conf/target/tiny.yaml):
        ``tiny_targets/<model_type>-<12 hex digits of the key's sha256>``, one directory per spec,
        so switching specs (dense, hybrid, MoE) never rebuilds another's."""
        digest = hashlib.sha256(json.dumps(self.key(), sort_keys=True).encode()).hexdigest()
        return f"tiny_targets/{self.model_type}-{digest[:12]}"


TINY_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def _tiny_subdir(spec: DictConfig | None) -> str:
    """``${dflash.tiny_dir:${.tiny}}``: ``TinyTargetConfig.cache_subdir`` of ``target.tiny``."""
    if spec is None:
        return "tiny_targets/none"  # target.tiny=null: the user's target.path is what loads
    fields = OmegaConf.to_container(spec, resolve=True)
    assert isinstance(fields, dict)
    return TinyTargetConfig(**{str(k): v for k, v in fields.items()}).cache_subdir()


if not OmegaConf.has_resolver("dflash.tiny_dir"):
    OmegaConf.register_new_resolver("dflash.tiny_dir", _tiny_subdir)


@dataclass
class TargetShape:
    """The target's shape as its ``config.json`` (text config) gives it: what the planner needs
    without a download (``python -m dflash.plan``, ``dflash.sizing.costs``). When the checkpoint's
    config.json is readable the planner reads it and reports any field that disagrees."""

    num_layers: int = field(default=MISSING, metadata=FREE)
    """num_hidden_layers (all decoder layers, linear-attention ones included)."""
    hidden_size: int = field(default=MISSING, metadata=FREE)
    """hidden_size."""
    intermediate_size: int = field(default=MISSING, metadata=FREE)
    """intermediate_size (FFN width of a dense layer)."""
    num_heads: int = field(default=MISSING, metadata=FREE)
    """num_attention_heads of the full-attention layers."""
    num_kv_heads: int = field(default=MISSING, metadata=FREE)
    """num_key_value_heads of the full-attention layers."""
    head_dim: int = field(default=MISSING, metadata=FREE)
    """head_dim."""
    vocab_size: int = field(default=MISSING, metadata=FREE)
    """vocab_size (rows of the embedding and the lm_head)."""
    tie_word_embeddings: bool = field(default=False, metadata=FREE)
    """The lm_head shares the embedding's weights (counted once)."""
    attn_output_gate: bool = field(default=False, metadata=FREE)
    """Qwen3.5/3.6 full attention: q_proj also emits a per-head output gate (2x its width)."""
    num_linear_layers: int = field(default=0, metadata=FREE)
    """Hybrid targets (Qwen3.5/3.6): decoder layers with Gated DeltaNet linear attention."""
    linear_num_key_heads: int = field(default=0, metadata=FREE)
    """Gated DeltaNet key heads (hybrid targets)."""
    linear_num_value_heads: int = field(default=0, metadata=FREE)
    """Gated DeltaNet value heads (hybrid targets)."""
    linear_key_head_dim: int = field(default=0, metadata=FREE)
    """Gated DeltaNet key head dimension."""
    linear_value_head_dim: int = field(default=0, metadata=FREE)
    """Gated DeltaNet value head dimension."""
    linear_conv_kernel_dim: int = field(default=0, metadata=FREE)
    """Width of the Gated DeltaNet causal convolution."""
    model_type: str | None = field(default=None, metadata=FREE)
    """transformers model_type of the text config: the planner reads its tensor/expert-parallel plans
    (None: a dense model whose plan splits attention and MLP)."""
    num_experts: int = field(default=0, metadata=FREE)
    """Mixture of experts: routed experts per decoder layer (0 = dense MLP of intermediate_size)."""
    num_experts_per_tok: int = field(default=0, metadata=FREE)
    """Routed experts each token runs through."""
    moe_intermediate_size: int = field(default=0, metadata=FREE)
    """FFN width of one routed expert."""
    shared_expert_intermediate_size: int = field(default=0, metadata=FREE)
    """FFN width of the always-active shared expert (Qwen3.5/3.6 MoE); 0 = none."""


@dataclass
class TargetConfig:
    """The frozen target: where its checkpoint is, its dtype, its tapped layers and attention kernel."""

    name: str = field(default=MISSING, metadata=CONTRACT)
    """A name for the target (logs, W&B, the run contract)."""
    path: str = field(default=MISSING, metadata=CONTRACT)
    """Local directory or hub id of the target checkpoint (or the build dir of a tiny target)."""
    tiny: TinyTargetConfig | None = field(default=None, metadata=CONTRACT)
    """When set, the target (and its tokenizer) is built offline at ``path`` if missing."""
    dtype: TargetDtype = field(default=TargetDtype.auto, metadata=CONTRACT)
    """auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16: the hidden states' dtype."""
    layer_ids: list[int] | None = field(default=None, metadata=derived("target.layer_ids"))
    """Tapped decoder layers (tap l = output of layer l); None = round(1 + i*(L-4)/(n-1))."""
    num_taps: int | None = field(default=None, metadata=derived("target.layer_ids"))
    """Number of taps when layer_ids is None (None = 5); must equal len(layer_ids) when both are set."""
    attn_implementation: str = field(default="auto", metadata=FREE)
    """transformers' attention of the target: auto (on CUDA a kernel that computes only the pairs
    inside each packed document: flash_attention_2 when installed, else flex_attention where the model
    supports it; sdpa for padded rows and on CPU: dflash.config.resolve.target_attention), or a name
    transformers knows (sdpa, eager, flex_attention, flash_attention_2, ...)."""
    pack: bool = field(default=True, metadata=FREE)
    """Pack several sequences in one row (position ids restart per sequence); False pads (Qwen3.5)."""
    trust_remote_code: bool = field(default=False, metadata=FREE)
    """Run the checkpoint's own Python files (transformers ``trust_remote_code``); pin
    ``revision`` with it."""
    revision: str | None = field(default=None, metadata=CONTRACT)
    """A full commit hash; required when trust_remote_code is true."""
    tokenizer: str | None = field(default=None, metadata=CONTRACT)
    """Tokenizer path or hub id; None = the target path."""
    random_weights: bool = field(default=False, metadata=CONTRACT)
    """Build the target from its config.json with random weights on the device (no weights file):
    for throughput checks at real size (scripts/gpu_check.py), never for a drafter you keep."""
    shape: TargetShape | None = field(default=None, metadata=FREE)
    """The target's shape for the planner (no download needed); checked against config.json when readable."""


DEFAULT_NUM_TAPS = 5
FULL_ATTENTION: str = LayerType.full_attention.value
SLIDING_ATTENTION: str = LayerType.sliding_attention.value
DRAFTER_LAYER_TYPES: tuple[str, ...] = tuple(t.value for t in LayerType)
"""Attention kinds of a drafter layer; the names are those of ``layer_types`` in the exported config."""


@dataclass
class DrafterConfig:
    """The DFlash drafter: its shape (None = the target's), anchors, attention and memory levers."""

    num_layers: int = field(default=5, metadata=derived("drafter.arch"))
    """Drafter decoder layers (5 in the published Qwen3 drafters)."""
    family: DrafterFamilyName = field(default=DrafterFamilyName.dflash, metadata=derived("drafter.arch"))
    """dflash (DFlash-1) or dflash2 (a block-local dynamic convolution around each layer's attention and
    MLP, and a candidate selector walked as one chain per block; docs/training.md)."""
    conv_kernel_size: int = field(default=2, metadata=derived("drafter.arch"))
    """dflash2: taps of each dynamic convolution (slot t mixes slots t-K+1..t of its own block)."""
    conv_group_size: int = field(default=16, metadata=derived("drafter.arch"))
    """dflash2: channels sharing one dynamic coefficient (must divide the hidden size)."""
    selector_rank: int = field(default=256, metadata=derived("drafter.arch"))
    """dflash2: rank of the candidate selector's codebooks and hidden projection."""
    selector_top_k: int = field(default=16, metadata=derived("drafter.arch"))
    """dflash2: candidates per slot the selector chooses among (the top-K of the drafter's logits)."""
    block_size: int = field(default=16, metadata=derived("drafter.arch"))
    """Tokens per block: the anchor and block_size - 1 MASK slots (16 in the recipe)."""
    num_anchors: int = field(default=512, metadata=CONTRACT)
    """Anchors sampled per sequence every step (without replacement)."""
    max_anchors_per_packet: int | None = field(default=None, metadata=CONTRACT)
    """Cap on the anchors of one packet (all its sequences together); None = no cap."""
    hidden_noise_std: float = field(default=0.0, metadata=CONTRACT)
    """Training only: Gaussian noise of this standard deviation (in the hidden states' own units) added
    to the context hidden states the drafter reads (the target's taps, never the final hidden state
    the verifier logits come from), drawn from ``train.seed`` and the packet's index, so a resumed run
    draws the same; never in an eval or an export. 0 = none (speculators' ``--noise-std``)."""
    mask_token_id: int | None = field(default=None, metadata=derived("drafter.arch"))
    """None = drafter checkpoint, then the tokenizer's mask token, then the first row past the vocab."""
    hidden_size: int | None = field(default=None, metadata=derived("drafter.arch"))
    """Must equal the target's (the drafter reuses its embedding and lm_head); None = the target's."""
    intermediate_size: int | None = field(default=None, metadata=derived("drafter.arch"))
    """None = the target's intermediate size."""
    num_heads: int | None = field(default=None, metadata=derived("drafter.arch"))
    """None = the target's attention heads (likewise num_kv_heads, head_dim)."""
    num_kv_heads: int | None = field(default=None, metadata=derived("drafter.arch"))
    """Key-value heads (None = the target's)."""
    head_dim: int | None = field(default=None, metadata=derived("drafter.arch"))
    """Head dimension (None = the target's)."""
    layer_types: list[LayerType] | None = field(default=None, metadata=derived("drafter.arch"))
    """Per layer 'full_attention' or 'sliding_attention' (num_layers entries); None = those of the
    drafter.init_from checkpoint, else all full. See dflash/drafter/blocks.py for what each one sees."""
    sliding_window: int | None = field(default=None, metadata=derived("drafter.arch"))
    """W: a sliding layer's query at position p sees the keys at positions p-W+1..p (W keys, itself
    included; causal inside its block); needed iff a layer is sliding, >= block_size; None = the
    drafter.init_from checkpoint's."""
    partial_rotary_factor: float | None = field(default=None, metadata=derived("drafter.arch"))
    """Share of each head's dims that RoPE rotates; None = the drafter.init_from checkpoint's, else the
    target's. SGLang's DFlash model rotates the whole head whatever the config says: 1.0 to serve there."""
    attention: Attention = field(default=Attention.auto, metadata=FREE)
    """auto (flex on CUDA, sdpa on CPU), flex or sdpa: the same function, two kernels."""
    compile: bool = field(default=True, metadata=FREE)
    """torch.compile each drafter layer's training forward on CUDA (one graph per layer, static shapes
    with flex; the same results); acts only on CUDA. False: eager layers (flex is still compiled)."""
    dtype: DrafterDtype = field(default=DrafterDtype.auto, metadata=FREE)
    """Compute dtype of the drafter: auto (bfloat16 autocast on GPU, float32 on CPU)."""
    init_from: str | None = field(default=None, metadata=FREE)
    """An exported drafter directory (public DFlash layout) to warm-start from (used at step 0 only)."""
    init_std: float = field(default=0.02, metadata=FREE)
    """Std of the random initialisation (used at step 0 only)."""
    activation_checkpointing: Checkpointing = field(default=Checkpointing.none, metadata=FREE)
    """none, layers (each drafter layer keeps only its inputs and runs its forward again in backward:
    about half the drafter's memory for ~+21% of its FLOPs; the same results) or auto (layers when the
    planner finds that the drafter would not fit the GPU at these anchors without it)."""
    block_chunks: int | None = field(default=None, metadata=FREE)
    """The blocks of a packet run in this many chunks, each its forward, loss and backward in turn,
    with the context's keys and values computed once: memory for one chunk's activations and
    nothing computed twice (the same results to rounding). None (auto): the fewest chunks with
    which the drafter fits its GPU without activation checkpointing (the planner's decision, logged;
    1 on a CPU); 1: all blocks at once."""
    shard: DrafterShard = field(default=DrafterShard.none, metadata=FREE)
    """Drafter state over the drafters (FSDP2 on the drafter group): none (replicated), optimizer
    (AdamW moments and gradients sharded, weights gathered whole for the step) or full (weights too,
    gathered one layer at a time). The exported drafter is always whole."""


@dataclass
class DataConfig:
    """The training data: sources, lengths, the packets' token budget and the data plan."""

    path: Any = field(default=MISSING, metadata=data_field(derived("data.fingerprint"), False))
    """A path or a list of paths (``data.path=[a.jsonl,b.parquet]``): a JSONL file, any other data
    file (parquet, csv, arrow, a JSON array), a folder, a glob, a hub dataset id, or 'embedded'
    (built offline); see ``dflash.data.sources``. Typed Any because OmegaConf structured configs
    support no ``str | list[str]``; ``dflash.data.sources.source_paths`` checks the value."""
    split: str = field(default="train", metadata=data_field(derived("data.fingerprint"), True))
    """The split of a ``datasets`` source (hub datasets, files read by ``datasets``)."""
    max_length: int = field(default=2048, metadata=data_field(derived("data.fingerprint"), True))
    """Longest sample in tokens; a longer one is truncated or skipped (``overlong``)."""
    overlong: Overlong = field(
        default=Overlong.truncate, metadata=data_field(derived("data.fingerprint"), True)
    )
    """truncate or skip samples longer than max_length."""
    token_budget: int = field(default=16384, metadata=data_field(derived("data.plan"), False))
    """Tokens per packet (sum of the packed sequence lengths)."""
    num_epochs: int = field(default=1, metadata=data_field(derived("data.plan"), False))
    """Passes over the data the plan schedules (each with its own shuffle)."""
    seed: int = field(default=42, metadata=data_field(derived("data.plan"), False))
    """Seed of the data plan's shuffle (which samples go into which packet)."""
    train_only_last_turn: bool = field(default=False, metadata=data_field(derived("data.fingerprint"), True))
    """Supervise only the last assistant turn of each conversation."""
    max_skip_fraction: float = field(default=0.1, metadata=data_field(FREE, False))
    """Abort when more than this fraction of the samples is skipped as bad input."""
    cache_dir: str = field(default="${paths.cache_dir}/data", metadata=data_field(FREE, False))
    """Where tokenized datasets are cached (keyed on everything that shapes them)."""
    num_samples: int | None = field(default=None, metadata=data_field(derived("data.fingerprint"), True))
    """Use only the first N conversations (None = all)."""
    embedded_num_prompts: int = field(default=512, metadata=data_field(derived("data.fingerprint"), False))
    """Prompts of the embedded default corpus (responses regenerated by the target)."""
    embedded_max_new_tokens: int = field(default=96, metadata=data_field(derived("data.fingerprint"), False))
    """Longest answer the target writes for an embedded prompt."""
    num_eval_prompts: int | None = field(default=None, metadata=data_field(derived("data.fingerprint"), True))
    """Held-out conversations (taken from the end, never trained on) for eval; None = eval.num_prompts
    when eval.every > 0, else 0."""
    chat_template_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata=data_field(derived("data.fingerprint"), True)
    )
    """Passed to apply_chat_template wherever a conversation is rendered: training samples, eval
    prompts, the embedded corpus; ``dflash.data.regenerate`` takes the same setting. Must match how
    the target is served (e.g. {enable_thinking: false} for Qwen3 served without thinking)."""
    max_record_chars: int | None = field(default=None, metadata=data_field(derived("data.fingerprint"), True))
    """Cap on the content characters of one record, applied before rendering: beyond it the record
    is cut (overlong=truncate, when an assistant turn starts before the cap) or skipped as too_long,
    so one huge record costs no more than a long one. None = 32 x max_length."""
    num_workers: int = field(default=1, metadata=data_field(FREE, False))
    """Tokenizer processes that build the dataset cache (same result for any number)."""


@dataclass
class ChatTemplateConfig:
    """The ``data`` section of the apps that render chat prompts besides training (``dflash.eval``,
    ``dflash.data.regenerate``): the same key as training's, so one override fits every app."""

    chat_template_kwargs: dict[str, Any] = field(default_factory=dict, metadata=FREE)
    """Passed to apply_chat_template (e.g. {enable_thinking: false}); must match training's
    data.chat_template_kwargs and the serving setting."""


TERM: dict[str, Any] = {**CONTRACT, "loss_term": True}
"""A loss term's coefficient (``dflash.loss.terms`` holds its record; checked as >= 0, not all 0)."""


@dataclass
class LossConfig:
    """The loss terms' coefficients (``dflash.loss.terms``), the slot decay and the chunked loss's settings."""

    ce: float = field(default=1.0, metadata=TERM)
    """Cross-entropy with the data token."""
    kl: float = field(default=0.0, metadata=TERM)
    """T^2 KL(verifier || drafter) at ``temperature``."""
    verifier_ce: float = field(default=0.0, metadata=TERM)
    """Cross-entropy with the verifier's argmax (the target's greedy token)."""
    temperature: float = field(default=1.0, metadata=CONTRACT)
    """T of the KL term (the CE terms are at T = 1)."""
    gamma: float = field(default=7.0, metadata=CONTRACT)
    """Slot weight exp(-(k-1)/gamma) (not with dpace, whose weights replace it)."""
    dpace: float = field(default=0.0, metadata=CONTRACT)
    """D-PACE (arXiv 2605.18810) with this a in (0, 1]; 0 = off. Each slot's loss is weighted by a
    detached, acceptance-aware factor in place of the decay: q_j = exp(-l_j) of the slot's loss (ce
    and/or verifier_ce), C_j = prod_{i<=j} ((1-a) q_i + a), w_j = sum_{m>=j} C_m over the block's
    supervised slots (conf/loss/dpace.yaml: a = 0.5, the paper's default)."""
    dpace_normalizer: str = field(default="sum", metadata=CONTRACT)
    """With dpace: the loss is divided by the sum of the D-PACE weights (sum) or by the number of
    supervised slots (count)."""
    selector: float = field(default=1.0, metadata=CONTRACT)
    """drafter.family=dflash2: alpha, the coefficient of the selector loss (a K-way cross-entropy over
    each slot's top-K candidates with the true previous token as predecessor) added to the base loss."""
    selector_label: SelectorLabel = field(default=SelectorLabel.data, metadata=CONTRACT)
    """dflash2: the selector's label, the data token (data) or the verifier's argmax (verifier)."""
    selector_missing: SelectorMissing = field(default=SelectorMissing.exclude, metadata=CONTRACT)
    """dflash2: a slot whose label is not among its top-K: left out of the selector loss (exclude) or
    put in place of the K-th candidate (inject)."""
    selector_weighting: SelectorWeighting = field(default=SelectorWeighting.base, metadata=CONTRACT)
    """dflash2: each slot's selector loss weighted by its base-loss weight (base: the decay, or 1 with
    D-PACE) or 1 (uniform)."""
    selector_warmup_steps: int = field(default=0, metadata=CONTRACT)
    """dflash2: the selector coefficient rises linearly from 0 to loss.selector over these steps."""
    chunk_size: int | None = field(default=None, metadata=FREE)
    """Rows per chunk of the verifier-logit loss; None = from mem_budget_gib (the same result)."""
    mem_budget_gib: float = field(default=2.0, metadata=FREE)
    """GiB for the loss's [chunk, vocab] fp32 buffers; sets the chunk when chunk_size is None."""
    compile: bool = field(default=False, metadata=FREE)
    """Compile the per-row-block loss math (GPU)."""


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon on the drafter's matrices with AdamW on the rest) and its
    learning-rate schedule (linear warmup, cosine decay)."""

    # A resumed run restores the optimizer and scheduler state, which carry the lr and betas: a
    # changed value here would be silently ignored, so every field is part of the contract.
    name: OptimName = field(default=OptimName.adamw, metadata=CONTRACT)
    """adamw (every trainable parameter) or muon (conf/optim/muon.yaml: torch.optim.Muon on the 2-D
    weight matrices of the layers and fc, AdamW with the fields below on the norms; a sharded matrix
    is gathered whole for Muon's Newton-Schulz). A resume cannot switch it."""
    lr: float = field(default=6e-4, metadata=CONTRACT)
    """Peak learning rate of AdamW (with muon: of the AdamW parameters)."""
    min_lr_ratio: float = field(default=0.0, metadata=CONTRACT)
    """The learning rate at the last step, as a fraction of the peak (cosine decay; every group)."""
    warmup_ratio: float = field(default=0.04, metadata=CONTRACT)
    """Fraction of the steps spent in linear warmup."""
    weight_decay: float = field(default=0.0, metadata=CONTRACT)
    """AdamW decoupled weight decay."""
    beta1: float = field(default=0.9, metadata=CONTRACT)
    """AdamW first-moment decay."""
    beta2: float = field(default=0.999, metadata=CONTRACT)
    """AdamW second-moment decay."""
    eps: float = field(default=1e-8, metadata=CONTRACT)
    """AdamW epsilon."""
    muon_lr: float | None = field(default=None, metadata=CONTRACT)
    """With muon: peak learning rate of the matrices; None = optim.lr (with
    muon_adjust_lr=match_rms_adamw, Muon's update has AdamW's RMS: docs/training.md)."""
    muon_momentum: float = field(default=0.95, metadata=CONTRACT)
    """With muon: momentum of the matrices' update (torch.optim.Muon's, an average of the gradients)."""
    muon_nesterov: bool = field(default=True, metadata=CONTRACT)
    """With muon: Nesterov momentum."""
    muon_ns_steps: int = field(default=5, metadata=CONTRACT)
    """With muon: Newton-Schulz iterations that orthogonalise each matrix's update (1 to 99)."""
    muon_weight_decay: float = field(default=0.1, metadata=CONTRACT)
    """With muon: decoupled weight decay of the matrices (multiplied by their learning rate)."""
    muon_adjust_lr: MuonAdjustLr = field(default=MuonAdjustLr.match_rms_adamw, metadata=CONTRACT)
    """With muon: the per-matrix learning-rate scale: match_rms_adamw (0.2 sqrt(max(rows, cols)),
    Moonlight's: the update's RMS is AdamW's) or original (sqrt(max(1, rows/cols)), Keller Jordan's,
    whose learning rates are ~0.02)."""
    max_grad_norm: float = field(default=1.0, metadata=CONTRACT)
    """Gradient clipping (global L2 norm over every drafter's gradient)."""
    grad_accum_steps: int = field(default=1, metadata=derived("topology.packets_per_step"))
    """Packets per drafter per optimizer step."""


@dataclass
class TrainConfig:
    """Steps, checkpoints, resuming, logging cadence and the run's safety checks."""

    max_steps: int | None = field(default=None, metadata=derived("train.num_steps"))
    """Optimizer steps; None = every packet of the data plan."""
    save_every: int = field(default=1000, metadata=FREE)
    """Write a checkpoint every this many steps (and at the end and at a stop)."""
    keep_checkpoints: int = field(default=2, metadata=FREE)
    """Newest complete checkpoints kept; older ones are removed after a save."""
    log_every: int = field(default=1, metadata=FREE)
    """Log metrics (W&B, metrics.jsonl, the rank log) every this many steps."""
    seed: int = field(default=42, metadata=CONTRACT)
    """Initialisation and anchor sampling."""
    resume: str = field(default="auto", metadata=FREE)
    """auto (newest complete checkpoint of the run dir, if any), never, or a checkpoint path."""
    allow_contract_change: bool = field(default=False, metadata=FREE)
    """Resume a checkpoint whose run contract differs (the differences are logged)."""
    on_nonfinite: OnNonfinite = field(default=OnNonfinite.error, metadata=FREE)
    """error (stop naming step and rank) or skip (drop the step and count it)."""
    stop_after_steps: int | None = field(default=None, metadata=FREE)
    """Stop (with a checkpoint) after this step as if preempted; for tests and staged runs."""
    overwrite: bool = field(default=False, metadata=FREE)
    """With train.resume=never in a run dir that holds another run's outputs: move them aside to
    ``replaced/<time>/`` and start over (without it the launch is refused)."""
    time_phases: bool = field(default=False, metadata=FREE)
    """Log perf/phase/* (target forward, drafter forward, loss, backward, gradient reduction,
    optimizer) every step; on a GPU it synchronises between phases (a little slower)."""
    check_replicas_every: int = field(default=100, metadata=FREE)
    """With several drafters: every N steps compare a checksum of every replica's weights (0 = never)."""
    ledger: bool = field(default=True, metadata=FREE)
    """Write ledger.jsonl in the run dir: per step, the packets and source sample ids trained on."""
    save_weights: bool = field(default=True, metadata=FREE)
    """Write checkpoints and export the final drafter. false: neither (throughput checks such as
    scripts/gpu_check.py, which at real size would write ~17 GB for nothing); a stopped run then
    cannot resume."""


@dataclass
class EvalConfig:
    """The periodic eval during training: real speculative decoding of held-out prompts."""

    every: int = field(default=0, metadata=FREE)
    """Run speculative decoding on held-out prompts every N steps and after the last step (never at
    step 0), each drafter on its share of the prompts (0 = off)."""
    max_share: float | None = field(default=0.2, metadata=FREE)
    """Keep the periodic eval within this share of the training time: an eval may take this share of
    the seconds trained so far in this launch, less what earlier evals took; at that deadline the
    prompt being decoded ends and no other starts (the metrics cover what was decoded;
    ``eval/cut_short`` counts the drafters it stopped). null = no limit."""
    num_prompts: int = field(default=8, metadata=FREE)
    """Held-out prompts the periodic eval decodes (shared among the drafters)."""
    max_new_tokens: int = field(default=64, metadata=FREE)
    """Tokens the periodic eval decodes per prompt."""
    suite: Any = field(default=None, metadata=FREE)
    """Also decode these benchmarks (``dflash.eval.suites``: zlab, gsm8k, math500, humaneval, mbpp,
    mt-bench, or a list) at every eval and log ``eval/<benchmark>/tau``; None = the held-out prompts only."""
    data_dir: str | None = field(default=None, metadata=FREE)
    """The suite's data on offline hosts: one ``save_to_disk`` copy per benchmark (``<data_dir>/gsm8k``, ...)."""
    max_samples: int | None = field(default=8, metadata=FREE)
    """Rows of each suite benchmark (a seeded sample as the z-lab benchmark draws it; None = all)."""
    seed: int = field(default=0, metadata=FREE)
    """Seed of that sample (0: the z-lab benchmark's transformers backend)."""


@dataclass
class LoggingConfig:
    """W&B (online, offline or off) and the console."""

    mode: LoggingMode = field(default=LoggingMode.offline, metadata=FREE)
    """online, offline or disabled (W&B)."""
    project: str = field(default="dflash", metadata=FREE)
    """W&B project."""
    entity: str | None = field(default=None, metadata=FREE)
    """W&B entity (team or user); None = the key's default."""
    name: str | None = field(default=None, metadata=FREE)
    """W&B run name; None = the run directory's last two parts (``outputs/cmp/A_base``: ``cmp/A_base``)."""
    progress_bar: bool = field(default=True, metadata=FREE)
    """A progress bar on the drafter leader's console."""
    init_timeout_s: float = field(default=30.0, metadata=FREE)
    """Seconds ``wandb.init`` may take. An online run that cannot start within it (no network, a
    server that does not answer) or whose key W&B refuses goes on offline in ``<run dir>/wandb``
    after one warning, as does a run whose W&B fails mid-run; the summary prints the ``wandb sync``
    command that uploads it later."""


@dataclass
class PathsConfig:
    """Where dflash keeps its caches."""

    cache_dir: str = field(default="${oc.env:DFLASH_CACHE_DIR,.cache/dflash}", metadata=FREE)
    """dflash's cache: the tiny target, embedded corpora, tokenized datasets
    (``DFLASH_CACHE_DIR``, default ``.cache/dflash``)."""


@dataclass
class GpuSpec:
    """One accelerator of ``conf/gpu/<name>.yaml`` (datasheet figures, cited in each file)."""

    name: str = MISSING
    bf16_tflops: float = MISSING
    """Dense BF16 tensor-core peak in TFLOP/s (without 2:4 sparsity)."""
    hbm_gb: float = MISSING
    """HBM capacity in GB (10^9 bytes, as the datasheet states it)."""
    hbm_tbps: float = MISSING
    """HBM bandwidth in TB/s."""
    internode_gbps: float = MISSING
    """Network bandwidth per GPU between hosts in GB/s, one direction (e.g. one 400 Gb/s NIC = 50)."""
    nvlink_gbps: float = 0.0
    """NVLink bandwidth per GPU in GB/s, both directions together (the datasheet figure); 0: none."""
    pcie_gbps: float = 0.0
    """Without NVLink: PCIe bandwidth GPU to GPU in GB/s, one direction (measured, e.g. 45 on PCIe
    Gen5 x16, 25 on Gen4)."""
    p2p: bool = True
    """Without NVLink: the GPUs reach each other's memory over PCIe (false: consumer cards under the
    stock driver; NCCL stages every transfer through host memory, half of ``pcie_gbps``)."""
    allreduce_busbw_gbps: float = 0.0
    """NCCL all-reduce bus bandwidth among the host's GPUs in GB/s (nccl-tests' busbw); 0: the
    link's one-way figure."""
    gpus_per_node: int = 8
    match: list[str] = field(default_factory=list)
    """Parts of the device name (``torch.cuda.get_device_name``) that mean this GPU (plan.gpu=auto,
    make gpu-check); the longest match wins, the file's stem counts too."""


@dataclass
class GpuFields:
    """``plan.gpu_spec.<field>=...``: fields of the chosen GPU replaced (None: the profile's)."""

    name: str | None = field(default=None, metadata=FREE)
    """The GPU's name in the plan."""
    bf16_tflops: float | None = field(default=None, metadata=FREE)
    """Dense BF16 peak in TFLOP/s."""
    hbm_gb: float | None = field(default=None, metadata=FREE)
    """Memory in GB (10^9 bytes)."""
    hbm_tbps: float | None = field(default=None, metadata=FREE)
    """Memory bandwidth in TB/s."""
    internode_gbps: float | None = field(default=None, metadata=FREE)
    """Network GB/s per GPU between hosts, one way."""
    nvlink_gbps: float | None = field(default=None, metadata=FREE)
    """NVLink GB/s per GPU, both directions (0: none)."""
    pcie_gbps: float | None = field(default=None, metadata=FREE)
    """PCIe GB/s GPU to GPU, one way (without NVLink)."""
    p2p: bool | None = field(default=None, metadata=FREE)
    """PCIe peer-to-peer access between the GPUs."""
    allreduce_busbw_gbps: float | None = field(default=None, metadata=FREE)
    """NCCL all-reduce bus bandwidth in GB/s (0: the link's one-way figure)."""
    gpus_per_node: int | None = field(default=None, metadata=FREE)
    """GPUs per host."""


@dataclass
class PlanConfig:
    """``python -m dflash.plan``: the cost model's knobs (training ignores them)."""

    world_size: int = field(default=8, metadata=FREE)
    """GPUs to split between targets and drafters (or to co-locate both on)."""
    gpu: str = field(default="h200", metadata=FREE)
    """A file of conf/gpu/ (h200, h100, b200, a100; PCIe cards: rtx_pro_6000, l40s, rtx_5090,
    rtx_4090, a100_pcie, h100_pcie), a path to a YAML file with the GpuSpec fields, or auto (on a GPU
    host: the device's name and memory, its links probed)."""
    gpu_spec: GpuFields = field(default_factory=GpuFields, metadata=FREE)
    """Fields of plan.gpu replaced, e.g. plan.gpu_spec.hbm_gb=96 plan.gpu_spec.pcie_gbps=40."""
    mfu_target: float = field(default=0.4, metadata=FREE)
    """Fraction of the dense BF16 peak the target's forward achieves (SpecForge measured ~43% prefill MFU)."""
    mfu_drafter: float = field(default=0.4, metadata=FREE)
    """Fraction of the peak the drafter step achieves (SpecForge measured ~44% on 8xH200)."""
    mfu_delta_rule: float = field(default=0.2, metadata=FREE)
    """Fraction of the peak the chunked delta rule of a hybrid target's linear-attention layers
    achieves (small per-head matrices and a scan over chunks: flash-linear-attention's Triton kernels,
    the gpu extra; transformers' torch fallback, what runs without it, is several times slower)."""
    mean_sample_tokens: int | None = field(default=None, metadata=FREE)
    """Mean tokens per sample; None = the prepared dataset's mean when its cache exists, else 1024."""
    supervised_fraction: float | None = field(default=None, metadata=FREE)
    """Share of tokens under the loss mask; None = the prepared dataset's when cached, else 0.7."""
    reserved_gib: float = field(default=4.0, metadata=FREE)
    """Memory per GPU not available to tensors (CUDA context, NCCL buffers, allocator slack)."""
    num_samples: int | None = field(default=None, metadata=FREE)
    """Samples of one epoch, for the epoch time; None = the prepared dataset's when its cache exists,
    else 800,000 (the scale the published DFlash drafters were trained at)."""
    measure: bool = field(default=False, metadata=FREE)
    """Also rehearse each role's step at real size on CPU fake tensors (dflash.plan.rehearse) and print
    the measured peak beside the estimate (minutes on a laptop; no GPU, no download)."""


@dataclass
class Config:
    name: str = field(default="run", metadata=FREE)
    """The run's name: its directory under outputs/ and the W&B run group."""
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


# ----------------------------------------------------------------------------------------------
# Reading the tags


def schema_leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """``(dotted name, field)`` of every leaf of a schema class; a field whose type is a schema
    class (or an optional one) is both a leaf (its own tag covers None) and descended into."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        hint = hints[f.name]
        inner = [t for t in typing.get_args(hint) if isinstance(t, type) and dataclasses.is_dataclass(t)]
        sub: type | None = hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None
        if sub is None and inner:
            sub = inner[0]
        if sub is None or "resume" in f.metadata:
            yield name, f
        if sub is not None:
            yield from schema_leaves(sub, f"{name}.")


def contract_defaults(schema: type | None = None, prefix: str = "") -> dict[str, Any]:
    """The schema default of every CONTRACT-tagged leaf that has one, by dotted name: a checkpoint
    written before a field existed matches a run that leaves the field at its default."""
    schema = schema or Config
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out.update(contract_defaults(hint, f"{prefix}{f.name}."))
        elif (
            f.metadata.get("resume") == "contract"
            and f.default is not dataclasses.MISSING
            and f.default != MISSING
        ):
            out[f"{prefix}{f.name}"] = f.default
    return out


def contract_values(cfg: Config) -> dict[str, Any]:
    """The CONTRACT-tagged values of ``cfg``, by dotted name (a None sub-config counts as one value)."""
    out: dict[str, Any] = {}

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            elif f.metadata.get("resume") == "contract":
                out[f"{prefix}{f.name}"] = value

    walk(cfg, "")
    return out


def dataset_settings(cfg: DataConfig) -> dict[str, Any]:
    """The DataConfig values that shape the tokenized dataset (fields tagged ``data: True``)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.metadata.get("data")}


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore under the ``schema`` group."""
    cs = ConfigStore.instance()
    cs.store(name="dflash_schema", node=Config)


class UserError(ValueError):
    """A mistake the user can fix (config, data path, run directory): printed as its message alone,
    without a traceback, by one rank, and the process exits with ``EXIT_USER_ERROR``.

    ``scope="all"``: every rank finds it (a config problem): global rank 0 prints it.
    ``scope="here"``: this rank prints it (e.g. the drafter leader's run directory lock).
    ``scope="quiet"``: this rank only logs it (another rank prints the same error).
    """

    def __init__(self, message: str, *, scope: str = "all") -> None:
        super().__init__(message)
        self.scope = scope


EXIT_USER_ERROR = 2
"""Exit code of a rank that stopped on a ``UserError``."""
EXIT_STOPPED = 75
"""Exit code of a run stopped before its last step by a signal (resumable; EX_TEMPFAIL)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Preemption (SIGTERM), Ctrl-C (SIGINT) and a closed terminal (SIGHUP): every rank stops at the next
step boundary, with a checkpoint."""


def plain_dict(cfg: DictConfig) -> dict[str, Any]:
    """A composed config as plain Python containers, interpolations resolved (for W&B and files)."""
    out = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def to_config(dcfg: DictConfig) -> Config:
    """The composed DictConfig as the typed ``Config`` (interpolations resolved, ``None`` defaults
    that depend on other fields filled in: ``data.num_eval_prompts``)."""
    obj = OmegaConf.to_object(dcfg)
    assert isinstance(obj, Config)
    if obj.data.num_eval_prompts is None:
        obj.data.num_eval_prompts = obj.eval.num_prompts if obj.eval.every > 0 else 0
    return obj
