"""Conversation sources: opening them, reading their records, and which records train or eval.

A source is a JSONL file (one ``{"messages": [...]}`` object per line; ShareGPT-style
``{"conversations": [{"from", "value"}]}`` is accepted too), a ``datasets`` directory saved with
``save_to_disk``, anything ``datasets.load_dataset`` reads, or ``embedded`` (the offline corpus of
``dflash.data.embedded``, built from the target; :func:`resolve_source` turns it into its file).

Layout of the source, by record index (blank JSONL lines are not records):
``[0, num_train)`` is tokenized for training, with ``num_train = min(num_samples, total - E)``;
``[total - E, total)`` (E = ``num_eval_prompts``) is the held-out eval tail, never trained on
(:func:`split_ranges`; :func:`load_eval_conversations` reads the tail as message lists).

Unparseable records come out as :class:`BadRecord` and unusable ones raise
``MalformedConversation`` from :func:`parse_messages`: the caller counts them, nothing here aborts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.data.chat import MalformedConversation, validate_messages
from dflash.data.embedded import build_embedded_corpus, embedded_corpus_path

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
"""The ``data.path`` value that names the embedded corpus."""
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}


@dataclass(frozen=True)
class BadRecord:
    """A source record that could not even be parsed (e.g. invalid JSON); counted as malformed."""

    reason: str


class Source:
    """An opened conversation source: a content fingerprint, the record count and the records."""

    def __init__(self, path: str, split: str = "train") -> None:
        self.path, self.split = path, split
        p = Path(path)
        self._ds = None
        if p.suffix in (".jsonl", ".json") and not p.exists():
            raise ValueError(f"data.path={path!r} does not exist; set data.path to a JSONL file or a dataset")
        if p.is_file():
            self.kind = "jsonl"
            self.fingerprint, self.num_records = _scan_jsonl(p)
        else:
            self.kind = "datasets"
            self._ds = _load_hf_dataset(path, split)
            self.num_records = len(self._ds)
            fp = getattr(self._ds, "_fingerprint", None)
            self.fingerprint = f"datasets:{fp}" if fp else _content_hash(self._ds)

    def records(self) -> Iterator[Any]:
        """Every record in order: a parsed JSON value, a ``datasets`` row dict, or a BadRecord."""
        if self.kind == "datasets":
            yield from self._ds
            return
        with open(self.path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    yield json.loads(raw)
                except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
                    yield BadRecord(f"line {lineno}: invalid JSON ({exc})")


def _scan_jsonl(path: Path) -> tuple[str, int]:
    """(sha256 of the file bytes, number of non-blank lines)."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for raw in fh:
            h.update(raw)
            if raw.strip():
                n += 1
    return f"jsonl:{h.hexdigest()}", n


def _load_hf_dataset(path: str, split: str):
    try:
        import datasets
    except ImportError as exc:
        raise ValueError(
            f"data.path={path!r} is not a file, so it must be a `datasets` dataset, but `datasets` is "
            "not installed: pip install 'dflash[data]' (or datasets), or convert it to JSONL"
        ) from exc
    p = Path(path)
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(p))
    else:
        ds = datasets.load_dataset(path, split=split)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(
                f"data.split={split!r} is not in {path!r} (splits: {sorted(ds)}); set data.split"
            )
        ds = ds[split]
    return ds


def _content_hash(ds) -> str:
    h = hashlib.sha256()
    for row in ds:
        h.update(json.dumps(row, sort_keys=True, default=str).encode())
    return f"rows:{h.hexdigest()}"


def load_conversations(path: str, split: str = "train") -> Iterator[Any]:
    """Raw records of a JSONL file or a ``datasets`` path, in order (see :class:`Source`).

    JSONL lines that fail to parse come out as :class:`BadRecord` (counted, never raised); use
    :func:`parse_messages` to turn a record into a validated message list.
    """
    return Source(path, split).records()


def parse_messages(record: Any) -> list[dict]:
    """A record's message list (``messages``, or ShareGPT ``conversations`` with from/value).

    Raises :class:`MalformedConversation` on anything unusable.
    """
    if isinstance(record, BadRecord):
        raise MalformedConversation(record.reason)
    if not isinstance(record, dict):
        raise MalformedConversation(f"record is a {type(record).__name__}, not an object")
    if "messages" in record:
        return validate_messages(record["messages"])
    conv = record.get("conversations")
    if isinstance(conv, list) and conv and all(isinstance(m, dict) and "from" in m for m in conv):
        conv = [{"role": _SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m.get("value")} for m in conv]
    if conv is None:
        raise MalformedConversation("record has no 'messages' (or 'conversations') field")
    return validate_messages(conv)


def cache_root(cfg: Any) -> Path:
    """``cfg.cache_dir`` (a DataConfig's) as a Path: the root of the dataset cache and of the
    embedded corpus. Raises ValueError on an unresolved ``${...}`` interpolation."""
    root = str(cfg.cache_dir)
    if "${" in root:
        raise ValueError(f"data.cache_dir={root!r} is an unresolved interpolation; pass a resolved config")
    return Path(root)


def resolve_source(cfg: Any, target_dir: str | os.PathLike | None = None) -> str:
    """``cfg.path``, or for ``embedded`` the JSONL built (once, cached) from the target at target_dir.

    The embedded corpus lives at ``embedded_corpus_path(cache_root(cfg), target_dir, ...)``; it is
    built under a file lock, so every rank may call this at once. Raises ValueError for
    ``embedded`` without ``target_dir``.
    """
    if cfg.path != EMBEDDED:
        return str(cfg.path)
    if target_dir is None:
        raise ValueError("data.path=embedded needs the target directory: pass target_dir=cfg.target.path")
    out = embedded_corpus_path(
        cache_root(cfg), target_dir, cfg.embedded_num_prompts, cfg.embedded_max_new_tokens, cfg.seed
    )
    build_embedded_corpus(
        Path(target_dir),
        out,
        num_prompts=cfg.embedded_num_prompts,
        max_new_tokens=cfg.embedded_max_new_tokens,
        seed=cfg.seed,
    )
    return str(out)


def split_ranges(num_records: int, num_samples: int | None, num_eval: int | None) -> tuple[range, range]:
    """(training record range, held-out eval record range) of a source with num_records records
    (``num_eval`` None: a DataConfig built without ``to_config``'s defaults; nothing held out)."""
    num_eval = num_eval or 0
    if num_eval < 0:
        raise ValueError(f"data.num_eval_prompts={num_eval} must be >= 0")
    if num_eval >= num_records:
        raise ValueError(
            f"data.num_eval_prompts={num_eval} leaves no training conversation in a source of "
            f"{num_records}; set data.num_eval_prompts below {num_records}"
        )
    n_train = num_records - num_eval
    if num_samples is not None:
        if num_samples < 1:
            raise ValueError(f"data.num_samples={num_samples} must be >= 1 (or null for all)")
        n_train = min(n_train, num_samples)
    return range(0, n_train), range(num_records - num_eval, num_records)


def load_eval_conversations(cfg: Any, *, target_dir: str | os.PathLike | None = None) -> list[list[dict]]:
    """The held-out tail (the last ``cfg.num_eval_prompts`` records) as parsed message lists.

    Malformed records of the tail are dropped (logged). Never overlaps the training records.
    ``target_dir`` is needed for ``data.path=embedded`` only.
    """
    if not cfg.num_eval_prompts:
        return []
    source = Source(resolve_source(cfg, target_dir), cfg.split)
    _, held_out = split_ranges(source.num_records, cfg.num_samples, cfg.num_eval_prompts)
    out: list[list[dict]] = []
    for idx, rec in enumerate(source.records()):
        if idx in held_out:
            try:
                out.append(parse_messages(rec))
            except MalformedConversation as exc:
                log.warning("eval record %d skipped: %s", idx, exc)
    return out
