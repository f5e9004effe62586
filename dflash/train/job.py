"""Entry point: compose -> validate -> claim the run dir -> prepare -> init dist -> build role -> run.

    torchrun --standalone --nproc_per_node 3 -m dflash.train                       # embedded CPU default
    torchrun --nproc_per_node 8 -m dflash.train experiment=qwen3_8b_7x1 data.path=/data/chat.jsonl

Everything that can be wrong with the config, the data, the run directory or the checkpoint to
resume is found before the process group starts, and reported once (``dflash.cli``).
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

from omegaconf import DictConfig, OmegaConf

from dflash.cli import global_rank, quiet_console, run_app, value_errors_are_user_errors
from dflash.config import Config, UserError, register_configs, to_config
from dflash.config.checks import validate
from dflash.distributed.topology import Topology
from dflash.files import DiskFull, atomic_write
from dflash.train.checkpoint import LoadedCheckpoint

log = logging.getLogger("dflash")
register_configs()


class Role(Protocol):
    def run(self) -> int: ...

    def close(self, exit_code: int = 0) -> None: ...


def build_role(cfg: Config, setup, ctx, run_dir: Path, resume: LoadedCheckpoint | None) -> Role:
    """The only place that branches on the rank: a TargetWorker or a DrafterTrainer."""
    if setup.topology.role_of(ctx.rank) == "target":
        from dflash.train.target_worker import TargetWorker

        return TargetWorker(cfg, setup, ctx)
    from dflash.train.trainer import DrafterTrainer

    return DrafterTrainer(cfg, setup, ctx, run_dir, resume)


def start_role(cfg: Config, setup, ctx, run_dir: Path, resume: LoadedCheckpoint | None) -> Role:
    """After the process groups: one message on every link of this rank within
    ``topology.first_contact_timeout_s`` (an unreachable peer is named now, with what usually causes
    it, before any model loads), then this rank's role."""
    from dflash.distributed.collectives import first_contact_hint, warm_up_links
    from dflash.distributed.links import PeerError

    wait_s = cfg.topology.first_contact_timeout_s
    try:
        warm_up_links(setup.topology, ctx.rank, ctx.device, wait_s, groups=ctx.link_groups)
    except PeerError as e:
        raise PeerError(f"{e}\n{first_contact_hint(ctx.backend, wait_s)}") from e
    return build_role(cfg, setup, ctx, run_dir, resume)


def train(dcfg: DictConfig, run_dir: Path) -> int:
    """One rank's whole life; returns its exit code (0, or ``EXIT_STOPPED`` for an early stop).

    A failure is written to this rank's log before the cleanup (W&B finish, process-group
    teardown) runs: when a peer dies, torchrun SIGTERMs the surviving ranks within tens of
    milliseconds, and a rank must have named the failure by then.
    """
    rank = global_rank()
    with ExitStack() as cleanup:
        try:
            return _train(dcfg, run_dir, rank, cleanup)
        except (UserError, DiskFull):  # one line, printed by dflash.cli
            raise
        except Exception as e:
            log.exception("rank %d failed", rank)
            e.dflash_logged = True  # type: ignore[attr-defined]
            raise


def _quiet_transformers() -> None:
    """No per-rank 'Loading weights' bars: the ranks load their models at the same time."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _setup_phase(cfg: Config, world_size: int, topology: Topology, rank: int, run_dir: Path):
    """Everything before the process group; a ``ValueError`` here is a user's mistake."""
    from dflash.config.resolve import resolve_path
    from dflash.train.run_dir import resume_checkpoint
    from dflash.train.setup import prepare

    with value_errors_are_user_errors():
        if cfg.eval.every > 0 and cfg.eval.suite is not None:  # names and data, on every rank
            from dflash.eval.suites import load_suite

            ev = cfg.eval
            load_suite(ev.suite, ev.data_dir, ev.max_samples, ev.seed, field_prefix="eval.")
        setup = prepare(cfg, world_size)
        resume = None
        if topology.role_of(rank) == "drafter":
            is_leader = rank == topology.leader_rank
            resume = resume_checkpoint(
                run_dir,
                cfg.train,
                setup.contract,
                resolve_path,
                is_leader=is_leader,
                num_drafters=topology.num_drafters,
            )
    return setup, resume


def _train(dcfg: DictConfig, run_dir: Path, rank: int, cleanup: ExitStack) -> int:
    cfg = to_config(dcfg)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world_size)  # config alone: before the imports below, which take seconds
    topology = Topology.from_config(cfg.topology, world_size)
    is_leader = rank == topology.leader_rank
    # Console: rank 0 says what every rank does (setup, data), the leader what the drafter does.
    if rank == 0:
        quiet_console(logging.INFO)
    else:
        quiet_console(
            logging.INFO if is_leader else logging.WARNING,
            drop_info_from=("dflash.train.setup", "dflash.data"),
        )
    _quiet_transformers()
    from dflash.train.run_dir import RunDirLock, run_dir_problems

    refused = run_dir_problems(run_dir)
    if refused:
        raise UserError("; ".join(refused))
    if is_leader:
        cleanup.enter_context(RunDirLock(run_dir))
    setup, resume = _setup_phase(cfg, world_size, topology, rank, run_dir)
    if is_leader:
        atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(dcfg, resolve=True))

    from dflash.distributed.collectives import shared_run_dir_problems
    from dflash.distributed.process_group import destroy, init_distributed

    ctx = init_distributed(cfg.topology)
    # An error path aborts the communicators: a receive that will never be matched blocks a destroy.
    cleanup.push(lambda exc_type, exc, tb: destroy(ctx, failed=exc_type is not None))
    blind = shared_run_dir_problems(ctx, run_dir, cfg.topology.init_timeout_s)
    if blind:
        raise UserError(
            f"hydra.run.dir={run_dir} is not one directory for every rank: {', '.join(blind)} cannot see what "
            f"{setup.topology.describe(setup.topology.leader_rank)} wrote there. Put the run directory on a "
            f"filesystem every node mounts (NFS, Lustre, ...) and give every node the same hydra.run.dir"
        )
    log.info("%s in %s", setup.topology.describe(ctx.rank), run_dir)
    role = start_role(cfg, setup, ctx, run_dir, resume)
    cleanup.push(lambda exc_type, exc, tb: role.close(0 if exc_type is None else 1))
    return role.run()


def main() -> None:
    from dflash.eval.suites import suite_overrides

    # packets change shape every step: segments that grow in place instead of fragmenting the cache
    # (before CUDA starts; a value the user set is kept)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    sys.argv[1:] = suite_overrides(sys.argv[1:])  # eval.suite=gsm8k,mbpp: a list, not a Hydra sweep
    run_app("config", Config, train)


if __name__ == "__main__":
    main()
