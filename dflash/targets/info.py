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
from dflash.targets.loader import INDEX_FILE, SINGLE_FILE, TargetMeta, read_target_meta, resolve_file


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


FINGERPRINT_SAMPLES = 16
"""Data blocks hashed per safetensors file by ``weights_fingerprint``."""
FINGERPRINT_BLOCK = 1 << 16


def weights_fingerprint(path: str, revision: str | None = None) -> str:
    """What identifies the target's weights, cheap for a 100 GB checkpoint (part of the run contract).

    A hub id: ``hub:<id>@<commit>``, the commit of the cached snapshot (hub snapshots are
    content-addressed). A local directory: the sha256 of, per ``*.safetensors`` file (sorted by
    name), its name, its size, its whole header (tensor names, dtypes, shapes, offsets) and
    ``FINGERPRINT_SAMPLES`` evenly spaced 64 KiB blocks of its data: about 1 MiB read per file. Any
    change to the header, the size or the sampled bytes (a re-saved, re-scaled or swapped model)
    changes it; an edit confined to bytes between the samples does not. ``none``: no weights file
    (``target.random_weights``)."""
    local = Path(path)
    if not local.is_dir():
        found = resolve_file(path, INDEX_FILE, revision) or resolve_file(path, SINGLE_FILE, revision)
        return f"hub:{path}@{Path(found).parent.name if found else revision or 'unknown'}"
    files = sorted(local.glob("*.safetensors"))
    if not files:
        return "none"
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}:".encode())
        _hash_safetensors_sample(f, h)
    return h.hexdigest()


def _hash_safetensors_sample(path: Path, h: Any) -> None:
    """Feed ``h`` the header of a safetensors file and the sampled blocks of its data."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        h.update(head)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        h.update(fh.read(min(header_len, size)))
        start = 8 + header_len
        span = max(size - start - FINGERPRINT_BLOCK, 0)
        for i in range(FINGERPRINT_SAMPLES):
            fh.seek(start + span * i // max(FINGERPRINT_SAMPLES - 1, 1))
            h.update(fh.read(FINGERPRINT_BLOCK))
