"""The schema of ``python -m dflash.eval`` (``conf/eval_app.yaml``), registered with Hydra as
:data:`SCHEMA_NAME` by :func:`register_eval_schema`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from dflash.config import ChatTemplateConfig, Device, LoggingConfig, PathsConfig, TargetConfig

SCHEMA_NAME = "dflash_eval_schema"


@dataclass
class EvalAppConfig:
    """Schema of ``conf/eval_app.yaml`` (``python -m dflash.eval``)."""

    name: str = "eval"
    """The eval's name: its run directory under outputs/eval/ and its W&B run."""
    target: TargetConfig = field(default_factory=TargetConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    drafter_path: str = MISSING
    """An exported drafter directory (config.json + model.safetensors, see dflash.drafter.export)."""
    prompts: str | None = None
    """JSONL of {"messages": [...]} (prompt = messages before the last assistant one) or a datasets path.
    Exactly one of ``prompts`` and ``suite``."""
    split: str = "train"
    """Split of a datasets path."""
    num_prompts: int | None = None
    """Use only the first N usable prompts (None = all)."""
    suite: Any = None
    """Benchmarks of the z-lab benchmark (``dflash.eval.suites``): ``zlab`` (all five), one of gsm8k,
    math500, humaneval, mbpp, mt-bench, or a list (``suite=[gsm8k,mt-bench]``; ``suite=gsm8k,mbpp`` too)."""
    data_dir: str | None = None
    """A folder with one ``save_to_disk`` copy per benchmark (``<data_dir>/gsm8k``, ...) for offline
    hosts; None = read each benchmark from the hub with ``datasets``."""
    max_samples: int | None = None
    """Per benchmark: at most this many rows, a seeded sample as the reference draws it (None = all)."""
    seed: int = 0
    """Seed of that sample (0: the reference's transformers backend)."""
    gather_timeout_s: float = 7200.0
    """On a torchrun launch: how long a rank that finished its share waits for the others."""
    max_new_tokens: int = 256
    """Tokens decoded per prompt (per turn of a multi-turn benchmark)."""
    block_size: int | None = None
    """None = the drafter's block size."""
    baseline: bool = True
    """Also run block size 1: needed for speedup, TPOT(AR) and the lossless check."""
    warmup: bool = True
    """One short untimed generation of each kind before timing."""
    device: Device = Device.auto
    """auto (cuda when available, else cpu), cpu or cuda."""
    data: ChatTemplateConfig = field(default_factory=ChatTemplateConfig)
    """``data.chat_template_kwargs``: how prompts are rendered (e.g. {enable_thinking: false} for Qwen3, as in
    the z-lab benchmark); the same key as training's, and it must match it."""
    eos_token_ids: list[int] | None = None
    """None = the tokenizer's eos + the target's generation_config eos."""
    step: int = 0
    """train/step the metrics are logged at (e.g. the training step of the evaluated drafter)."""


def register_eval_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=EvalAppConfig)
