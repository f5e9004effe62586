"""Typed config schemas, Hydra ConfigStore registration and cross-field validation.

Every YAML group in ``conf/`` is validated against the dataclasses below at compose time (a typo
or a wrong type fails before anything runs). ``validate(cfg, world_size)`` then checks what needs
several fields at once and reports every problem in one ``ValueError``, each naming the field,
the bad value and the override that fixes it. It runs before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class TopologyConfig:
    num_targets: int = 2
    """Target ranks 0..N-1 (frozen target copies)."""
    num_drafters: int = 1
    """Drafter ranks N..N+M-1; rank N is the leader (checkpoints, W&B)."""
    backend: str = "auto"
    """auto (nccl when CUDA is available, else gloo), nccl or gloo."""
    device: str = "auto"
    """auto, cpu or cuda."""
    init_timeout_s: float = 600.0
    """Process-group timeout until the first step ends (model loading is slow)."""
    step_timeout_s: float = 300.0
    """Timeout of every wait after the first step: a dead or stuck peer is reported after this. Targets
    wait twice as long for the drafter, which may itself be waiting this long on another target."""
    max_in_flight: int = 2
    """Packets a target may send before the drafter acknowledges the oldest one (backpressure)."""


@dataclass
class TinyTargetConfig:
    """A random-init target built locally from a config and saved with save_pretrained."""

    model_type: str = "qwen3"
    num_layers: int = 6
    hidden_size: int = 128
    intermediate_size: int = 384
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    extra_vocab: int = 64
    """Embedding rows past the tokenizer's vocabulary (the first is the MASK token)."""
    init_std: float = 0.02
    seed: int = 0


@dataclass
class TargetConfig:
    name: str = MISSING
    path: str = MISSING
    """Local directory or hub id of the target checkpoint (or the build dir of a tiny target)."""
    tiny: TinyTargetConfig | None = None
    """When set, the target (and its tokenizer) is built offline at ``path`` if missing."""
    dtype: str = "auto"
    """auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16."""
    layer_ids: list[int] | None = None
    """Tapped decoder layers (tap l = output of layer l); None = round(1 + i*(L-4)/(n-1))."""
    num_taps: int = 5
    """Number of taps when layer_ids is None."""
    attn_implementation: str = "sdpa"
    pack: bool = True
    """Pack several sequences in one row (position ids restart per sequence); False pads (Qwen3.5)."""
    trust_remote_code: bool = False
    revision: str | None = None
    """A full commit hash; required when trust_remote_code is true."""
    tokenizer: str | None = None
    """Tokenizer path or hub id; None = the target path."""


@dataclass
class DrafterConfig:
    num_layers: int = 5
    block_size: int = 16
    num_anchors: int = 512
    """Anchors sampled per sequence every step (without replacement)."""
    max_anchors_per_packet: int | None = None
    """Cap on the anchors of one packet (all its sequences together); None = no cap."""
    mask_token_id: int | None = None
    """None = drafter checkpoint, then the tokenizer's mask token, then the first row past the vocab."""
    hidden_size: int | None = None
    """Must equal the target's (the drafter reuses its embedding and lm_head); None = the target's."""
    intermediate_size: int | None = None
    """None = the target's intermediate size."""
    num_heads: int | None = None
    """None = the target's attention heads (likewise num_kv_heads, head_dim)."""
    num_kv_heads: int | None = None
    head_dim: int | None = None
    attention: str = "auto"
    """auto (flex on CUDA, sdpa on CPU), flex or sdpa."""
    dtype: str = "auto"
    """Compute dtype of the drafter: auto (bfloat16 autocast on GPU, float32 on CPU)."""
    init_from: str | None = None
    """An exported drafter directory (public DFlash layout) to warm-start from."""
    init_std: float = 0.02
    compile: bool = False


@dataclass
class DataConfig:
    path: str = MISSING
    """JSONL with {"messages": [...]}, a datasets-loadable path, or 'embedded' (built offline)."""
    split: str = "train"
    max_length: int = 2048
    overlong: str = "truncate"
    """truncate or skip samples longer than max_length."""
    token_budget: int = 16384
    """Tokens per packet (sum of the packed sequence lengths)."""
    num_epochs: int = 1
    seed: int = 42
    train_only_last_turn: bool = False
    max_skip_fraction: float = 0.1
    """Abort when more than this fraction of the samples is skipped as bad input."""
    cache_dir: str = "${paths.cache_dir}/data"
    num_samples: int | None = None
    """Use only the first N conversations (None = all)."""
    embedded_num_prompts: int = 512
    """Prompts of the embedded default corpus (responses regenerated by the target)."""
    embedded_max_new_tokens: int = 96
    num_eval_prompts: int = 0
    """Held-out conversations (taken from the end, never trained on) for eval."""


@dataclass
class LossConfig:
    ce: float = 1.0
    kl: float = 0.0
    verifier_ce: float = 0.0
    temperature: float = 1.0
    gamma: float = 7.0
    """Slot weight exp(-(k-1)/gamma)."""
    chunk_size: int | None = None
    """Rows per chunk of the verifier-logit loss; None = from mem_budget_gib."""
    mem_budget_gib: float = 2.0
    compile: bool = False


@dataclass
class OptimConfig:
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    grad_accum_steps: int = 1
    """Packets per drafter per optimizer step."""


@dataclass
class TrainConfig:
    max_steps: int | None = None
    """Optimizer steps; None = every packet of the data plan."""
    save_every: int = 1000
    keep_checkpoints: int = 2
    log_every: int = 1
    seed: int = 42
    resume: str = "auto"
    """auto (newest complete checkpoint of the run dir, if any), never, or a checkpoint path."""
    allow_contract_change: bool = False
    on_nonfinite: str = "error"
    """error (stop naming step and rank) or skip (drop the step and count it)."""
    stop_after_steps: int | None = None
    """Stop (with a checkpoint) after this step as if preempted; for tests and staged runs."""
    ledger: bool = True
    """Write ledger.jsonl in the run dir: per step, the packets and source sample ids trained on."""


@dataclass
class EvalConfig:
    every: int = 0
    """Run speculative decoding on held-out prompts every N steps on the drafter leader (0 = off)."""
    num_prompts: int = 8
    max_new_tokens: int = 64


@dataclass
class LoggingConfig:
    mode: str = "offline"
    """online, offline or disabled (W&B)."""
    project: str = "dflash"
    entity: str | None = None
    name: str | None = None
    progress_bar: bool = True


@dataclass
class PathsConfig:
    cache_dir: str = "${oc.env:DFLASH_CACHE_DIR,.cache/dflash}"


@dataclass
class FaultConfig:
    """Fault injection for the reliability tests; every field off by default."""

    kill_rank: int | None = None
    """SIGKILL this rank at the first step >= ``kill_at_step`` (1-based optimizer step) it works on."""
    kill_at_step: int | None = None
    hang_rank: int | None = None
    """This rank stops responding (sleeps forever, alive) at the first step >= ``hang_at_step``."""
    hang_at_step: int | None = None
    nan_at_step: int | None = None
    """The drafter's loss becomes NaN at this step."""
    nonfinite_sample_ids: list[int] = field(default_factory=list)
    """Source sample ids whose target hidden states are replaced by NaN (non-finite input)."""
    only_first_attempt: bool = True
    """Inject only in the first torchrun attempt (TORCHELASTIC_RESTART_COUNT == 0)."""


@dataclass
class Config:
    name: str = "run"
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
    need(t.num_targets >= 1, f"topology.num_targets={t.num_targets}: need at least 1 target; set topology.num_targets=1 or more")
    need(t.num_drafters >= 1, f"topology.num_drafters={t.num_drafters}: need at least 1 drafter; set topology.num_drafters=1")
    ranks = t.num_targets + t.num_drafters
    need(
        world_size == ranks,
        f"topology.num_targets={t.num_targets} + topology.num_drafters={t.num_drafters} = {ranks} ranks but the "
        f"launch has WORLD_SIZE={world_size}; run torchrun --nproc_per_node {ranks} or set "
        f"topology.num_targets={max(world_size - t.num_drafters, 0)}",
    )
    need(t.max_in_flight >= 1, f"topology.max_in_flight={t.max_in_flight}: must be >= 1")
    need(t.init_timeout_s > 0 and t.step_timeout_s > 0, "topology.init_timeout_s and topology.step_timeout_s must be > 0")
    tg = cfg.target
    if tg.layer_ids is not None:
        need(len(tg.layer_ids) > 0, "target.layer_ids=[] is empty; list at least one tapped layer or set target.layer_ids=null")
        need(min(tg.layer_ids, default=0) >= 0, f"target.layer_ids={tg.layer_ids} has a negative id; tap ids are decoder layer indices >= 0")
        need(len(set(tg.layer_ids)) == len(tg.layer_ids), f"target.layer_ids={tg.layer_ids} has duplicates; list each tapped layer once")
    else:
        need(tg.num_taps >= 1, f"target.num_taps={tg.num_taps}: must be >= 1")
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
        need(d.max_anchors_per_packet >= 1, f"drafter.max_anchors_per_packet={d.max_anchors_per_packet}: must be >= 1 or null")
    elif d.attention == "flex" or (d.attention == "auto" and t.device == "cuda"):
        p.append("drafter.max_anchors_per_packet=null with flex attention: packets are padded to a static number of "
                 "blocks so flex_attention compiles once; set drafter.max_anchors_per_packet (e.g. 2048)")
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
    need(0.0 <= dt.max_skip_fraction <= 1.0, f"data.max_skip_fraction={dt.max_skip_fraction}: must be in [0, 1]")
    if dt.num_samples is not None:
        need(dt.num_samples >= 1, f"data.num_samples={dt.num_samples}: must be >= 1 or null")
    need(dt.num_eval_prompts >= 0, f"data.num_eval_prompts={dt.num_eval_prompts}: must be >= 0")
    lo = cfg.loss
    need(min(lo.ce, lo.kl, lo.verifier_ce) >= 0, f"loss.ce/kl/verifier_ce = {lo.ce}/{lo.kl}/{lo.verifier_ce}: must be >= 0")
    need(lo.ce + lo.kl + lo.verifier_ce > 0, "loss.ce, loss.kl and loss.verifier_ce are all 0: nothing to train; set loss.ce=1.0")
    need(lo.temperature > 0, f"loss.temperature={lo.temperature}: must be > 0")
    need(lo.gamma > 0, f"loss.gamma={lo.gamma}: must be > 0")
    if lo.chunk_size is not None:
        need(lo.chunk_size >= 1, f"loss.chunk_size={lo.chunk_size}: must be >= 1 or null (from loss.mem_budget_gib)")
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
    need(tr.keep_checkpoints >= 2, f"train.keep_checkpoints={tr.keep_checkpoints}: keep at least 2 so a damaged newest one has a fallback")
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
