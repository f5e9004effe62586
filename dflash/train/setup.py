"""What every rank derives identically before the process group exists (and before any model loads).

``prepare(cfg, world_size)`` takes a validated config (``dflash.config.checks.validate``), builds the
offline tiny target if the config asks for one, reads the target's ``config.json`` and tokenizer
(never its weights), checks everything that depends on them, resolves the tap ids, the MASK token
and the drafter architecture, builds or loads the tokenised dataset and computes the data plan and
the run contract. All ranks run it; file locks make sure cached artefacts are built once. The
config it is given is not changed: the resolved data settings are ``RunSetup.data``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from dflash.config import RESOLVED_CONTRACT_KEYS, Config, DataConfig, contract_values
from dflash.config.checks import raise_problems
from dflash.config.resolve import device_kind, torch_dtype
from dflash.data.cache import build_or_load_dataset
from dflash.data.plan import DataPlan
from dflash.data.resolve import resolve_data_config
from dflash.data.tokenize import TokenizedDataset
from dflash.distributed.protocol import PacketSpec
from dflash.distributed.topology import Topology
from dflash.drafter.arch import DrafterArch
from dflash.drafter.resolve import resolve_drafter
from dflash.sizing.memory import drafter_weights_problem, trained_bytes_per_param
from dflash.targets.families import TargetMeta
from dflash.targets.info import TargetInfo, resolve_target, weights_fingerprint
from dflash.targets.loader import device_capacity, target_size_problems
from dflash.targets.tp import tp_shape_problems

log = logging.getLogger(__name__)


@dataclass
class RunSetup:
    cfg: Config
    """The config as composed (never changed by ``prepare``)."""
    data: DataConfig
    """``cfg.data`` with its paths resolved (``dflash.data.resolve``): what every reader of the data uses."""
    target: TargetInfo
    layer_ids: list[int]
    arch: DrafterArch
    dataset: TokenizedDataset
    plan: DataPlan
    topology: Topology
    num_steps: int
    contract: dict[str, Any]

    @property
    def target_path(self) -> str:
        return self.target.path

    @property
    def meta(self) -> TargetMeta:
        return self.target.meta

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def packet_spec(self, dtype: torch.dtype, device: torch.device) -> PacketSpec:
        """What both ends of a link check on every packet (taps, width, dtype, size, device)."""
        return PacketSpec(
            num_taps=len(self.layer_ids),
            hidden_size=self.meta.hidden_size,
            dtype=dtype,
            max_tokens=self.data.token_budget,
            device=device,
        )


def run_contract(
    raw: dict[str, Any],
    weights: str,
    layer_ids: list[int],
    meta: TargetMeta,
    arch: DrafterArch,
    dataset_fingerprint: str,
    plan_fingerprint: str,
    num_steps: int,
    packets_per_step: int,
) -> dict[str, Any]:
    """What must not change across a resume: the CONTRACT-tagged config values (``raw``, from
    ``contract_values``) and the entries of ``RESOLVED_CONTRACT_KEYS`` that cover the derived fields,
    among them ``weights``, the target's ``weights_fingerprint`` (the same path with other weights
    in it is another target)."""
    resolved = {
        "target.weights": weights,
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


def size_problems(cfg: Config, target: TargetInfo, arch: DrafterArch) -> list[str]:
    """Whether the target splits over ``topology.target_tp`` ranks (transformers' plans), the
    target's weights (each rank's share of a tensor-parallel replica) and the drafter's
    weights, gradients and AdamW state against this rank's device, before anything is allocated
    (a hostile config.json requesting terabytes is refused on every rank, naming its fields)."""
    kind = device_kind(str(cfg.topology.device))
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if kind == "cuda"
        else torch.device("cpu")
    )
    source = f"target.path={target.path} (config.json)"
    k = cfg.topology.target_tp
    problems = tp_shape_problems(target.meta, k)
    problems += target_size_problems(
        target.meta, source, torch_dtype(cfg.target.dtype, device), device, shards=k
    )
    drafter = "drafter.* (the drafter's shape, from the config and the target)"
    p = drafter_weights_problem(
        drafter, arch, trained_bytes_per_param(str(cfg.optim.name)), *device_capacity(device)
    )
    return problems + ([p] if p else [])


def prepare(cfg: Config, world_size: int, *, progress: bool = False) -> RunSetup:
    """Everything a rank needs before the process group, for a validated ``cfg``; raises ValueError
    on any problem the target or the data show. ``progress`` shows a bar while the dataset is
    tokenized."""
    topology = Topology.from_config(cfg.topology, world_size, cfg.optim.grad_accum_steps)
    target = resolve_target(cfg.target, cfg.paths.cache_dir)
    layer_ids, arch = resolve_drafter(cfg, target)
    raise_problems(size_problems(cfg, target, arch), "config")
    data = resolve_data_config(cfg.data, target.path)
    dataset = build_or_load_dataset(data, target.tokenizer, target.meta.vocab_size, progress=progress)
    plan = DataPlan.build(
        dataset.lengths(), data.token_budget, data.seed, data.num_epochs, padded_rows=not cfg.target.pack
    )
    num_steps = plan.num_steps(topology.packets_per_step, cfg.train.max_steps)
    if cfg.train.max_steps and cfg.train.max_steps > num_steps:
        log.warning(
            "train.max_steps=%d but the data plan supports %d steps (the last %d records of data.path are "
            "held out for eval: data.num_eval_prompts); training %d",
            cfg.train.max_steps,
            num_steps,
            data.num_eval_prompts or 0,
            num_steps,
        )
    contract = run_contract(
        contract_values(cfg),
        weights_fingerprint(target.path, cfg.target.revision),
        layer_ids,
        target.meta,
        arch,
        dataset.fingerprint,
        plan.fingerprint(),
        num_steps,
        topology.packets_per_step,
    )
    meta = target.meta
    log.info(
        "setup: target %s (%d layers, H=%d, V=%d), taps %s, mask %d, %d samples, %d packets, %d steps",
        cfg.target.name,
        meta.num_layers,
        meta.hidden_size,
        meta.vocab_size,
        layer_ids,
        arch.mask_token_id,
        len(dataset),
        plan.num_packets,
        num_steps,
    )
    return RunSetup(cfg, data, target, layer_ids, arch, dataset, plan, topology, num_steps, contract)
