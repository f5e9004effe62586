"""Chat conversations -> a tokenized, cached dataset (concatenated tokens + loss mask + offsets).

Source: a JSONL file (one ``{"messages": [...]}`` object per line; ShareGPT-style
``{"conversations": [{"from", "value"}]}`` is accepted too), a ``datasets`` directory saved with
``save_to_disk``, anything ``datasets.load_dataset`` reads, or ``embedded`` (the offline corpus of
``dflash.data.embedded``, built from the target).

Layout of the source, by record index (blank JSONL lines are not records):
``[0, num_train)`` is tokenized for training, with ``num_train = min(num_samples, total - E)``;
``[total - E, total)`` (E = ``num_eval_prompts``) is the held-out eval tail, never trained on.

Bad input is skipped and counted, never raised, and the result is deterministic:
``malformed`` (bad JSON, not an object, no/empty messages, bad role or content, a template that
does not render an assistant content), ``too_long`` (``overlong=skip`` only), ``token_out_of_vocab``,
``no_supervised_pair`` (no two consecutive loss-mask-1 tokens after truncation). Truncated samples
are kept and counted separately. Too many skips abort (``data.max_skip_fraction``).

Cache: ``<cache_dir>/<fingerprint>/{data.safetensors, meta.json}`` (no pickle), written to a temp
dir and renamed under a file lock, so every rank may call :func:`build_or_load_dataset` at once:
one builds, the others load. ``file_lock`` is ``flock``: it serializes processes of one host (or
a shared filesystem with working flock).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dflash.data.chat import (
    MalformedConversation,
    assistant_spans,
    encode_with_offsets,
    mask_from_offsets,
    special_token_texts,
    validate_messages,
)
from dflash.files import file_lock

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SKIP_REASONS = ("malformed", "too_long", "no_supervised_pair", "token_out_of_vocab")
EMBEDDED = "embedded"
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}


@dataclass(eq=False)
class TokenizedDataset:
    """All training samples, concatenated. Sample i is ``tokens[offsets[i]:offsets[i+1]]``."""

    tokens: torch.Tensor
    """[total] int32: every kept sample's token ids, concatenated."""
    loss_mask: torch.Tensor
    """[total] uint8: 1 on supervised (assistant) tokens."""
    offsets: torch.Tensor
    """[n+1] int64: sample boundaries, offsets[0] = 0, offsets[-1] = total."""
    sample_ids: torch.Tensor
    """[n] int64: index of each sample's source conversation (record index in the source)."""
    skipped: dict[str, int]
    """Skip reason -> count; every reason of SKIP_REASONS is present."""
    num_source: int
    """Conversations considered for training (the denominator of the skip fraction)."""
    fingerprint: str
    truncated: int = 0
    """Kept samples that were cut to max_length (overlong=truncate); not a skip."""
    skip_examples: dict[str, str] = field(default_factory=dict, compare=False)
    """Skip reason -> the first such record and why (for error messages)."""
    loaded_from_cache: bool = field(default=False, compare=False)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> torch.Tensor:
        """[n] int64 sample lengths (what the data plan packs)."""
        return self.offsets[1:] - self.offsets[:-1]

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids int64 [L], loss_mask uint8 [L])`` of sample i."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b].long(), self.loss_mask[a:b]

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


# ---------------------------------------------------------------------------------------- source


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


def resolve_source(cfg: Any, target_dir: str | os.PathLike | None = None) -> str:
    """``cfg.path``, or for ``embedded`` the JSONL built (once, cached) from the target at target_dir."""
    if cfg.path != EMBEDDED:
        return str(cfg.path)
    if target_dir is None:
        raise ValueError("data.path=embedded needs the target directory: pass target_dir=cfg.target.path")
    from dflash.data.embedded import build_embedded_corpus, embedded_corpus_path

    out = embedded_corpus_path(
        _cache_root(cfg), target_dir, cfg.embedded_num_prompts, cfg.embedded_max_new_tokens, cfg.seed
    )
    build_embedded_corpus(
        Path(target_dir),
        out,
        num_prompts=cfg.embedded_num_prompts,
        max_new_tokens=cfg.embedded_max_new_tokens,
        seed=cfg.seed,
    )
    return str(out)


def split_ranges(num_records: int, num_samples: int | None, num_eval: int) -> tuple[range, range]:
    """(training record range, held-out eval record range) of a source with num_records records."""
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


# ------------------------------------------------------------------------------- fingerprints


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


def _settings(cfg: Any, vocab_size: int) -> dict[str, Any]:
    if cfg.overlong not in ("truncate", "skip"):
        raise ValueError(f"data.overlong={cfg.overlong!r}: must be truncate or skip")
    if cfg.max_length < 2:
        raise ValueError(f"data.max_length={cfg.max_length}: must be >= 2")
    return {
        "version": FORMAT_VERSION,
        "split": cfg.split,
        "vocab_size": int(vocab_size),
        "max_length": int(cfg.max_length),
        "overlong": cfg.overlong,
        "train_only_last_turn": bool(cfg.train_only_last_turn),
        "num_samples": cfg.num_samples,
        "num_eval_prompts": int(cfg.num_eval_prompts),
    }


def dataset_fingerprint(source_fingerprint: str, tokenizer: Any, settings: dict[str, Any]) -> str:
    """sha256 over the source content, the tokenizer (+ chat template) and the tokenization settings."""
    blob = json.dumps(
        {"source": source_fingerprint, "tokenizer": tokenizer_fingerprint(tokenizer), "settings": settings},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


# ------------------------------------------------------------------------------- tokenization


def pretokenized(record: dict) -> tuple[np.ndarray, np.ndarray]:
    """A record that carries its own ``input_ids`` and ``loss_mask`` (equal-length int lists).

    Regenerated data can store the exact token ids the target produced: decoding them to text and
    re-tokenizing does not always give the same ids back (BPE), and every such difference is a
    training label the target would not have produced. ``messages`` may sit beside them (eval
    prompts and humans read those); the ids win for training.
    """
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise ValueError("'input_ids' and 'loss_mask' must be lists of equal length")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise ValueError("'input_ids' must hold integers")
    if any(m not in (0, 1) for m in mask):
        raise ValueError("'loss_mask' must hold 0/1")
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)



def tokenize_records(
    records: Iterable[tuple[int, Any]],
    tokenizer: Any,
    *,
    vocab_size: int,
    max_length: int,
    overlong: str = "truncate",
    train_only_last_turn: bool = False,
    chunk_size: int = 512,
) -> TokenizedDataset:
    """Tokenize ``(source index, record)`` pairs into a dataset, skipping and counting bad ones.

    Rendering and mask location run per conversation; tokenization runs in batches of chunk_size.
    The result has ``num_source = number of records`` and an empty fingerprint (set by the caller).
    """
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    first_error: dict[str, str] = {}
    special = set(special_token_texts(tokenizer).values())
    toks: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    ids_kept: list[int] = []
    n_source = truncated = 0

    def skip(reason: str, idx: int, why: str) -> None:
        skipped[reason] += 1
        first_error.setdefault(reason, f"record {idx}: {why}")

    def admit(idx: int, ids: np.ndarray, mask: np.ndarray) -> None:
        """Truncate or skip, check the vocabulary and the supervision, keep the sample."""
        nonlocal truncated
        if len(ids) > max_length:
            if overlong == "skip":
                skip("too_long", idx, f"{len(ids)} tokens > data.max_length={max_length}")
                return
            ids, mask = ids[:max_length], mask[:max_length]
            truncated += 1
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
            skip("token_out_of_vocab", idx, f"token id {bad} outside [0, {vocab_size})")
            return
        if not (mask[1:] & mask[:-1]).any():
            skip("no_supervised_pair", idx, "no two consecutive supervised tokens")
            return
        toks.append(ids.astype(np.int32))
        masks.append(mask)
        ids_kept.append(idx)

    def flush(batch: list[tuple[int, str, list[tuple[int, int]]]]) -> None:
        if not batch:
            return
        all_ids, all_offsets = encode_with_offsets(tokenizer, [text for _, text, _ in batch])
        for (idx, text, spans), ids, offsets in zip(batch, all_ids, all_offsets, strict=True):
            ids = np.asarray(ids, dtype=np.int64)
            admit(idx, ids, mask_from_offsets(offsets, ids, spans, special, text))
        batch.clear()

    batch: list[tuple[int, str, list[tuple[int, int]]]] = []
    for idx, record in records:
        n_source += 1
        if isinstance(record, dict) and "input_ids" in record:
            try:
                admit(idx, *pretokenized(record))
            except ValueError as exc:
                skip("malformed", idx, f"{type(exc).__name__}: {exc}")
            continue
        try:
            messages = parse_messages(record)
            text, spans = assistant_spans(tokenizer, messages, train_only_last_turn=train_only_last_turn)
        except (ValueError, jinja2.TemplateError) as exc:  # malformed data, or a template rejecting it
            skip("malformed", idx, f"{type(exc).__name__}: {exc}")
            continue
        batch.append((idx, text, spans))
        if len(batch) >= chunk_size:
            flush(batch)
    flush(batch)

    lengths = np.array([len(t) for t in toks], dtype=np.int64)
    offsets = np.zeros(len(toks) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ds = TokenizedDataset(
        tokens=torch.from_numpy(np.concatenate(toks) if toks else np.zeros(0, np.int32)),
        loss_mask=torch.from_numpy(np.concatenate(masks) if masks else np.zeros(0, np.uint8)),
        offsets=torch.from_numpy(offsets),
        sample_ids=torch.tensor(ids_kept, dtype=torch.int64),
        skipped=skipped,
        num_source=n_source,
        fingerprint="",
        truncated=truncated,
        skip_examples=first_error,
    )
    return ds


# ------------------------------------------------------------------------------------ cache


def _cache_root(cfg: Any) -> Path:
    root = str(cfg.cache_dir)
    if "${" in root:
        raise ValueError(f"data.cache_dir={root!r} is an unresolved interpolation; pass a resolved config")
    return Path(root)


def lock_path(cache_root: Path, fingerprint: str) -> Path:
    return cache_root / f".{fingerprint}.lock"


def save_dataset(ds: TokenizedDataset, final: Path, meta: dict[str, Any]) -> None:
    """Write ``ds`` to ``final`` atomically (temp dir in the same parent, then rename)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(
            {
                "tokens": ds.tokens.contiguous(),
                "loss_mask": ds.loss_mask.contiguous(),
                "offsets": ds.offsets.contiguous(),
                "sample_ids": ds.sample_ids.contiguous(),
            },
            str(tmp / "data.safetensors"),
        )
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        if final.exists():  # a stale, incomplete dir (no meta.json): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_cached_dataset(final: Path) -> TokenizedDataset | None:
    """The dataset cached at ``final``, or None when there is no complete cache there."""
    meta_file = final / "meta.json"
    if not meta_file.exists():
        return None
    meta = json.loads(meta_file.read_text())
    if meta.get("settings", {}).get("version") != FORMAT_VERSION:
        return None
    t = load_file(str(final / "data.safetensors"))
    ds = TokenizedDataset(
        tokens=t["tokens"],
        loss_mask=t["loss_mask"],
        offsets=t["offsets"],
        sample_ids=t["sample_ids"],
        skipped={r: int(meta["skipped"].get(r, 0)) for r in SKIP_REASONS},
        num_source=int(meta["num_source"]),
        fingerprint=meta["fingerprint"],
        truncated=int(meta.get("truncated", 0)),
        skip_examples=meta.get("skip_examples", {}),
        loaded_from_cache=True,
    )
    if (
        int(ds.offsets[-1]) != ds.tokens.numel()
        or ds.loss_mask.numel() != ds.tokens.numel()
        or len(ds) != ds.sample_ids.numel()
    ):
        raise ValueError(
            f"corrupt dataset cache {final}: inconsistent sizes; delete the directory to rebuild"
        )
    return ds


def check_skip_fraction(ds: TokenizedDataset, max_skip_fraction: float) -> None:
    """Raise ValueError when more than max_skip_fraction of the conversations were skipped, or
    when nothing is left to train on."""
    frac = ds.num_skipped / max(ds.num_source, 1)
    if frac <= max_skip_fraction and len(ds) > 0:
        return
    counts = ", ".join(f"{r}={c}" for r, c in ds.skipped.items() if c)
    examples = "; ".join(f"first {r}: {e}" for r, e in ds.skip_examples.items())
    fixes = ["fix or filter the data"]
    if ds.skipped.get("too_long"):
        fixes.append("raise data.max_length or set data.overlong=truncate")
    if ds.skipped.get("token_out_of_vocab"):
        fixes.append("check that the tokenizer matches the target (target.tokenizer)")
    fixes.append(f"or raise data.max_skip_fraction (now {max_skip_fraction}) above {frac:.3f}")
    raise ValueError(
        f"data.max_skip_fraction={max_skip_fraction}: {ds.num_skipped} of {ds.num_source} conversations "
        f"({100 * frac:.1f}%) were skipped ({counts or 'none'}), {len(ds)} left; {examples}. "
        f"Fix: {', '.join(fixes)}."
    )


def _identify(cfg: Any, tokenizer: Any, vocab_size: int, target_dir: str | os.PathLike | None):
    settings = _settings(cfg, vocab_size)
    source = Source(resolve_source(cfg, target_dir), cfg.split)
    return source, settings, dataset_fingerprint(source.fingerprint, tokenizer, settings)


def cache_dir_of(
    cfg: Any, tokenizer: Any, vocab_size: int, *, target_dir: str | os.PathLike | None = None
) -> Path:
    """``<cache_dir>/<fingerprint>``: where :func:`build_or_load_dataset` caches this dataset."""
    return _cache_root(cfg) / _identify(cfg, tokenizer, vocab_size, target_dir)[2]


def build_or_load_dataset(
    cfg: Any, tokenizer: Any, vocab_size: int, *, target_dir: str | os.PathLike | None = None
) -> TokenizedDataset:
    """The tokenized training set of ``cfg`` (a DataConfig), from the cache or built and cached.

    Safe to call from every rank at once (exactly one builds). ``vocab_size`` is the target's
    embedding rows (ids at or above it are skipped as token_out_of_vocab). ``target_dir`` is needed
    for ``data.path=embedded`` only. Raises ValueError when too many samples are skipped.
    """
    source, settings, fp = _identify(cfg, tokenizer, vocab_size, target_dir)
    train, _ = split_ranges(source.num_records, cfg.num_samples, cfg.num_eval_prompts)
    root = _cache_root(cfg)
    final = root / fp
    ds = load_cached_dataset(final)
    if ds is None:
        with file_lock(lock_path(root, fp)):
            ds = load_cached_dataset(final)
            if ds is None:
                log.info("tokenizing %d conversations of %s into %s", len(train), source.path, final)
                ds = tokenize_records(
                    _take(source.records(), train.stop),
                    tokenizer,
                    vocab_size=vocab_size,
                    max_length=cfg.max_length,
                    overlong=cfg.overlong,
                    train_only_last_turn=cfg.train_only_last_turn,
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
        "dataset %s: %d samples, %d tokens, skipped %s, truncated %d",
        fp[:12],
        len(ds),
        ds.tokens.numel(),
        ds.skipped,
        ds.truncated,
    )
    check_skip_fraction(ds, cfg.max_skip_fraction)
    return ds


def _take(records: Iterator[Any], stop: int) -> Iterator[tuple[int, Any]]:
    for idx, rec in enumerate(records):
        if idx >= stop:
            return
        yield idx, rec


def load_eval_conversations(cfg: Any, *, target_dir: str | os.PathLike | None = None) -> list[list[dict]]:
    """The held-out tail (the last ``cfg.num_eval_prompts`` records) as parsed message lists.

    Malformed records of the tail are dropped (logged). Never overlaps the training records.
    """
    if cfg.num_eval_prompts <= 0:
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


def load_eval_samples(cfg: Any, tokenizer: Any, vocab_size: int) -> TokenizedDataset:
    """The held-out tail tokenized exactly as training samples are (not cached: it is small).

    Eval decodes from each sample's prompt (the ids before its first supervised token) and
    estimates tau_hat on the whole sample, so both numbers come from the same conversations.
    """
    source = Source(resolve_source(cfg, None), cfg.split)
    _, held_out = split_ranges(source.num_records, cfg.num_samples, cfg.num_eval_prompts)
    records = ((i, r) for i, r in enumerate(source.records()) if i in held_out)
    return tokenize_records(
        records, tokenizer, vocab_size=vocab_size, max_length=cfg.max_length, overlong=cfg.overlong,
        train_only_last_turn=cfg.train_only_last_turn,
    )
