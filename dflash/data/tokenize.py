"""Records -> a :class:`TokenizedDataset` (concatenated tokens + loss mask + offsets).

Bad input is skipped and counted, never raised, and the result is deterministic:
``malformed`` (bad JSON or UTF-8, nesting too deep, not an object, no/empty messages, bad role or
content, a template that does not render an assistant content or a tool call, text the tokenizer rejects such as
a lone surrogate, a pre-tokenized id outside int64), ``too_long`` (``overlong=skip``, or a record
over the character cap that cannot be cut), ``token_out_of_vocab``, ``no_supervised_pair`` (no two
consecutive loss-mask-1 tokens after truncation). Truncated samples are kept and counted
separately. Too many skips abort (:func:`check_skip_fraction`, ``data.max_skip_fraction``). The
first few skips of each reason are logged with their file and line.

The character cap (``data.max_record_chars``) bounds the cost of one huge record: the message
contents are cut to it *before* rendering and tokenization, so a 50 MB assistant turn costs its
JSON parse and nothing more (see :func:`cap_messages`).

Tokenization can run in worker processes (``num_workers``); the records are cut into consecutive
chunks and the results joined in order, so the dataset is byte-identical to a single-process build.

Also here: :func:`load_eval_samples`, the held-out eval tail tokenized exactly as training samples
are (not cached; the cached training set is built by ``dflash.data.cache``).
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import jinja2
import numpy as np
import torch

from dflash.data.chat import (
    Span,
    assistant_spans,
    encode_with_offsets,
    mask_from_offsets,
    special_token_texts,
)
from dflash.data.sources import BadRecord, Source, parse_conversation, resolve_source, split_ranges

log = logging.getLogger(__name__)

SKIP_REASONS = ("malformed", "too_long", "no_supervised_pair", "token_out_of_vocab")
CHARS_PER_TOKEN_CAP = 32
"""``data.max_record_chars=null`` means this many characters per token of ``data.max_length``: far
more than any tokenizer packs into a token of real text, so the cut never shortens a sample."""
NUM_LOGGED = 5
"""Skips logged per reason (with file and line); the rest are only counted."""


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
    """Kept samples that were cut to max_length or max_record_chars (overlong=truncate); not a skip."""
    skip_examples: dict[str, str] = field(default_factory=dict, compare=False)
    """Skip reason -> the first such record, where it is and why (for error messages)."""
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


@dataclass(frozen=True)
class TokenizeSettings:
    """How records become samples (the ``data.*`` fields that shape the dataset, resolved)."""

    vocab_size: int
    max_length: int
    overlong: str = "truncate"
    train_only_last_turn: bool = False
    max_record_chars: int | None = None
    """None = CHARS_PER_TOKEN_CAP * max_length."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg: Any, vocab_size: int) -> TokenizeSettings:
        """The settings of a DataConfig for a target with ``vocab_size`` embedding rows."""
        return cls(
            vocab_size=vocab_size,
            max_length=cfg.max_length,
            overlong=cfg.overlong,
            train_only_last_turn=cfg.train_only_last_turn,
            max_record_chars=cfg.max_record_chars,
            template_kwargs=dict(cfg.chat_template_kwargs),
        )

    @property
    def char_cap(self) -> int:
        return self.max_record_chars or CHARS_PER_TOKEN_CAP * self.max_length


class TooLong(ValueError):
    """A record over the character cap that cannot be cut (counted as ``too_long``)."""


class MissingChatTemplate(ValueError):
    """A conversation must be rendered but the tokenizer has no chat template: a config error
    (``target.tokenizer``), raised at once, never counted as a malformed record."""


def require_chat_template(tokenizer: Any, where: str, field: str = "data.path") -> None:
    """Raise :class:`MissingChatTemplate` unless ``tokenizer`` can render conversations; ``where``
    names the first record that needs it (``file:line``), ``field`` the config field of the source."""
    if getattr(tokenizer, "chat_template", None):
        return
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    raise MissingChatTemplate(
        f"the tokenizer {name!r} (target.tokenizer, or the target's own) has no chat template, and {field} "
        f"holds conversations that need one to be rendered (first: {where}); set target.tokenizer=<a "
        "tokenizer with the target's chat template, e.g. its instruct model's>, or give records with "
        "input_ids + loss_mask"
    )


def _chars(msg: dict) -> int:
    reasoning = msg.get("reasoning_content")
    calls = msg.get("tool_calls")
    return (
        len(msg["content"])
        + (len(reasoning) if isinstance(reasoning, str) else 0)
        + (len(json.dumps(calls, ensure_ascii=False)) if calls else 0)
    )


def cap_messages(messages: list[dict], cap: int, overlong: str) -> tuple[list[dict], bool, bool]:
    """``(messages, cut, cut_inside_assistant)``: the messages cut to ``cap`` characters of content
    (``content`` + ``reasoning_content``), before anything is rendered.

    Under the cap: unchanged. Over it with ``overlong=skip``: :class:`TooLong`. Otherwise the
    messages after the cap are dropped; an assistant message straddling it is cut there (its
    reasoning first, then its content, the order Qwen3-style templates render them), any other
    straddling message is dropped (so is a straddling tool-call turn: a call cut short is not one
    the target wrote). Raises :class:`TooLong` when no assistant turn starts before the
    cap (nothing supervised would be left).
    """
    total = sum(_chars(m) for m in messages)
    if total <= cap:
        return messages, False, False
    if overlong == "skip":
        raise TooLong(f"{total} characters of content > data.max_record_chars={cap}")
    out: list[dict] = []
    used, cut_inside = 0, False
    for msg in messages:
        n = _chars(msg)
        if used + n <= cap:
            out.append(msg)
            used += n
            continue
        if msg["role"] == "assistant" and not msg.get("tool_calls"):
            room = cap - used
            cut = dict(msg)
            reasoning = msg.get("reasoning_content")
            if isinstance(reasoning, str):
                cut["reasoning_content"] = reasoning[:room]
                room -= len(cut["reasoning_content"])
            cut["content"] = msg["content"][:room]
            out.append(cut)
            cut_inside = True
        break
    if not any(m["role"] == "assistant" for m in out):
        raise TooLong(
            f"{total} characters of content and no assistant turn starts within data.max_record_chars={cap}"
        )
    return out, True, cut_inside


def pretokenized(record: dict) -> tuple[np.ndarray, np.ndarray]:
    """A record that carries its own ``input_ids`` and ``loss_mask`` (equal-length int lists).

    Regenerated data can store the exact token ids the target produced: decoding them to text and
    re-tokenizing does not always give the same ids back (BPE), and every such difference is a
    training label the target would not have produced. ``messages`` may sit beside them (eval
    prompts and humans read those); the ids win for training. Raises ValueError on a bad record.
    """
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise ValueError("'input_ids' and 'loss_mask' must be lists of equal length")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise ValueError("'input_ids' must hold integers")
    if any(m not in (0, 1) for m in mask):
        raise ValueError("'loss_mask' must hold 0/1")
    try:
        return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)
    except OverflowError:
        big = next(x for x in ids if not -(2**63) <= x < 2**63)
        raise ValueError(f"'input_ids' holds {big}, outside the int64 range") from None


@dataclass
class _Part:
    """Samples and skip counts of consecutive records (one chunk, or the whole source)."""

    toks: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    examples: dict[str, list[str]] = field(default_factory=dict)
    """Reason -> the first NUM_LOGGED skips ("record i (file:line): why")."""
    num_source: int = 0
    truncated: int = 0

    def skip(self, reason: str, idx: int, where: str, why: str) -> None:
        self.skipped[reason] += 1
        first = self.examples.setdefault(reason, [])
        if len(first) < NUM_LOGGED:
            first.append(f"record {idx} ({where}): {why}")

    def extend(self, other: _Part) -> None:
        self.toks += other.toks
        self.masks += other.masks
        self.ids += other.ids
        for reason, n in other.skipped.items():
            self.skipped[reason] += n
        for reason, lines in other.examples.items():
            mine = self.examples.setdefault(reason, [])
            mine += lines[: NUM_LOGGED - len(mine)]
        self.num_source += other.num_source
        self.truncated += other.truncated


@dataclass
class _Pending:
    """A record on its way to the tokenizer: where it is, its rendered text and spans, and whether
    :func:`cap_messages` cut it (``cut_inside``: inside an assistant turn)."""

    idx: int
    where: str
    text: str = ""
    spans: list[Span] = field(default_factory=list)
    cut: bool = False
    cut_inside: bool = False


class _RecordTokenizer:
    """Tokenizes records with one tokenizer and one TokenizeSettings (also inside a worker)."""

    def __init__(self, tokenizer: Any, settings: TokenizeSettings, batch_size: int = 512) -> None:
        self.tokenizer, self.s, self.batch_size = tokenizer, settings, batch_size
        self.special = set(special_token_texts(tokenizer).values())

    def run(self, records: Iterable[tuple[int, str, Any]]) -> _Part:
        part = _Part()
        batch: list[_Pending] = []
        for idx, where, record in records:
            part.num_source += 1
            try:
                if isinstance(record, dict) and "input_ids" in record:
                    self._admit(part, _Pending(idx, where), *pretokenized(record))
                    continue
                if isinstance(record, BadRecord):
                    raise ValueError(record.reason)
                require_chat_template(self.tokenizer, where)
                conversation = parse_conversation(record)
                messages, cut, cut_inside = cap_messages(
                    conversation.messages, self.s.char_cap, self.s.overlong
                )
                text, spans = assistant_spans(
                    self.tokenizer,
                    messages,
                    tools=conversation.tools,
                    train_only_last_turn=self.s.train_only_last_turn,
                    **self.s.template_kwargs,
                )
            except MissingChatTemplate:
                raise
            except TooLong as exc:
                part.skip("too_long", idx, where, str(exc))
                continue
            except jinja2.TemplateError as exc:  # e.g. Llama 3.1's raise_exception on two tool calls
                part.skip("malformed", idx, where, f"the chat template cannot render it ({exc})")
                continue
            except (ValueError, TypeError) as exc:  # bad data, or a template failing on it
                part.skip("malformed", idx, where, f"{type(exc).__name__}: {exc}")
                continue
            batch.append(_Pending(idx, where, text, spans, cut, cut_inside))
            if len(batch) >= self.batch_size:
                self._flush(part, batch)
        self._flush(part, batch)
        return part

    def _flush(self, part: _Part, batch: list[_Pending]) -> None:
        if not batch:
            return
        encoded: list[tuple[list[int], list[tuple[int, int]]] | Exception]
        try:
            encoded = list(zip(*encode_with_offsets(self.tokenizer, [b.text for b in batch]), strict=True))
        except Exception:  # noqa: BLE001 - one bad text fails the whole batch: redo it record by record
            encoded = [self._encode_one(b.text) for b in batch]
        for rec, enc in zip(batch, encoded, strict=True):
            if isinstance(enc, Exception):
                why = f"the tokenizer rejects the text ({type(enc).__name__}: {enc})"
                part.skip("malformed", rec.idx, rec.where, why)
                continue
            ids = np.asarray(enc[0], dtype=np.int64)
            self._admit(part, rec, ids, mask_from_offsets(enc[1], ids, rec.spans, self.special, rec.text))
        batch.clear()

    def _encode_one(self, text: str) -> tuple[list[int], list[tuple[int, int]]] | Exception:
        try:
            (ids,), (offsets,) = encode_with_offsets(self.tokenizer, [text])
            return ids, offsets
        except Exception as exc:  # noqa: BLE001 - e.g. TypeError on a lone surrogate
            return exc

    def _admit(self, part: _Part, rec: _Pending, ids: np.ndarray, mask: np.ndarray) -> None:
        """Truncate or skip, check the vocabulary and the supervision, keep the sample."""
        s, idx, where = self.s, rec.idx, rec.where
        if rec.cut_inside and len(ids) <= s.max_length:
            # the cut assistant turn would end with an end-of-turn token the target never wrote there
            part.skip(
                "too_long",
                idx,
                where,
                f"its first data.max_record_chars={s.char_cap} characters make only {len(ids)} tokens "
                f"(<= data.max_length={s.max_length}); raise data.max_record_chars",
            )
            return
        truncated = rec.cut
        if len(ids) > s.max_length:
            if s.overlong == "skip":
                part.skip("too_long", idx, where, f"{len(ids)} tokens > data.max_length={s.max_length}")
                return
            ids, mask = ids[: s.max_length], mask[: s.max_length]
            truncated = True
        part.truncated += truncated
        if len(ids) and (ids.min() < 0 or ids.max() >= s.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= s.vocab_size)][0])
            part.skip("token_out_of_vocab", idx, where, f"token id {bad} outside [0, {s.vocab_size})")
            return
        if not (mask[1:] & mask[:-1]).any():
            part.skip("no_supervised_pair", idx, where, "no two consecutive supervised tokens")
            return
        part.toks.append(ids.astype(np.int32))
        part.masks.append(mask)
        part.ids.append(idx)


_WORKER: _RecordTokenizer | None = None


def _worker_init(tokenizer: Any, settings: TokenizeSettings) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _WORKER = _RecordTokenizer(tokenizer, settings)


def _worker_run(chunk: list[tuple[int, str, Any]]) -> _Part:
    assert _WORKER is not None
    return _WORKER.run(chunk)


def _chunks(records: Iterable[tuple[int, str, Any]], size: int) -> Iterator[list[tuple[int, str, Any]]]:
    it = iter(records)
    while chunk := list(islice(it, size)):
        yield chunk


def tokenize_records(
    records: Iterable[tuple[int, str, Any]],
    tokenizer: Any,
    settings: TokenizeSettings,
    *,
    num_workers: int = 1,
    chunk_size: int = 256,
    progress: Callable[[int], None] | None = None,
) -> TokenizedDataset:
    """Tokenize ``(source index, where, record)`` triples into a dataset, skipping and counting bad
    ones (``where``, e.g. ``file:line``, only goes into messages).

    ``num_workers > 1`` tokenizes chunks of ``chunk_size`` records in that many spawned processes;
    the result is identical to ``num_workers=1``. ``progress(n)`` is called after every n records.
    The first NUM_LOGGED skips of each reason are logged. The result has ``num_source = number of
    records`` and an empty fingerprint (set by the caller).
    """
    total = _Part()
    if num_workers <= 1:
        one = _RecordTokenizer(tokenizer, settings)
        for chunk in _chunks(records, chunk_size):
            total.extend(one.run(chunk))
            if progress:
                progress(len(chunk))
    else:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch/tokenizer threads
        with ctx.Pool(num_workers, initializer=_worker_init, initargs=(tokenizer, settings)) as pool:
            for part in pool.imap(_worker_run, _chunks(records, chunk_size)):
                total.extend(part)
                if progress:
                    progress(part.num_source)
    for reason, lines in total.examples.items():
        for line in lines:
            log.warning("skipped as %s: %s", reason, line)
        if total.skipped[reason] > len(lines):
            log.warning("skipped as %s: %d more not listed", reason, total.skipped[reason] - len(lines))
    lengths = np.array([len(t) for t in total.toks], dtype=np.int64)
    offsets = np.zeros(len(total.toks) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenizedDataset(
        tokens=torch.from_numpy(np.concatenate(total.toks) if total.toks else np.zeros(0, np.int32)),
        loss_mask=torch.from_numpy(np.concatenate(total.masks) if total.masks else np.zeros(0, np.uint8)),
        offsets=torch.from_numpy(offsets),
        sample_ids=torch.tensor(total.ids, dtype=torch.int64),
        skipped=total.skipped,
        num_source=total.num_source,
        fingerprint="",
        truncated=total.truncated,
        skip_examples={reason: lines[0] for reason, lines in total.examples.items()},
    )


def check_skip_fraction(ds: TokenizedDataset, max_skip_fraction: float) -> None:
    """Raise ValueError when nothing is left to train on, or when more than max_skip_fraction of
    the conversations were skipped; the message names the reasons, the first record of each and a
    fix that the config validation accepts."""
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
    if ds.skipped.get("malformed"):
        if "chat template" in ds.skip_examples.get("malformed", ""):
            fixes.append(
                "give the target's own chat template, one that renders tool calls (target.tokenizer)"
            )
        fixes.append('make each record {"messages": [{"role": ..., "content": ...}, ...]}')
    if len(ds) == 0:
        raise ValueError(
            f"no training sample left: all {ds.num_source} conversations were skipped ({counts or 'none'}); "
            f"{examples}. Fix: {', '.join(fixes)} (data.max_skip_fraction cannot help: there is nothing to train on)."
        )
    needed = math.ceil(frac * 1000) / 1000
    needed = min(1.0, needed + 0.001 if needed < frac else needed)  # frac rounded up to 3 decimals
    fixes.append(f"or set data.max_skip_fraction={needed:.3f} to accept this many skips")
    raise ValueError(
        f"data.max_skip_fraction={max_skip_fraction}: {ds.num_skipped} of {ds.num_source} conversations "
        f"({100 * frac:.1f}%) were skipped ({counts}), {len(ds)} left; {examples}. "
        f"Fix: {', '.join(fixes)}."
    )


def load_eval_samples(
    cfg: Any, tokenizer: Any, vocab_size: int, *, target_dir: str | os.PathLike | None = None
) -> TokenizedDataset:
    """The held-out tail tokenized exactly as training samples are (not cached: it is small).

    Eval decodes from each sample's prompt (the ids before its first supervised token) and
    estimates tau_hat on the whole sample, so both numbers come from the same conversations.
    ``target_dir`` is needed for ``data.path=embedded`` only (``prepare`` already replaces it by
    the corpus file in the run's config).
    """
    source = Source(resolve_source(cfg, target_dir), cfg.split)
    _, held_out = split_ranges(source.num_records, cfg.num_samples, cfg.num_eval_prompts)
    records = (r for r in source.numbered() if r[0] in held_out)
    return tokenize_records(records, tokenizer, TokenizeSettings.of(cfg, vocab_size))
