"""What every rank derives identically before the process group exists (and before any model loads).

``prepare(cfg, world_size)`` validates the config, builds the offline tiny target if the config asks
for one, reads the target's ``config.json`` and tokenizer (never its weights), checks everything
that depends on them, resolves the tap ids, the MASK token and the drafter architecture, builds or
loads the tokenised dataset and computes the data plan. All ranks run it; file locks make sure
cached artefacts are built once.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import to_absolute_path

from dflash.config import (
    FULL_ATTENTION,
    RESOLVED_CONTRACT_KEYS,
    SLIDING_ATTENTION,
    Config,
    contract_values,
)
from dflash.config_checks import raise_problems, validate
from dflash.data.cache import build_or_load_dataset
from dflash.data.plan import DataPlan
from dflash.data.sources import EMBEDDED, resolve_source
from dflash.data.tokenize import TokenizedDataset
from dflash.distributed.protocol import PacketSpec
from dflash.distributed.topology import Topology
from dflash.drafter.export import load_exported, warm_start_problems
from dflash.drafter.model import DrafterArch, rope_from_config
from dflash.targets.loader import TargetMeta, read_target_meta, resolve_layer_ids

log = logging.getLogger(__name__)


@dataclass
class RunSetup:
    cfg: Config
    target_path: str
    meta: TargetMeta
    tokenizer: Any
    layer_ids: list[int]
    arch: DrafterArch
    dataset: TokenizedDataset
    plan: DataPlan
    topology: Topology
    num_steps: int
    contract: dict[str, Any]

    def packet_spec(self, dtype: torch.dtype, device: torch.device) -> PacketSpec:
        """What both ends of a link check on every packet (taps, width, dtype, size, device)."""
        return PacketSpec(
            num_taps=len(self.layer_ids),
            hidden_size=self.meta.hidden_size,
            dtype=dtype,
            max_tokens=self.cfg.data.token_budget,
            device=device,
        )


def resolve_path(path: str) -> str:
    """A local path made absolute (Hydra does not chdir); a hub id is returned unchanged."""
    local = Path(to_absolute_path(path)) if not Path(path).is_absolute() else Path(path)
    return str(local) if local.exists() or path.startswith((".", "/")) else path


def resolve_mask_token_id(
    configured: int | None, from_checkpoint: int | None, tokenizer: Any, vocab_size: int
) -> int:
    """Config, then the drafter checkpoint, then the tokenizer's mask token, then the first embedding row
    past the tokenizer's vocabulary. Never pad, eos or bos: ValueError if that is all there is."""
    forbidden = {
        name: tid
        for name in ("pad_token_id", "eos_token_id", "bos_token_id")
        if (tid := getattr(tokenizer, name, None)) is not None
    }
    candidates = [
        ("drafter.mask_token_id", configured),
        ("the drafter.init_from checkpoint", from_checkpoint),
        ("the tokenizer's mask token", getattr(tokenizer, "mask_token_id", None)),
        (
            "the first embedding row past the tokenizer",
            len(tokenizer) if len(tokenizer) < vocab_size else None,
        ),
    ]
    for source, tid in candidates:
        if tid is None:
            continue
        if not 0 <= tid < vocab_size:
            raise ValueError(
                f"mask token id {tid} from {source} is outside the target vocabulary [0, {vocab_size}); "
                f"set drafter.mask_token_id to an unused embedding row"
            )
        clash = [n for n, f in forbidden.items() if f == tid]
        if clash:
            raise ValueError(
                f"mask token id {tid} from {source} is the tokenizer's {clash[0]}; a pad/eos/bos MASK silently "
                f"degrades acceptance: set drafter.mask_token_id to an unused embedding row"
            )
        return int(tid)
    raise ValueError(
        f"no MASK token: the tokenizer has {len(tokenizer)} tokens and the target embedding {vocab_size} rows, "
        f"so there is no unused row; set drafter.mask_token_id=<an unused, non-pad/eos/bos id>"
    )


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
        layer_types = list(d.layer_types)
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
    )


def target_problems(cfg: Config, meta: TargetMeta, tokenizer: Any) -> list[str]:
    """Problems only visible with the target's config.json and tokenizer (still no weights loaded).

    Tap ids are checked by ``resolve_layer_ids``."""
    p: list[str] = []
    if cfg.drafter.hidden_size is not None and cfg.drafter.hidden_size != meta.hidden_size:
        p.append(
            f"drafter.hidden_size={cfg.drafter.hidden_size} differs from the target's hidden_size={meta.hidden_size}; "
            f"the drafter reuses the target's embedding and lm_head, so set drafter.hidden_size=null"
        )
    if len(tokenizer) > meta.vocab_size:
        p.append(
            f"the tokenizer has {len(tokenizer)} tokens but the target embedding only {meta.vocab_size} rows; "
            f"set target.tokenizer to the target's own tokenizer"
        )
    heads = cfg.drafter.num_heads or meta.num_heads
    kv = cfg.drafter.num_kv_heads or meta.num_kv_heads
    if heads % kv:
        p.append(f"drafter.num_heads={heads} is not a multiple of drafter.num_kv_heads={kv}")
    head_dim = cfg.drafter.head_dim or meta.head_dim
    partial = cfg.drafter.partial_rotary_factor or rope_from_config(meta.text_config)[1]
    rotary = int(head_dim * partial)
    if rotary < 2 or rotary % 2:
        p.append(
            f"drafter.partial_rotary_factor={partial} rotates {rotary} of the drafter's head_dim={head_dim} dims; "
            "RoPE needs an even number >= 2: set drafter.partial_rotary_factor (e.g. 1.0)"
        )
    if cfg.data.max_length + cfg.drafter.block_size > meta.max_position_embeddings:
        p.append(
            f"data.max_length={cfg.data.max_length} + drafter.block_size exceeds the target's "
            f"max_position_embeddings={meta.max_position_embeddings}; lower data.max_length"
        )
    return p


def run_contract(
    raw: dict[str, Any],
    layer_ids: list[int],
    meta: TargetMeta,
    arch: DrafterArch,
    dataset_fingerprint: str,
    plan_fingerprint: str,
    num_steps: int,
    packets_per_step: int,
) -> dict[str, Any]:
    """What must not change across a resume: the CONTRACT-tagged config values (``raw``, from
    ``contract_values``) and the entries of ``RESOLVED_CONTRACT_KEYS`` that cover the derived fields."""
    resolved = {
        "target.layer_ids": list(layer_ids),
        "target.hidden_size": meta.hidden_size,
        "target.vocab_size": meta.vocab_size,
        "drafter.arch": arch.to_dict(),
        "data.fingerprint": dataset_fingerprint,
        "data.plan": plan_fingerprint,
        "train.num_steps": num_steps,
        "topology.packets_per_step": packets_per_step,
    }
    assert tuple(resolved) == RESOLVED_CONTRACT_KEYS and not set(resolved) & set(raw)
    return {**raw, **resolved}


def prepare(cfg: Config, world_size: int, *, progress: bool = False) -> RunSetup:
    """Everything a rank needs before the process group; raises ValueError on any config problem.
    ``progress`` shows a bar while the dataset is tokenized (``python -m dflash.data.prepare``)."""
    validate(cfg, world_size)
    raw_contract = contract_values(cfg)  # as the user gave it (paths below get resolved)
    topology = Topology.from_config(cfg.topology, world_size, cfg.optim.grad_accum_steps)
    target_path = resolve_path(cfg.target.path)
    if cfg.target.tiny is not None:
        from dflash.targets.tiny import ensure_tiny_target

        target_path = str(ensure_tiny_target(target_path, cfg.target.tiny))
    meta = read_target_meta(
        target_path, revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code
    )
    from transformers import AutoTokenizer

    tok_path = resolve_path(cfg.target.tokenizer) if cfg.target.tokenizer else target_path
    tokenizer = AutoTokenizer.from_pretrained(
        tok_path, revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code
    )
    problems = target_problems(cfg, meta, tokenizer)
    try:
        layer_ids = resolve_layer_ids(cfg.target, meta)
    except ValueError as e:
        problems.append(str(e))
        layer_ids = list(cfg.target.layer_ids or [])
    saved_arch = None
    if cfg.drafter.init_from:
        saved_arch, _ = load_exported(resolve_path(cfg.drafter.init_from))
    try:
        mask_id = resolve_mask_token_id(
            cfg.drafter.mask_token_id,
            saved_arch.mask_token_id if saved_arch else None,
            tokenizer,
            meta.vocab_size,
        )
    except ValueError as e:
        problems.append(str(e))
        mask_id = 0
    try:
        arch = build_arch(cfg, meta, layer_ids, mask_id, saved_arch)
    except ValueError as e:  # a layout that config_problems cannot see (e.g. taken from init_from)
        raise_problems([*problems, f"drafter: {e}"], "config")
        raise
    if saved_arch is not None:
        problems += warm_start_problems(saved_arch, arch)
    raise_problems(problems, "config")

    data_cfg = cfg.data
    path = data_cfg.path if data_cfg.path == EMBEDDED else resolve_path(data_cfg.path)
    data_cfg = type(data_cfg)(
        **{**asdict(data_cfg), "path": path, "cache_dir": resolve_path(data_cfg.cache_dir)}
    )
    # embedded: the corpus file, built once from the target; every later reader of cfg.data (the
    # held-out eval tail on the drafter) then finds the same file without the target directory
    data_cfg = type(data_cfg)(**{**asdict(data_cfg), "path": resolve_source(data_cfg, target_path)})
    cfg.data = data_cfg
    dataset = build_or_load_dataset(data_cfg, tokenizer, meta.vocab_size, progress=progress)
    plan = DataPlan.build(dataset.lengths(), data_cfg.token_budget, data_cfg.seed, data_cfg.num_epochs)
    available = topology.num_steps(plan.num_packets)
    if available < 1:
        raise ValueError(
            f"the data plan has {plan.num_packets} packets, fewer than one step needs ({topology.packets_per_step}); "
            f"lower data.token_budget or optim.grad_accum_steps, or add data"
        )
    num_steps = min(cfg.train.max_steps or available, available)
    if cfg.train.max_steps and cfg.train.max_steps > available:
        log.warning(
            "train.max_steps=%d but the data plan supports %d steps; training %d",
            cfg.train.max_steps,
            available,
            num_steps,
        )
    contract = run_contract(
        raw_contract,
        layer_ids,
        meta,
        arch,
        dataset.fingerprint,
        plan.fingerprint(),
        num_steps,
        topology.packets_per_step,
    )
    log.info(
        "setup: target %s (%d layers, H=%d, V=%d), taps %s, mask %d, %d samples, %d packets, %d steps",
        cfg.target.name,
        meta.num_layers,
        meta.hidden_size,
        meta.vocab_size,
        layer_ids,
        mask_id,
        len(dataset),
        plan.num_packets,
        num_steps,
    )
    return RunSetup(
        cfg, target_path, meta, tokenizer, layer_ids, arch, dataset, plan, topology, num_steps, contract
    )


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on GPU, float32 on CPU (bf16 matmul is 5-60x slower on these CPUs)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
