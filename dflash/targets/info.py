"""What a run knows about its target before any weight loads: where it is, its ``config.json``
(``TargetMeta``) and its tokenizer.

``resolve_target`` builds the offline tiny target first when the config asks for one
(``target.tiny``); ``target_problems`` lists what only the target's config and tokenizer show
about the data settings. The training job (``dflash.train.setup``) and the data apps use both.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.config import DataConfig, TargetConfig
from dflash.config.resolve import resolve_path
from dflash.files import file_digest
from dflash.targets.families import TargetMeta
from dflash.targets.loader import INDEX_FILE, SINGLE_FILE, read_target_meta, resolve_file


@dataclass(frozen=True)
class TargetInfo:
    path: str
    """A local directory (absolute) or a hub id."""
    meta: TargetMeta
    tokenizer: Any


def resolve_target(cfg: TargetConfig, cache_dir: str | None = None) -> TargetInfo:
    """The target's path, config and tokenizer; reads no weights. With ``cfg.tiny`` set the tiny
    target is built first, but only into a directory the project owns (``tiny_target_path``: a new
    one under ``cache_dir``, ``paths.cache_dir``, or an earlier build; without ``cache_dir`` any
    new directory): a user's model at ``cfg.path`` is loaded as it is. ValueError when the path or
    its config.json cannot be read."""
    from transformers import AutoTokenizer

    from dflash.targets.tiny import ensure_tiny_target, tiny_target_path

    path = resolve_path(cfg.path)
    if cache_dir is not None:
        path = tiny_target_path(cfg, path, resolve_path(cache_dir))
    elif cfg.tiny is not None:
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


FINGERPRINT_BLOCKS = 16
"""Blocks of 64 KiB ``weights_fingerprint`` hashes per safetensors file (the first holds its header)."""


def weights_fingerprint(path: str, revision: str | None = None) -> str:
    """What identifies the target's weights, cheap for a 100 GB checkpoint (part of the run contract).

    A hub id: ``hub:<id>@<commit>``, the commit of the cached snapshot (hub snapshots are
    content-addressed). A local directory: the sha256 of, per ``*.safetensors`` file (sorted by
    name), its name and a sampled ``dflash.files.file_digest``: its size and ``FINGERPRINT_BLOCKS``
    evenly spaced 64 KiB blocks, the first one its header (tensor names, dtypes, shapes, offsets):
    about 1 MiB read per file. A re-saved, re-scaled or swapped model changes it; an edit confined to
    bytes between the samples does not. ``none``: no weights file (``target.random_weights``)."""
    local = Path(path)
    if not local.is_dir():
        found = resolve_file(path, INDEX_FILE, revision) or resolve_file(path, SINGLE_FILE, revision)
        return f"hub:{path}@{Path(found).parent.name if found else revision or 'unknown'}"
    files = sorted(local.glob("*.safetensors"))
    if not files:
        return "none"
    h = hashlib.sha256()
    for f in files:
        digest = file_digest(f, sample_above=0, blocks=FINGERPRINT_BLOCKS, block_bytes=1 << 16)
        h.update(f"{f.name}:{digest['size']}:{digest['sha256']}\n".encode())
    return h.hexdigest()
