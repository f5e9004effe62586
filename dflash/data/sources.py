"""Conversation sources: opening them, reading their records, and which records train or eval.

A source is a JSONL file (one ``{"messages": [...]}`` object per line; ShareGPT-style
``{"conversations": [{"from", "value"}]}`` is accepted too), a ``datasets`` directory saved with
``save_to_disk``, anything ``datasets.load_dataset`` reads, or ``embedded`` (the offline corpus of
``dflash.data.embedded``, built from the target; :func:`resolve_source` turns it into its file).

Layout of the source, by record index (blank JSONL lines are not records):
``[0, num_train)`` is tokenized for training, with ``num_train = min(num_samples, total - E)``;
``[total - E, total)`` (E = ``num_eval_prompts``) is the held-out eval tail, never trained on
(:func:`split_ranges`; :func:`load_eval_conversations` reads the tail as message lists).

Unparseable records (invalid JSON or UTF-8, nesting too deep for the parser) come out as
:class:`BadRecord` and unusable ones raise ``MalformedConversation`` from :func:`parse_messages`:
the caller counts them, nothing here aborts on one record. Only a problem of the whole source (a
missing or unreadable file, no record at all) raises ``ValueError``, naming the config field and
the file.

A source may carry a sidecar ``<file>.meta.json`` (written by ``dflash.data.regenerate`` and by the
embedded corpus) recording the ``chat_template_kwargs`` its responses were generated with;
:func:`check_template_kwargs` refuses to tokenize it with different ones.
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
    """An opened conversation source: a content fingerprint, the record count and the records.

    ``field`` names the config field that gave ``path`` (``data.path``, ``input``, ``prompts``), so
    that every error about the source names what to change.
    """

    def __init__(self, path: str, split: str = "train", *, field: str = "data.path") -> None:
        self.path, self.split, self.field = path, split, field
        p = Path(path)
        self._ds: Any = None
        if p.suffix in (".jsonl", ".json") and not p.exists():
            raise ValueError(f"{field}={path!r} does not exist; set {field} to a JSONL file or a dataset")
        if p.is_file():
            self.kind = "jsonl"
            self.fingerprint, self.num_records = self._guard(lambda: _scan_jsonl(p))
        else:
            self.kind = "datasets"
            self._ds = _load_hf_dataset(path, split, field)
            self.num_records = len(self._ds)
            fp = getattr(self._ds, "_fingerprint", None)
            self.fingerprint = f"datasets:{fp}" if fp else _content_hash(self._ds)
        if self.num_records == 0:
            raise ValueError(
                f"{field}={path!r} has no records (an empty file, or only blank lines); set {field} to a "
                'JSONL with one {"messages": [...]} object per line (or a non-empty dataset)'
            )

    def _guard(self, read: Any) -> Any:
        try:
            return read()
        except OSError as exc:
            raise ValueError(f"{self.field}={self.path!r} cannot be read ({exc}); check the file") from exc

    def numbered(self) -> Iterator[tuple[int, str, Any]]:
        """``(record index, where, record)`` in order; ``where`` is ``<file>:<line>`` (JSONL) or
        ``<path>[<row>]`` (``datasets``), for messages that point at the record."""
        if self.kind == "datasets":
            for i, row in enumerate(self._ds):
                yield i, f"{self.path}[{i}]", row
            return
        try:
            with open(self.path, "rb") as fh:
                idx = 0
                for lineno, raw in enumerate(fh, 1):
                    if not raw.strip():
                        continue
                    yield idx, f"{self.path}:{lineno}", _parse_line(raw)
                    idx += 1
        except OSError as exc:
            raise ValueError(f"{self.field}={self.path!r} cannot be read ({exc}); check the file") from exc

    def records(self) -> Iterator[Any]:
        """Every record in order: a parsed JSON value, a ``datasets`` row dict, or a BadRecord."""
        for _, _, record in self.numbered():
            yield record


def _parse_line(raw: bytes) -> Any:
    """One JSONL line as a JSON value, or a :class:`BadRecord` saying why it is not one."""
    try:
        return json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        return BadRecord(f"invalid JSON ({exc})")
    except RecursionError:  # e.g. a line of 200,000 '['
        return BadRecord("invalid JSON (nested too deeply for the parser)")


def _scan_jsonl(path: Path) -> tuple[str, int]:
    """(sha256 of the file bytes, number of non-blank lines)."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for raw in fh:
            h.update(raw)
            if raw.strip():
                n += 1
    return f"jsonl:{h.hexdigest()}", n


def _load_hf_dataset(path: str, split: str, field: str = "data.path") -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ValueError(
            f"{field}={path!r} is not a file, so it must be a `datasets` dataset, but `datasets` is "
            "not installed: pip install 'dflash[data]' (or datasets), or convert it to JSONL"
        ) from exc
    p = Path(path)
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(p))
    else:
        ds = datasets.load_dataset(path, split=split)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            split_field = "data.split" if field == "data.path" else "split"
            raise ValueError(
                f"{split_field}={split!r} is not in {path!r} (splits: {sorted(ds)}); set {split_field}"
            )
        ds = ds[split]
    return ds


def _content_hash(ds: Any) -> str:
    h = hashlib.sha256()
    for row in ds:
        h.update(json.dumps(row, sort_keys=True, default=str).encode())
    return f"rows:{h.hexdigest()}"


def load_conversations(path: str, split: str = "train", *, field: str = "data.path") -> Iterator[Any]:
    """Raw records of a JSONL file or a ``datasets`` path, in order (see :class:`Source`).

    JSONL lines that fail to parse come out as :class:`BadRecord` (counted, never raised); use
    :func:`parse_messages` to turn a record into a validated message list.
    """
    return Source(path, split, field=field).records()


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
    kwargs = dict(cfg.chat_template_kwargs)
    out = embedded_corpus_path(
        cache_root(cfg), target_dir, cfg.embedded_num_prompts, cfg.embedded_max_new_tokens, cfg.seed, kwargs
    )
    build_embedded_corpus(
        Path(target_dir),
        out,
        num_prompts=cfg.embedded_num_prompts,
        max_new_tokens=cfg.embedded_max_new_tokens,
        seed=cfg.seed,
        chat_template_kwargs=kwargs,
    )
    return str(out)


def sidecar_meta_path(path: str | os.PathLike) -> Path:
    """``<file>.meta.json``: how a generated JSONL was made (regenerate, embedded corpus)."""
    p = Path(path)
    return p.with_name(p.name + ".meta.json")


def check_template_kwargs(source_path: str, template_kwargs: dict[str, Any]) -> None:
    """Raise ValueError when the source's sidecar records other ``chat_template_kwargs`` than
    ``template_kwargs`` (``data.chat_template_kwargs``): responses generated with thinking off
    and trained with thinking on (or the reverse) teach the drafter text the served target does
    not write."""
    meta_path = sidecar_meta_path(source_path)
    if not meta_path.is_file():
        return
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return
    generated = meta.get("chat_template_kwargs") if isinstance(meta, dict) else None
    if generated is None or dict(generated) == dict(template_kwargs):
        return
    fix = ",".join(f"{k}:{json.dumps(v)}" for k, v in sorted(generated.items()))
    raise ValueError(
        f"data.chat_template_kwargs={dict(template_kwargs)} but data.path={source_path!r} was generated "
        f"with chat_template_kwargs={dict(generated)} ({meta_path}); the training text must be rendered "
        f"as the target is served: set data.chat_template_kwargs={{{fix}}} (and serve with the same)"
    )


def split_ranges(num_records: int, num_samples: int | None, num_eval: int | None) -> tuple[range, range]:
    """(training record range, held-out eval record range) of a source with num_records records
    (``num_eval`` None: a DataConfig built without ``to_config``'s defaults; nothing held out)."""
    num_eval = num_eval or 0
    if num_eval < 0:
        raise ValueError(f"data.num_eval_prompts={num_eval} must be >= 0")
    if num_records == 0:
        raise ValueError("data.path has no records; set data.path to a non-empty JSONL or dataset")
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
