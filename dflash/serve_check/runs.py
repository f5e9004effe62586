"""The run whose export the serve check serves: trained here once and cached, or given (``run_dir=``).

The default run is the embedded tiny default (``torchrun --standalone --nproc_per_node 3 -m dflash.train``,
the run of ``make demo``) with periodic eval and W&B off, in ``<work_dir>/runs/default-<key>``: ``key``
hashes the composed training config (every conf/ default and override) and ``DFLASH_CACHE_DIR``.
A cached run is reused while the current exporter still writes, from its final checkpoint, exactly the
export the run holds (``config.json`` and every tensor): a change of the export code retrains it.

:class:`TrainedRun` is what the check reads from a run: the drafter as trained (its ``DrafterArch`` from
the checkpoint's run contract and the checkpoint's weights, independent of the export's config.json,
so a broken export cannot also break the reference), the target directory and the run's config, from
which the held-out prompts are cut exactly as the periodic eval cuts them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dflash.config import Config, register_configs, to_config
from dflash.config.checks import known_keys_only
from dflash.distributed.launch import torchrun_command
from dflash.drafter.arch import DrafterArch
from dflash.serve_check.exports import trained_difference

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
TRAIN_BASE = ["eval.every=0", "logging=disabled", "logging.progress_bar=false"]
"""Always added to the default run: nothing that changes its drafter."""


@dataclass
class TrainedRun:
    dir: Path
    config: Config
    arch: DrafterArch
    """The drafter as trained: the run contract's ``drafter.arch``."""
    state: dict[str, torch.Tensor]
    """The final checkpoint's drafter weights."""
    step: int
    target_dir: Path
    target_num_layers: int
    trained: bool = False
    """Whether this check trained it (False: reused or given)."""
    seconds: float = 0.0

    @property
    def export_dir(self) -> Path:
        return self.dir / "drafter"


def compose_training_config(overrides: list[str]) -> DictConfig:
    """``conf/config.yaml`` composed with ``overrides``, inside a Hydra app on ``conf/`` (this one: Hydra
    is initialised on the same config directory) or outside any."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    from dflash.cli import compose_config

    register_configs()
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=overrides)
    return compose_config("config", overrides)


def run_key(overrides: list[str]) -> str:
    """A short hash of the composed training config with ``overrides`` and of ``DFLASH_CACHE_DIR``."""
    text = OmegaConf.to_yaml(compose_training_config([*TRAIN_BASE, *overrides]), resolve=False)
    text += "\nDFLASH_CACHE_DIR=" + os.environ.get("DFLASH_CACHE_DIR", "")
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def load_run(run_dir: Path) -> TrainedRun:
    """Read a finished run; ``ValueError`` saying what is missing when it is not one."""
    from dflash.train.checkpoint import latest_checkpoint, load_checkpoint

    run_dir = Path(run_dir)
    for need in ("config.yaml", "drafter/config.json", "drafter/model.safetensors"):
        if not (run_dir / need).is_file():
            raise ValueError(f"run_dir={run_dir}: no {need} (not a finished dflash run)")
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise ValueError(f"run_dir={run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    register_configs()
    schema = OmegaConf.structured(Config)
    saved = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    assert isinstance(saved, dict)
    merged = OmegaConf.merge(schema, known_keys_only(saved, Config))
    assert isinstance(merged, DictConfig)
    cfg = to_config(merged)
    loaded = load_checkpoint(ckpt)
    arch = DrafterArch(**loaded.contract["drafter.arch"])
    target_dir = Path(cfg.target.path)
    num_layers = int(json.loads((target_dir / "config.json").read_text())["num_hidden_layers"])
    state = loaded.model_state
    if state is None:  # a sharded drafter's checkpoint: DCP shards
        from dflash.distributed.sharded_state import read_model_state

        assert loaded.state_dir is not None
        state = read_model_state(loaded.state_dir)
    return TrainedRun(run_dir, cfg, arch, state, loaded.step, target_dir, num_layers)


def export_difference(run: TrainedRun) -> str | None:
    """How the run's ``drafter/`` differs from what the current exporter writes from its final
    checkpoint (None when identical: same config.json, same tensor names, shapes and values)."""
    return trained_difference(run.export_dir, run.arch, run.state, target_num_layers=run.target_num_layers)


def train(run_dir: Path, overrides: list[str], nproc: int, timeout_s: float) -> None:
    """Train the default run into ``run_dir`` (a fresh directory); its console output goes to
    ``<run_dir>.train.log``. ``RuntimeError`` with the log's tail when it fails."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(nproc, [*TRAIN_BASE, *overrides, f"hydra.run.dir={run_dir}"])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    log_path = run_dir.with_name(run_dir.name + ".train.log")
    log.info("training %s: %s (log %s)", run_dir, " ".join(cmd[3:]), log_path)
    with open(log_path, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(
            f"training the serve check's run failed (exit {proc.returncode}), {log_path}:\n{tail}"
        )


def ensure_run(work_dir: Path, overrides: list[str], nproc: int, timeout_s: float) -> TrainedRun:
    """The default run, reused when cached and current (see the module docstring), else trained."""
    from dflash.files import file_lock

    run_dir = Path(work_dir).absolute() / "runs" / f"default-{run_key(overrides)}"
    t0 = time.perf_counter()
    with file_lock(run_dir.with_name(run_dir.name + ".lock")):
        try:
            run = load_run(run_dir)
            stale = export_difference(run)
        except Exception as e:  # noqa: BLE001 - any unreadable cache is retrained
            stale = f"{type(e).__name__}: {e}" if run_dir.exists() else None
            run = None
        if run is not None and stale is None:
            run.seconds = time.perf_counter() - t0
            return run
        if stale:
            log.info("retraining %s: %s", run_dir, stale)
        train(run_dir, overrides, nproc, timeout_s)
        run = load_run(run_dir)
        stale = export_difference(run)
        if stale is not None:
            raise RuntimeError(
                f"{run_dir}: the run's export is not what its final checkpoint exports: {stale}"
            )
    run.trained, run.seconds = True, time.perf_counter() - t0
    return run
