"""``python -m dflash.data.prepare``: build the training set's cache once, before training.

    python -m dflash.data.prepare experiment=qwen3_8b_7x1 data.path=/data/regen.jsonl data.num_workers=16
    python -m dflash.data.prepare data.path=/data/regen.jsonl show=3      # 3 samples, supervised text marked

It composes the training config (``conf/config.yaml``: the same groups and overrides), so the
dataset fingerprint, and therefore the cache directory, is the one ``torchrun -m dflash.train``
computes with the same overrides: training then loads the cache instead of tokenizing on every
rank's first launch. It runs what every rank runs before the process group
(the libraries ``dflash.train.setup`` calls: config checks, the tiny target and embedded corpus if asked for,
tokenization with ``data.num_workers`` processes and a progress bar), then prints the statistics
and, with ``show=N``, the first N samples with their supervised tokens marked (colour on a
terminal, brackets otherwise): exactly the loss mask training uses.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from dflash.cli import run_app, value_errors_are_user_errors
from dflash.config import FREE, Config, to_config
from dflash.config.modes import planned_world_size

if TYPE_CHECKING:
    import torch

    from dflash.data.plan import DataPlan


@dataclass
class PrepareConfig(Config):
    """The training schema plus what only ``prepare`` reads."""

    show: int = field(default=0, metadata=FREE)
    """Print the first N samples with the supervised tokens marked."""


def register_prepare_schema() -> None:
    """Register :class:`PrepareConfig` under the training schema's name, so that
    ``conf/config.yaml`` (which ``conf/prepare.yaml`` includes) composes into it."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="dflash_schema", node=PrepareConfig)


def run(cfg: PrepareConfig) -> str:
    """Build (or find) the cache of ``cfg.data``, print the statistics and ``cfg.show`` samples;
    returns the cache directory. Raises ValueError on a config or data problem."""
    from dflash.config.checks import validate
    from dflash.data.cache import build_or_load_dataset
    from dflash.data.display import dataset_summary, show_samples
    from dflash.data.plan import DataPlan
    from dflash.data.resolve import resolve_data_config
    from dflash.distributed.topology import Topology
    from dflash.drafter.resolve import resolve_drafter
    from dflash.targets.info import resolve_target

    if cfg.show < 0:
        raise ValueError(f"show={cfg.show}: must be >= 0 (the number of samples to print)")
    world_size = planned_world_size(cfg.topology)
    validate(cfg, world_size)
    topology = Topology.from_config(cfg.topology, world_size, cfg.optim.grad_accum_steps)
    target = resolve_target(cfg.target, cfg.paths.cache_dir)
    resolve_drafter(cfg, target)  # the config problems training would refuse, reported here first
    data = resolve_data_config(cfg.data, target.path)
    ds = build_or_load_dataset(data, target.tokenizer, target.meta.vocab_size, progress=True)
    plan = DataPlan.build(
        ds.lengths(), data.token_budget, data.seed, data.num_epochs, padded_rows=not cfg.target.pack
    )
    num_steps = plan.num_steps(topology.packets_per_step, cfg.train.max_steps)
    cache = f"{data.cache_dir}/{ds.fingerprint}"
    where = "found in the cache" if ds.loaded_from_cache else "built"
    print(f"dataset {ds.fingerprint[:12]} {where}: {cache}", flush=True)
    print(dataset_summary(ds, cfg.data.max_length), flush=True)
    print(
        f"data plan: {plan.num_packets} packets, {num_steps} optimizer steps; training with the "
        "same overrides loads this cache",
        flush=True,
    )
    print(packet_fill_line(plan, ds.lengths()), flush=True)
    held_out = data.num_eval_prompts or 0
    if held_out:
        print(held_out_line(held_out, cfg.eval.every), flush=True)
    if cfg.show:
        print(show_samples(ds, target.tokenizer, cfg.show, color=sys.stdout.isatty()), flush=True)
    return cache


def packet_fill_line(plan: DataPlan, lengths: torch.Tensor) -> str:
    """How full the plan's packets are, and (padded rows) how much of the target's work is padding."""
    real, computed = plan.packet_tokens(lengths)
    line = f"packets: {float(real.float().mean()):,.0f} tokens on average (data.token_budget={plan.token_budget})"
    if not plan.padded_rows:
        return line + ", one packed row each"
    waste = 1 - float(real.sum()) / float(computed.sum())
    return line + (
        f"; padded rows (target.pack=false), length-bucketed: the target computes "
        f"{float(computed.float().mean()):,.0f} tokens per packet, {waste:.1%} of them padding"
    )


def held_out_line(num_eval: int, eval_every: int) -> str:
    """What ``prepare`` says about the held-out eval tail: it comes out of the user's own data."""
    why = f"eval.every={eval_every} evaluates on them" if eval_every > 0 else "held out for eval"
    return (
        f"held out: the last {num_eval} records of data.path are never trained on ({why}; "
        f"data.num_eval_prompts={num_eval}: set it to choose how many)"
    )


register_prepare_schema()


def prepare_task(dcfg: DictConfig, _run_dir: Path) -> int:
    """What ``python -m dflash.data.prepare`` does (typed exactly as training types its config)."""
    cfg = to_config(dcfg)
    assert isinstance(cfg, PrepareConfig)
    with value_errors_are_user_errors():
        run(cfg)
    return 0


def main() -> None:
    run_app("prepare", PrepareConfig, prepare_task)


if __name__ == "__main__":
    main()
