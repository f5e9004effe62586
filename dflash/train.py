"""Entry point: compose -> validate -> prepare -> init dist -> build this rank's role -> run -> close.

torchrun --standalone --nproc_per_node 3 -m dflash.train                       # embedded CPU default
torchrun --nproc_per_node 8 -m dflash.train experiment=qwen3_8b_7x1 data.path=/data/chat.jsonl
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from dflash.config import Config, register_configs, to_config, validate
from dflash.files import atomic_write

log = logging.getLogger("dflash")
register_configs()


def build_role(cfg: Config, setup, ctx, run_dir: Path):
    """The only place that branches on the rank: a TargetWorker or a DrafterTrainer."""
    if setup.topology.role_of(ctx.rank) == "target":
        from dflash.targets.worker import TargetWorker

        return TargetWorker(cfg, setup, ctx)
    from dflash.drafter.trainer import DrafterTrainer

    return DrafterTrainer(cfg, setup, ctx, run_dir)


@record
def run(dcfg: DictConfig, run_dir: Path) -> None:
    """One rank's whole life; the error that ends it is also written to its own log (rank{RANK}.log).

    The error is logged before the cleanup (W&B finish, process-group teardown) runs: when a peer
    dies, torchrun SIGTERMs the surviving ranks within tens of milliseconds, and a rank must have
    named the failure in its log by then.
    """
    rank = int(os.environ.get("RANK", "0"))
    with ExitStack() as cleanup:
        try:
            _run(dcfg, run_dir, rank, cleanup)
        except Exception:
            log.exception("rank %d failed", rank)
            raise


def _run(dcfg: DictConfig, run_dir: Path, rank: int, cleanup: ExitStack) -> None:
    cfg = to_config(dcfg)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Config-only problems first, before the imports below (transformers, the drafter model) take seconds.
    validate(cfg, world_size)
    from dflash.distributed.collectives import warm_up_links
    from dflash.distributed.process_group import destroy, init_distributed
    from dflash.setup import prepare

    setup = prepare(cfg, world_size)
    if rank == setup.topology.leader_rank:
        atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(dcfg, resolve=True))
    ctx = init_distributed(cfg.topology)
    cleanup.callback(destroy, ctx)
    warm_up_links(
        setup.topology, ctx.rank, ctx.device, cfg.topology.init_timeout_s, control_group=ctx.control_group
    )
    log.info("%s in %s", setup.topology.describe(ctx.rank), run_dir)
    role = build_role(cfg, setup, ctx, run_dir)
    cleanup.push(lambda exc_type, exc, tb: role.close(0 if exc_type is None else 1))
    role.run()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    run(dcfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
