"""The run's data config with every path resolved.

``resolve_data_config`` returns a new ``DataConfig`` (the one it is given is never changed): the
data and cache paths made absolute, and ``path=embedded`` replaced by the embedded corpus file,
built once from the target, so every later reader (the held-out eval prompts on a drafter) finds
the same file without the target directory.
"""

from __future__ import annotations

from dataclasses import replace

from dflash.config import DataConfig
from dflash.config.resolve import resolve_path
from dflash.data.sources import resolve_data_path, resolve_source


def resolve_data_config(cfg: DataConfig, target_path: str) -> DataConfig:
    """``cfg`` with ``path`` and ``cache_dir`` resolved (the embedded corpus built if asked for)."""
    path = resolve_data_path(cfg.path, resolve_path)  # each path of a list; embedded unchanged
    resolved = replace(cfg, path=path, cache_dir=resolve_path(cfg.cache_dir))
    return replace(resolved, path=resolve_source(resolved, target_path))
