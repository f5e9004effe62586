"""The tokenized training set of a DataConfig, fingerprinted and cached on disk.

Cache: ``<cache_dir>/<fingerprint>/{data.safetensors, meta.json}`` (no pickle), where the
fingerprint covers the source content, the tokenizer (+ chat template) and the tokenization
settings. The directory is written with ``dflash.files.atomic_directory`` under a file lock, so
every rank may call :func:`build_or_load_dataset` at once: one builds, the others load.
``file_lock`` is ``flock``: it serializes processes of one host (or a shared filesystem with
working flock).

Every entry is checked when it is loaded: ``meta.json`` carries a checksum of its own content and
the size and sha256 of ``data.safetensors`` (hashed once when the entry is built; a file over
:data:`FULL_HASH_LIMIT` is hashed on sampled blocks, see ``dflash.files.file_digest``, and its
tensors are range-checked: ids inside the vocabulary, a 0/1 mask, increasing offsets). A damaged
entry (truncated, overwritten, an edited ``meta.json``) is named in a warning and rebuilt from the
source, never trained on.

The held-out eval tail is read by ``dflash.data.sources.load_eval_conversations`` (messages) and
``dflash.data.tokenize.load_eval_samples`` (tokenized, not cached).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash.config import DataConfig, dataset_settings
from dflash.data.sources import Source, cache_root, check_template_kwargs, resolve_source, split_ranges
from dflash.data.tokenize import (
    SKIP_REASONS,
    TokenizedDataset,
    TokenizeSettings,
    check_skip_fraction,
    tokenize_records,
)
from dflash.files import atomic_directory, cache_fix, digest_files, digest_problems, file_lock

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 2: spans start after the generation prompt, character cap; 3: tool calls
DATA_FILE, META_FILE = "data.safetensors", "meta.json"
FULL_HASH_LIMIT = 4 << 30
"""Bytes of ``data.safetensors`` up to which every byte is hashed on load (above: sampled blocks)."""
_TENSORS = {
    "tokens": torch.int32,
    "loss_mask": torch.uint8,
    "offsets": torch.int64,
    "sample_ids": torch.int64,
}


class DamagedCache(ValueError):
    """A dataset cache entry whose files do not match what was written (the message names them)."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's backend JSON (vocab, merges, added tokens) and its chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # no fast backend: vocabulary + class
        h.update(type(tokenizer).__name__.encode())
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(b"\0template\0")
    h.update(str(tokenizer.chat_template).encode())
    return h.hexdigest()


def _settings(cfg: DataConfig, vocab_size: int) -> dict[str, Any]:
    """What shapes the tokenized dataset besides the source content and the tokenizer: the
    DataConfig fields tagged ``data=True`` (``dflash.config.dataset_settings``), the target's
    vocabulary size and the cache format."""
    if cfg.overlong not in ("truncate", "skip"):
        raise ValueError(f"data.overlong={cfg.overlong!r}: must be truncate or skip")
    if cfg.max_length < 2:
        raise ValueError(f"data.max_length={cfg.max_length}: must be >= 2")
    if cfg.max_record_chars is not None and cfg.max_record_chars < 1:
        raise ValueError(f"data.max_record_chars={cfg.max_record_chars}: must be >= 1 or null")
    return {"version": FORMAT_VERSION, "vocab_size": int(vocab_size), **dataset_settings(cfg)}


def dataset_fingerprint(source_fingerprint: str, tokenizer: Any, settings: dict[str, Any]) -> str:
    """sha256 over the source content, the tokenizer (+ chat template) and the tokenization settings."""
    blob = json.dumps(
        {"source": source_fingerprint, "tokenizer": tokenizer_fingerprint(tokenizer), "settings": settings},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def lock_path(root: Path, fingerprint: str) -> Path:
    """The file lock that serializes building ``<root>/<fingerprint>`` (root: the cache root)."""
    return root / f".{fingerprint}.lock"


def meta_checksum(meta: dict[str, Any]) -> str:
    """sha256 of ``meta`` (without its own ``checksum`` entry) as canonical JSON."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save_dataset(ds: TokenizedDataset, final: Path, meta: dict[str, Any]) -> None:
    """Write ``ds`` (its four tensors) and ``meta`` (plus the digest of the tensors' file and a
    checksum of itself) to the directory ``final`` atomically, replacing any old one
    (``atomic_directory``: the files end with the user's default, world-readable mode)."""
    with atomic_directory(final, fix=cache_fix("data.cache_dir")) as tmp:
        save_file({name: getattr(ds, name).contiguous() for name in _TENSORS}, str(tmp / DATA_FILE))
        meta = {**meta, "files": digest_files(tmp, [DATA_FILE], sample_above=FULL_HASH_LIMIT)}
        meta["checksum"] = meta_checksum(meta)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))


def _read_meta(final: Path) -> dict[str, Any]:
    """``meta.json`` of a cache entry, parsed and checked against its checksum (DamagedCache if not)."""
    meta_file = final / META_FILE
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        raise DamagedCache(f"{meta_file}: unreadable ({exc})") from None
    if isinstance(meta, dict) and "checksum" not in meta:
        raise DamagedCache(f"{meta_file}: no checksum (written by an older dflash, without content hashes)")
    if not isinstance(meta, dict) or meta.get("checksum") != meta_checksum(meta):
        raise DamagedCache(f"{meta_file}: its content does not match its checksum (edited or damaged)")
    return meta


def _check_tensors(t: dict[str, torch.Tensor], vocab_size: int, where: Path) -> None:
    """The cached tensors have the shapes, dtypes and values a build writes (DamagedCache if not)."""
    bad = [k for k, dt in _TENSORS.items() if k not in t or t[k].dtype != dt or t[k].dim() != 1]
    if bad:
        raise DamagedCache(f"{where}: tensors {bad} missing or of the wrong dtype or shape")
    tokens, mask, offsets, ids = (t[k] for k in _TENSORS)
    problems = []
    if offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != tokens.numel():
        problems.append("offsets do not span the tokens")
    elif offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        problems.append("offsets decrease")
    if mask.numel() != tokens.numel() or ids.numel() != offsets.numel() - 1:
        problems.append("tensor lengths disagree")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        problems.append(f"token ids outside [0, {vocab_size})")
    if mask.numel() and int(mask.max()) > 1:
        problems.append("loss mask values other than 0/1")
    if problems:
        raise DamagedCache(f"{where}: {', '.join(problems)}")


def load_cached_dataset(final: Path) -> TokenizedDataset | None:
    """The dataset cached at ``final``; None when there is no entry there. Raises
    :class:`DamagedCache` naming the file when the entry does not match what was written."""
    if not (final / META_FILE).exists():
        if (final / DATA_FILE).exists():
            raise DamagedCache(f"{final / META_FILE}: missing beside {DATA_FILE}")
        return None
    meta = _read_meta(final)
    problems = digest_problems(final, meta.get("files"))
    if problems:
        raise DamagedCache("; ".join(problems))
    try:
        t = load_file(str(final / DATA_FILE))
        _check_tensors(t, int(meta["settings"]["vocab_size"]), final / DATA_FILE)
        return TokenizedDataset(
            tokens=t["tokens"],
            loss_mask=t["loss_mask"],
            offsets=t["offsets"],
            sample_ids=t["sample_ids"],
            skipped={r: int(meta["skipped"].get(r, 0)) for r in SKIP_REASONS},
            num_source=int(meta["num_source"]),
            fingerprint=str(meta["fingerprint"]),
            truncated=int(meta.get("truncated", 0)),
            skip_examples=dict(meta.get("skip_examples", {})),
            loaded_from_cache=True,
        )
    except (SafetensorError, OSError, KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, DamagedCache):
            raise
        raise DamagedCache(f"{final}: cannot be loaded ({type(exc).__name__}: {exc})") from None


def _load_or_none(final: Path, *, warn: bool) -> TokenizedDataset | None:
    """:func:`load_cached_dataset`, with a damaged entry logged (``warn``) and treated as absent."""
    try:
        return load_cached_dataset(final)
    except DamagedCache as exc:
        if warn:
            log.warning("dataset cache %s is damaged, rebuilding it from the source: %s", final, exc)
        return None


def _identify(
    cfg: Any, tokenizer: Any, vocab_size: int, target_dir: str | os.PathLike | None
) -> tuple[Source, dict[str, Any], str]:
    """(the opened source, the tokenization settings, the dataset fingerprint) of ``cfg``."""
    settings = _settings(cfg, vocab_size)
    source = Source(resolve_source(cfg, target_dir), cfg.split)
    for part in source.parts:  # each generated file of a folder, glob or list has its own sidecar
        check_template_kwargs(part.name, dict(cfg.chat_template_kwargs))
    return source, settings, dataset_fingerprint(source.fingerprint, tokenizer, settings)


def cache_dir_of(
    cfg: Any, tokenizer: Any, vocab_size: int, *, target_dir: str | os.PathLike | None = None
) -> Path:
    """``<cache_dir>/<fingerprint>``: where :func:`build_or_load_dataset` caches this dataset."""
    return cache_root(cfg) / _identify(cfg, tokenizer, vocab_size, target_dir)[2]


def build_or_load_dataset(
    cfg: Any,
    tokenizer: Any,
    vocab_size: int,
    *,
    target_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> TokenizedDataset:
    """The tokenized training set of ``cfg`` (a DataConfig), from the cache or built and cached.

    Safe to call from every rank at once (exactly one builds, with ``cfg.num_workers`` tokenizer
    processes). ``vocab_size`` is the target's embedding rows (ids at or above it are skipped as
    token_out_of_vocab). ``target_dir`` is needed for ``data.path=embedded`` only. ``progress``
    shows a tqdm bar while building. Raises ValueError when too many samples are skipped.
    """
    source, settings, fp = _identify(cfg, tokenizer, vocab_size, target_dir)
    train, _ = split_ranges(source.num_records, cfg.num_samples, cfg.num_eval_prompts)
    root = cache_root(cfg)
    final = root / fp
    ds = _load_or_none(final, warn=True)
    if ds is None:
        with file_lock(lock_path(root, fp)):
            ds = _load_or_none(final, warn=False)
            if ds is None:
                log.info(
                    "tokenizing %d conversations of %s into %s (%d worker processes)",
                    len(train),
                    source.path,
                    final,
                    cfg.num_workers,
                )
                with _progress_bar(len(train), progress) as bar:
                    ds = tokenize_records(
                        islice(source.numbered(), train.stop),
                        tokenizer,
                        TokenizeSettings.of(cfg, vocab_size),
                        num_workers=cfg.num_workers,
                        progress=bar.update if bar is not None else None,
                    )
                ds.fingerprint = fp
                meta = {
                    "fingerprint": fp,
                    "skipped": ds.skipped,
                    "truncated": ds.truncated,
                    "num_source": ds.num_source,
                    "num_samples_kept": len(ds),
                    "num_tokens": ds.tokens.numel(),
                    "source": source.path,
                    "source_fingerprint": source.fingerprint,
                    "settings": settings,
                    "skip_examples": ds.skip_examples,
                }
                save_dataset(ds, final, meta)
    log.info(
        "dataset %s: %d samples, %d tokens, skipped %s, truncated %d (%s %s)",
        fp[:12],
        len(ds),
        ds.tokens.numel(),
        ds.skipped,
        ds.truncated,
        "loaded from the cache" if ds.loaded_from_cache else "built into the cache",
        final,
    )
    check_skip_fraction(ds, cfg.max_skip_fraction)
    if (note := truncation_note(ds, cfg)) is not None:
        log.warning("%s", note)
    return ds


TRUNCATED_SHARE = 0.1
"""Above this share of kept samples cut to ``data.max_length``, building or loading the dataset warns."""


def truncation_note(ds: TokenizedDataset, cfg: DataConfig) -> str | None:
    """One line when more than :data:`TRUNCATED_SHARE` of the kept samples were cut, naming
    ``data.max_length`` and the chat defaults; else None."""
    kept = len(ds)
    if kept == 0 or ds.truncated <= TRUNCATED_SHARE * kept:
        return None
    return (
        f"{ds.truncated} of {kept} samples ({ds.truncated / kept:.0%}) were cut to data.max_length="
        f"{cfg.max_length} tokens (or data.max_record_chars): the drafter never sees their ends. For chat "
        "data use data=chat_jsonl (max_length 3072, 16,384-token packets) or raise data.max_length and "
        "data.token_budget"
    )


@contextmanager
def _progress_bar(total: int, enabled: bool) -> Iterator[Any]:
    """A tqdm bar over the records being tokenized, or None."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc="tokenize", unit="rec", dynamic_ncols=True) as bar:
        yield bar
