"""Chat data on the default config (issue 43, item 5): the embedded corpus's ``data.max_length=256``
cut 195 of 213 real chats silently; now the dataset build (and its load from the cache) warns in one
line when more than 10% of the kept samples were cut, naming ``data.max_length`` and ``data=chat_jsonl``."""

from __future__ import annotations

import torch

from dflash.config import DataConfig
from dflash.data.cache import truncation_note
from dflash.data.tokenize import SKIP_REASONS, TokenizedDataset


def _dataset(n: int, truncated: int) -> TokenizedDataset:
    return TokenizedDataset(
        tokens=torch.zeros(4 * n, dtype=torch.int32),
        loss_mask=torch.ones(4 * n, dtype=torch.uint8),
        offsets=torch.arange(0, 4 * n + 1, 4, dtype=torch.int64),
        sample_ids=torch.arange(n),
        skipped=dict.fromkeys(SKIP_REASONS, 0),
        num_source=n,
        fingerprint="f",
        truncated=truncated,
    )


def test_more_than_a_tenth_truncated_is_one_line_naming_the_fix():
    cfg = DataConfig(path="/data/chat.jsonl", max_length=256)
    note = truncation_note(_dataset(213, 195), cfg)
    assert note is not None and "\n" not in note
    assert note.startswith("195 of 213 samples (92%) were cut to data.max_length=256 tokens")
    assert "data=chat_jsonl" in note and "data.max_length" in note
    assert truncation_note(_dataset(213, 21), cfg) is None  # 9.9%: quiet
    assert truncation_note(_dataset(213, 22), cfg) is not None
    assert truncation_note(_dataset(0, 0), cfg) is None
