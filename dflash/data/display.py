"""What a tokenized dataset holds, for people: statistics, and samples with the loss mask marked."""

from __future__ import annotations

from typing import Any

import torch

from dflash.data.tokenize import TokenizedDataset

OPEN, CLOSE = "\u27e6", "\u27e7"
"""Brackets around supervised text when colour is off (rare in real data, unlike ``[`` ``]``)."""
_GREEN, _RESET = "\x1b[30;42m", "\x1b[0m"


def length_histogram(lengths: torch.Tensor, max_length: int, bins: int = 8, width: int = 40) -> list[str]:
    """Text bars of the sample lengths in ``bins`` equal bins over ``[1, max_length]``."""
    step = max(1, -(-max_length // bins))
    counts = torch.bincount(((lengths.clamp(min=1) - 1) // step).clamp(max=bins - 1), minlength=bins).tolist()
    top = max(max(counts), 1)
    return [
        f"  {k * step + 1:>7}-{min((k + 1) * step, max_length):<7} {'#' * round(width * c / top):<{width}} {c}"
        for k, c in enumerate(counts)
    ]


def dataset_summary(ds: TokenizedDataset, max_length: int) -> str:
    """Samples, tokens, supervised fraction, the length histogram, skips by reason, truncation."""
    lengths = ds.lengths()
    n, tokens = len(ds), int(ds.tokens.numel())
    supervised = int(ds.loss_mask.sum())
    lines = [
        f"conversations  {ds.num_source}",
        f"samples        {n}",
        f"tokens         {tokens} (supervised {supervised}, {100 * supervised / max(tokens, 1):.1f}%)",
    ]
    if n:
        sorted_lengths = lengths.sort().values
        lines.append(
            f"length         mean {lengths.float().mean():.1f}, median {int(sorted_lengths[n // 2])}, "
            f"min {int(sorted_lengths[0])}, max {int(sorted_lengths[-1])} (data.max_length={max_length})"
        )
        lines.append("length histogram (tokens: samples)")
        lines += length_histogram(lengths, max_length)
    skipped = ", ".join(f"{r} {c}" for r, c in ds.skipped.items()) or "none"
    lines.append(f"skipped        {ds.num_skipped} ({skipped})")
    for reason, example in ds.skip_examples.items():
        lines.append(f"  first {reason}: {example}")
    lines.append(f"truncated      {ds.truncated} (kept, cut to data.max_length or data.max_record_chars)")
    return "\n".join(lines)


def marked_runs(ids: torch.Tensor, mask: torch.Tensor, tokenizer: Any) -> list[tuple[str, bool]]:
    """The sample as ``(text, supervised)`` runs: consecutive tokens with the same mask value
    decoded together (special tokens kept), so a run's text is exactly those tokens."""
    runs: list[tuple[str, bool]] = []
    values = mask.tolist()
    start = 0
    for t in range(1, len(values) + 1):
        if t == len(values) or values[t] != values[start]:
            runs.append(
                (tokenizer.decode(ids[start:t].tolist(), skip_special_tokens=False), bool(values[start]))
            )
            start = t
    return runs


def show_samples(ds: TokenizedDataset, tokenizer: Any, count: int, *, color: bool) -> str:
    """The first ``count`` samples with the supervised text marked: green on a terminal
    (``color``), else between OPEN and CLOSE."""
    out: list[str] = []
    for k in range(min(count, len(ds))):
        ids, mask = ds.sample(k)
        out.append(
            f"--- sample {k} (record {int(ds.sample_ids[k])}): {len(ids)} tokens, {int(mask.sum())} supervised ---"
        )
        text = "".join(
            (f"{_GREEN}{t}{_RESET}" if color else f"{OPEN}{t}{CLOSE}") if sup else t
            for t, sup in marked_runs(ids, mask, tokenizer)
        )
        out.append(text)
    return "\n".join(out)
