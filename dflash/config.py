"""Typed config schemas, Hydra ConfigStore registration and cross-field validation.

Every YAML group in ``conf/`` is validated against the dataclasses below at compose time (a typo
or a wrong type fails before anything runs). ``validate(cfg, world_size)`` then checks what needs
several fields at once and reports every problem in one ``ValueError``, each naming the field,
the bad value and the override that fixes it. It runs before any model loads.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    "target.layer_ids",
    "target.hidden_size",
    "target.vocab_size",
    "drafter.arch",
    "data.fingerprint",
    "data.plan",
    "train.num_steps",
)
"""Contract entries that ``dflash.setup.prepare`` resolves (beside the CONTRACT-tagged raw values)."""


@dataclass
class TopologyConfig:
    num_targets: int = field(default=2, metadata=CONTRACT)
    """Target ranks 0..N-1 (frozen target copies)."""
    num_drafters: int = field(default=1, metadata=CONTRACT)
    """Drafter ranks N..N+M-1; rank N is the leader (checkpoints, W&B)."""
    backend: str = field(default="auto", metadata=FREE)
    """auto (nccl when CUDA is available, else gloo), nccl or gloo."""
    device: str = field(default="auto", metadata=FREE)
    """auto, cpu or cuda."""
    init_timeout_s: float = field(default=600.0, metadata=FREE)
    """Process-group timeout until the first step ends (model loading is slow)."""
    step_timeout_s: float = field(default=300.0, metadata=FREE)
    """Timeout of every wait after the first step: a dead or stuck peer is reported after this. Targets
    wait twice as long for the drafter, which may itself be waiting this long on another target."""
    max_in_flight: int = field(default=2, metadata=FREE)
    """Packets a target may send before the drafter acknowledges the oldest one (backpressure)."""


@dataclass
class TinyTargetConfig:
    """A small target built locally from a config, trained for a fixed number of steps on stdlib
    code (``dflash.targets.tiny``) and saved with save_pretrained; the whole spec is its cache key."""

    model_type: str = field(default="qwen3", metadata=CONTRACT)
    num_layers: int = field(default=6, metadata=CONTRACT)
    hidden_size: int = field(default=128, metadata=CONTRACT)
    intermediate_size: int = field(default=384, metadata=CONTRACT)
    num_heads: int = field(default=4, metadata=CONTRACT)
    num_kv_heads: int = field(default=2, metadata=CONTRACT)
    head_dim: int = field(default=32, metadata=CONTRACT)
    extra_vocab: int = field(default=64, metadata=CONTRACT)
    """Embedding rows past the tokenizer's vocabulary (the first is the MASK token)."""
    init_std: float = field(default=0.02, metadata=CONTRACT)
    seed: int = field(default=0, metadata=CONTRACT)
    """Initialisation and training data order."""
    train_steps: int = field(default=400, metadata=CONTRACT)
    """Optimizer steps of next-token training on chat samples cut from stdlib code (0 = random weights)."""
    train_batch_size: int = field(default=4, metadata=CONTRACT)
    train_seq_len: int = field(default=128, metadata=CONTRACT)
    train_lr: float = field(default=3e-3, metadata=CONTRACT)


@dataclass
class TargetConfig:
    name: str = field(default=MISSING, metadata=CONTRACT)
    path: str = field(default=MISSING, metadata=CONTRACT)
    """Local directory or hub id of the target checkpoint (or the build dir of a tiny target)."""
    tiny: TinyTargetConfig | None = field(default=None, metadata=CONTRACT)
    """When set, the target (and its tokenizer) is built offline at ``path`` if missing."""
    dtype: str = field(default="auto", metadata=CONTRACT)
    """auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16: the hidden states' dtype."""
    layer_ids: list[int] | None = field(default=None, metadata=derived("target.layer_ids"))
    """Tapped decoder layers (tap l = output of layer l); None = round(1 + i*(L-4)/(n-1))."""
    num_taps: int | None = field(default=None, metadata=derived("target.layer_ids"))
    """Number of taps when layer_ids is None (None = 5); must equal len(layer_ids) when both are set."""
    attn_implementation: str = field(default="sdpa", metadata=FREE)
    pack: bool = field(default=True, metadata=FREE)
    """Pack several sequences in one row (position ids restart per sequence); False pads (Qwen3.5)."""
    trust_remote_code: bool = field(default=False, metadata=FREE)
    revision: str | None = field(default=None, metadata=CONTRACT)
    """A full commit hash; required when trust_remote_code is true."""
    tokenizer: str | None = field(default=None, metadata=CONTRACT)
    """Tokenizer path or hub id; None = the target path."""


DEFAULT_NUM_TAPS = 5


@dataclass
class DrafterConfig:
    num_layers: int = field(default=5, metadata=derived("drafter.arch"))
    block_size: int = field(default=16, metadata=derived("drafter.arch"))
    num_anchors: int = field(default=512, metadata=CONTRACT)
    """Anchors sampled per sequence every step (without replacement)."""
    max_anchors_per_packet: int | None = field(default=None, metadata=CONTRACT)
    """Cap on the anchors of one packet (all its sequences together); None = no cap."""
    mask_token_id: int | None = field(default=None, metadata=derived("drafter.arch"))
    """None = drafter checkpoint, then the tokenizer's mask token, then the first row past the vocab."""
    hidden_size: int | None = field(default=None, metadata=derived("drafter.arch"))
    """Must equal the target's (the drafter reuses its embedding and lm_head); None = the target's."""
    intermediate_size: int | None = field(default=None, metadata=derived("drafter.arch"))
    """None = the target's intermediate size."""
    num_heads: int | None = field(default=None, metadata=derived("drafter.arch"))
    """None = the target's attention heads (likewise num_kv_heads, head_dim)."""
    num_kv_heads: int | None = field(default=None, metadata=derived("drafter.arch"))
    head_dim: int | None = field(default=None, metadata=derived("drafter.arch"))
    attention: str = field(default="auto", metadata=FREE)
    """auto (flex on CUDA, sdpa on CPU), flex or sdpa: the same function, two kernels."""
    dtype: str = field(default="auto", metadata=FREE)
    """Compute dtype of the drafter: auto (bfloat16 autocast on GPU, float32 on CPU)."""
    init_from: str | None = field(default=None, metadata=FREE)
    """An exported drafter directory (public DFlash layout) to warm-start from (used at step 0 only)."""
    init_std: float = field(default=0.02, metadata=FREE)
    """Std of the random initialisation (used at step 0 only)."""


@dataclass
class DataConfig:
    path: str = field(default=MISSING, metadata=data_field(derived("data.fingerprint"), False))
    """JSONL with {"messages": [...]}, a datasets-loadable path, or 'embedded' (built offline)."""
    split: str = field(default="train", metadata=data_field(derived("data.fingerprint"), True))
    max_length: int = field(default=2048, metadata=data_field(derived("data.fingerprint"), True))
    overlong: str = field(default="truncate", metadata=data_field(derived("data.fingerprint"), True))
    """truncate or skip samples longer than max_length."""
    token_budget: int = field(default=16384, metadata=data_field(derived("data.plan"), False))
    """Tokens per packet (sum of the packed sequence lengths)."""
    num_epochs: int = field(default=1, metadata=data_field(derived("data.plan"), False))
    seed: int = field(default=42, metadata=data_field(derived("data.plan"), False))
    train_only_last_turn: bool = field(default=False, metadata=data_field(derived("data.fingerprint"), True))
    max_skip_fraction: float = field(default=0.1, metadata=data_field(FREE, False))
    """Abort when more than this fraction of the samples is skipped as bad input."""
    cache_dir: str = field(default="${paths.cache_dir}/data", metadata=data_field(FREE, False))
    num_samples: int | None = field(default=None, metadata=data_field(derived("data.fingerprint"), True))
    """Use only the first N conversations (None = all)."""
    embedded_num_prompts: int = field(default=512, metadata=data_field(derived("data.fingerprint"), False))
    """Prompts of the embedded default corpus (responses regenerated by the target)."""
    embedded_max_new_tokens: int = field(default=96, metadata=data_field(derived("data.fingerprint"), False))
    num_eval_prompts: int = field(default=0, metadata=data_field(derived("data.fingerprint"), True))
    """Held-out conversations (taken from the end, never trained on) for eval."""
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
class LossConfig:
    ce: float = field(default=1.0, metadata=CONTRACT)
    kl: float = field(default=0.0, metadata=CONTRACT)
    verifier_ce: float = field(default=0.0, metadata=CONTRACT)
    temperature: float = field(default=1.0, metadata=CONTRACT)
    gamma: float = field(default=7.0, metadata=CONTRACT)
    """Slot weight exp(-(k-1)/gamma)."""
    chunk_size: int | None = field(default=None, metadata=FREE)
    """Rows per chunk of the verifier-logit loss; None = from mem_budget_gib (the same result)."""
    mem_budget_gib: float = field(default=2.0, metadata=FREE)
    compile: bool = field(default=False, metadata=FREE)
    """Compile the per-row-block loss math (GPU)."""


@dataclass
class OptimConfig:
    # A resumed run restores the optimizer and scheduler state, which carry the lr and betas: a
    # changed value here would be silently ignored, so every field is part of the contract.
    lr: float = field(default=6e-4, metadata=CONTRACT)
    min_lr_ratio: float = field(default=0.0, metadata=CONTRACT)
    warmup_ratio: float = field(default=0.04, metadata=CONTRACT)
    weight_decay: float = field(default=0.0, metadata=CONTRACT)
    beta1: float = field(default=0.9, metadata=CONTRACT)
    beta2: float = field(default=0.999, metadata=CONTRACT)
    eps: float = field(default=1e-8, metadata=CONTRACT)
    max_grad_norm: float = field(default=1.0, metadata=CONTRACT)
    grad_accum_steps: int = field(default=1, metadata=CONTRACT)
    """Packets per drafter per optimizer step."""


@dataclass
class TrainConfig:
    max_steps: int | None = field(default=None, metadata=derived("train.num_steps"))
    """Optimizer steps; None = every packet of the data plan."""
    save_every: int = field(default=1000, metadata=FREE)
    keep_checkpoints: int = field(default=2, metadata=FREE)
    log_every: int = field(default=1, metadata=FREE)
    seed: int = field(default=42, metadata=CONTRACT)
    """Initialisation and anchor sampling."""
    resume: str = field(default="auto", metadata=FREE)
    """auto (newest complete checkpoint of the run dir, if any), never, or a checkpoint path."""
    allow_contract_change: bool = field(default=False, metadata=FREE)
    on_nonfinite: str = field(default="error", metadata=FREE)
    """error (stop naming step and rank) or skip (drop the step and count it)."""
    stop_after_steps: int | None = field(default=None, metadata=FREE)
    """Stop (with a checkpoint) after this step as if preempted; for tests and staged runs."""
    ledger: bool = field(default=True, metadata=FREE)
    """Write ledger.jsonl in the run dir: per step, the packets and source sample ids trained on."""


@dataclass
class EvalConfig:
    every: int = field(default=0, metadata=FREE)
    """Run speculative decoding on held-out prompts every N steps on the drafter leader (0 = off)."""
    num_prompts: int = field(default=8, metadata=FREE)
    max_new_tokens: int = field(default=64, metadata=FREE)


@dataclass
class LoggingConfig:
    mode: str = field(default="offline", metadata=FREE)
    """online, offline or disabled (W&B)."""
    project: str = field(default="dflash", metadata=FREE)
    entity: str | None = field(default=None, metadata=FREE)
    name: str | None = field(default=None, metadata=FREE)
    progress_bar: bool = field(default=True, metadata=FREE)


@dataclass
class PathsConfig:
    cache_dir: str = field(default="${oc.env:DFLASH_CACHE_DIR,.cache/dflash}", metadata=FREE)


@dataclass
class FaultConfig:
    """Fault injection for the reliability tests; every field off by default."""

    kill_rank: int | None = field(default=None, metadata=FREE)
    """SIGKILL this rank at the first step >= ``kill_at_step`` (1-based optimizer step) it works on."""
    kill_at_step: int | None = field(default=None, metadata=FREE)
    hang_rank: int | None = field(default=None, metadata=FREE)
    """This rank stops responding (sleeps forever, alive) at the first step >= ``hang_at_step``."""
    hang_at_step: int | None = field(default=None, metadata=FREE)
    nan_at_step: int | None = field(default=None, metadata=FREE)
    """The drafter's loss becomes NaN at this step."""
    nonfinite_sample_ids: list[int] = field(default_factory=list, metadata=FREE)
    """Source sample ids whose target hidden states are replaced by NaN (non-finite input)."""
    only_first_attempt: bool = field(default=True, metadata=FREE)
    """Inject only in the first torchrun attempt (TORCHELASTIC_RESTART_COUNT == 0)."""


@dataclass
class Config:
    name: str = field(default="run", metadata=FREE)
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
    fault: FaultConfig = field(default_factory=FaultConfig)


# ----------------------------------------------------------------------------------------------
# Reading the tags


def schema_leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """``(dotted name, field)`` of every leaf of a schema class; a field whose type is a schema
    class (or an optional one) is both a leaf (its own tag covers None) and descended into."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        inner = [t for t in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(t)]
        sub: Any = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else (inner[0] if inner else None)
        if sub is None or "resume" in f.metadata:
            yield name, f
        if sub is not None:
            yield from schema_leaves(sub, f"{name}.")


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


_CHOICES = {
    "topology.backend": ("auto", "nccl", "gloo"),
    "topology.device": ("auto", "cpu", "cuda"),
    "target.dtype": ("auto", "float32", "bfloat16", "float16"),
    "drafter.dtype": ("auto", "float32", "bfloat16"),
    "drafter.attention": ("auto", "sdpa", "flex"),
    "data.overlong": ("truncate", "skip"),
    "train.on_nonfinite": ("error", "skip"),
    "logging.mode": ("online", "offline", "disabled"),
}


def device_kind(device: str) -> str:
    """``topology.device`` resolved to ``cpu`` or ``cuda`` (auto: cuda when torch sees a GPU here)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def drafter_attention(attention: str, device: str) -> str:
    """``drafter.attention`` resolved for a ``cpu``/``cuda`` device: auto is flex on CUDA, sdpa on CPU."""
    if attention == "auto":
        return "flex" if device == "cuda" else "sdpa"
    return attention


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def config_problems(cfg: Config, world_size: int) -> list[str]:
    """Every problem that the config alone shows (no model, no file read); empty when valid."""
    p: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            p.append(msg)

    for key, allowed in _CHOICES.items():
        val = _get(cfg, key)
        need(val in allowed, f"{key}={val!r} is not one of {list(allowed)}; set {key}=<one of them>")
    t = cfg.topology
    need(
        t.num_targets >= 1,
        f"topology.num_targets={t.num_targets}: need at least 1 target; set topology.num_targets=1 or more",
    )
    need(
        t.num_drafters >= 1,
        f"topology.num_drafters={t.num_drafters}: need at least 1 drafter; set topology.num_drafters=1",
    )
    ranks = t.num_targets + t.num_drafters
    need(
        world_size == ranks,
        f"topology.num_targets={t.num_targets} + topology.num_drafters={t.num_drafters} = {ranks} ranks but the "
        f"launch has WORLD_SIZE={world_size}; run torchrun --nproc_per_node {ranks} or set "
        f"topology.num_targets={max(world_size - t.num_drafters, 0)}",
    )
    need(t.max_in_flight >= 1, f"topology.max_in_flight={t.max_in_flight}: must be >= 1")
    need(
        t.init_timeout_s > 0 and t.step_timeout_s > 0,
        "topology.init_timeout_s and topology.step_timeout_s must be > 0",
    )
    tg = cfg.target
    if tg.layer_ids is not None:
        need(
            len(tg.layer_ids) > 0,
            "target.layer_ids=[] is empty; list at least one tapped layer or set target.layer_ids=null",
        )
        need(
            min(tg.layer_ids, default=0) >= 0,
            f"target.layer_ids={tg.layer_ids} has a negative id; tap ids are decoder layer indices >= 0",
        )
        need(
            len(set(tg.layer_ids)) == len(tg.layer_ids),
            f"target.layer_ids={tg.layer_ids} has duplicates; list each tapped layer once",
        )
        if tg.num_taps is not None:
            need(
                tg.num_taps == len(tg.layer_ids),
                f"target.num_taps={tg.num_taps} but target.layer_ids lists "
                f"{len(tg.layer_ids)} layers; set target.num_taps=null (it only matters without layer_ids)",
            )
    elif tg.num_taps is not None:
        need(
            tg.num_taps >= 1, f"target.num_taps={tg.num_taps}: must be >= 1 (or null for {DEFAULT_NUM_TAPS})"
        )
    if tg.trust_remote_code:
        rev = tg.revision or ""
        need(
            len(rev) == 40 and all(c in "0123456789abcdef" for c in rev.lower()),
            f"target.trust_remote_code=true needs target.revision=<40-hex commit hash> (got {tg.revision!r}) so the code that runs is pinned",
        )
    d = cfg.drafter
    need(d.num_layers >= 1, f"drafter.num_layers={d.num_layers}: must be >= 1")
    need(d.block_size >= 2, f"drafter.block_size={d.block_size}: must be >= 2 (slot 0 is the given token)")
    need(d.num_anchors >= 1, f"drafter.num_anchors={d.num_anchors}: must be >= 1")
    if d.max_anchors_per_packet is not None:
        need(
            d.max_anchors_per_packet >= 1,
            f"drafter.max_anchors_per_packet={d.max_anchors_per_packet}: must be >= 1 or null",
        )
    elif t.device in ("auto", "cpu", "cuda") and d.attention in ("auto", "sdpa", "flex"):
        if drafter_attention(d.attention, device_kind(t.device)) == "flex":
            p.append(
                f"drafter.max_anchors_per_packet=null with flex attention (drafter.attention={d.attention} on "
                f"topology.device={t.device}, here {device_kind(t.device)}): packets are padded to a static number "
                "of blocks so flex_attention compiles once; set drafter.max_anchors_per_packet (e.g. 2048)"
            )
    if d.mask_token_id is not None:
        need(d.mask_token_id >= 0, f"drafter.mask_token_id={d.mask_token_id}: must be >= 0 or null")
    dt = cfg.data
    need(dt.max_length >= 2, f"data.max_length={dt.max_length}: must be >= 2")
    need(
        dt.token_budget >= dt.max_length,
        f"data.token_budget={dt.token_budget} < data.max_length={dt.max_length}: a packet must hold the longest sample; "
        f"set data.token_budget={dt.max_length} or more",
    )
    need(dt.num_epochs >= 1, f"data.num_epochs={dt.num_epochs}: must be >= 1")
    need(
        0.0 <= dt.max_skip_fraction <= 1.0,
        f"data.max_skip_fraction={dt.max_skip_fraction}: must be in [0, 1]",
    )
    if dt.num_samples is not None:
        need(dt.num_samples >= 1, f"data.num_samples={dt.num_samples}: must be >= 1 or null")
    need(dt.num_eval_prompts >= 0, f"data.num_eval_prompts={dt.num_eval_prompts}: must be >= 0")
    if dt.max_record_chars is not None:
        need(
            dt.max_record_chars >= 1,
            f"data.max_record_chars={dt.max_record_chars}: must be >= 1 or null (32 x data.max_length)",
        )
    need(dt.num_workers >= 1, f"data.num_workers={dt.num_workers}: must be >= 1")
    lo = cfg.loss
    need(
        min(lo.ce, lo.kl, lo.verifier_ce) >= 0,
        f"loss.ce/kl/verifier_ce = {lo.ce}/{lo.kl}/{lo.verifier_ce}: must be >= 0",
    )
    need(
        lo.ce + lo.kl + lo.verifier_ce > 0,
        "loss.ce, loss.kl and loss.verifier_ce are all 0: nothing to train; set loss.ce=1.0",
    )
    need(lo.temperature > 0, f"loss.temperature={lo.temperature}: must be > 0")
    need(lo.gamma > 0, f"loss.gamma={lo.gamma}: must be > 0")
    if lo.chunk_size is not None:
        need(
            lo.chunk_size >= 1,
            f"loss.chunk_size={lo.chunk_size}: must be >= 1 or null (from loss.mem_budget_gib)",
        )
    need(lo.mem_budget_gib > 0, f"loss.mem_budget_gib={lo.mem_budget_gib}: must be > 0")
    o = cfg.optim
    need(o.lr > 0, f"optim.lr={o.lr}: must be > 0")
    need(0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
    need(0.0 <= o.warmup_ratio < 1.0, f"optim.warmup_ratio={o.warmup_ratio}: must be in [0, 1)")
    need(o.max_grad_norm > 0, f"optim.max_grad_norm={o.max_grad_norm}: must be > 0")
    need(o.grad_accum_steps >= 1, f"optim.grad_accum_steps={o.grad_accum_steps}: must be >= 1")
    tr = cfg.train
    if tr.max_steps is not None:
        need(tr.max_steps >= 1, f"train.max_steps={tr.max_steps}: must be >= 1 or null (whole data plan)")
    need(tr.save_every >= 1, f"train.save_every={tr.save_every}: must be >= 1")
    need(
        tr.keep_checkpoints >= 2,
        f"train.keep_checkpoints={tr.keep_checkpoints}: keep at least 2 so a damaged newest one has a fallback",
    )
    need(tr.log_every >= 1, f"train.log_every={tr.log_every}: must be >= 1")
    need(cfg.eval.every >= 0, f"eval.every={cfg.eval.every}: must be >= 0 (0 = off)")
    return p


def raise_problems(problems: list[str], what: str) -> None:
    if problems:
        lines = "\n".join(f"  - {m}" for m in problems)
        raise ValueError(f"{len(problems)} {what} problem(s):\n{lines}")


def validate(cfg: Config, world_size: int) -> None:
    """Raise one ValueError listing every config problem (run on every rank before any model loads)."""
    raise_problems(config_problems(cfg, world_size), "config")


def to_config(dcfg: DictConfig) -> Config:
    """The composed DictConfig as the typed ``Config`` (interpolations resolved)."""
    obj = OmegaConf.to_object(dcfg)
    assert isinstance(obj, Config)
    return obj
