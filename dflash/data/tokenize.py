"""Records -> a :class:`TokenizedDataset` (concatenated tokens + loss mask + offsets).

Bad input is skipped and counted, never raised, and the result is deterministic:
``malformed`` (bad JSON, not an object, no/empty messages, bad role or content, a template that
does not render an assistant content), ``too_long`` (``overlong=skip`` only), ``token_out_of_vocab``,
``no_supervised_pair`` (no two consecutive loss-mask-1 tokens after truncation). Truncated samples
are kept and counted separately. Too many skips abort (:func:`check_skip_fraction`,
``data.max_skip_fraction``).

Also here: :func:`load_eval_samples`, the held-out eval tail tokenized exactly as training samples
are (not cached; the cached training set is built by ``dflash.data.cache``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jinja2
import numpy as np
import torch

from dflash.data.chat import assistant_spans, encode_with_offsets, mask_from_offsets, special_token_texts
from dflash.data.sources import Source, parse_messages, resolve_source, split_ranges

SKIP_REASONS = ("malformed", "too_long", "no_supervised_pair", "token_out_of_vocab")


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
    records = ((i, r) for i, r in enumerate(source.records()) if i in held_out)
    return tokenize_records(
        records,
        tokenizer,
        vocab_size=vocab_size,
        max_length=cfg.max_length,
        overlong=cfg.overlong,
        train_only_last_turn=cfg.train_only_last_turn,
    )
