"""What a run knows about its target before any weight loads: where it is, its ``config.json``
(``TargetMeta``) and its tokenizer.

``resolve_target`` builds the offline tiny target first when the config asks for one
(``target.tiny``); ``target_problems`` lists what only the target's config and tokenizer show
about the data settings. The training job (``dflash.train.setup``) and the data apps use both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash.config import DataConfig, TargetConfig
from dflash.config.resolve import resolve_path
from dflash.targets.loader import TargetMeta, read_target_meta


@dataclass(frozen=True)
class TargetInfo:
    path: str
    """A local directory (absolute) or a hub id."""
    meta: TargetMeta
    tokenizer: Any


def resolve_target(cfg: TargetConfig) -> TargetInfo:
    """The target's path, config and tokenizer (the tiny target is built first when ``cfg.tiny`` is
    set); reads no weights. ValueError when the path or its config.json cannot be read."""
    from transformers import AutoTokenizer

    path = resolve_path(cfg.path)
    if cfg.tiny is not None:
        from dflash.targets.tiny import ensure_tiny_target

        path = str(ensure_tiny_target(path, cfg.tiny))
    meta = read_target_meta(path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    tok_path = resolve_path(cfg.tokenizer) if cfg.tokenizer else path
    tokenizer = AutoTokenizer.from_pretrained(
        tok_path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
    )
    return TargetInfo(path, meta, tokenizer)


def target_problems(target: TargetInfo, data: DataConfig, block_size: int) -> list[str]:
    """Problems of the tokenizer and the data settings that only the target's config shows."""
    p: list[str] = []
    vocab = target.meta.vocab_size
    if len(target.tokenizer) > vocab:
        p.append(
            f"the tokenizer has {len(target.tokenizer)} tokens but the target embedding only {vocab} rows; "
            f"set target.tokenizer to the target's own tokenizer"
        )
    if data.max_length + block_size > target.meta.max_position_embeddings:
        p.append(
            f"data.max_length={data.max_length} + drafter.block_size exceeds the target's "
            f"max_position_embeddings={target.meta.max_position_embeddings}; lower data.max_length"
        )
    return p
