"""The layout of a packed row: its RoPE positions and document ids, from the documents' lengths.

A packet holds several documents in one row; every position restarts at 0 where a document starts,
so the position ids alone say which document a token belongs to. Used by the target's attention
masks (``dflash.targets.attention``), the drafter's blocks and the drafter step.
"""

from __future__ import annotations

import torch


def packet_positions(seq_lens: torch.Tensor, total: int) -> torch.Tensor:
    """[S] sequence lengths summing to ``total`` (T) -> [T] RoPE positions restarting at 0 for
    every packed sequence (T from the header: no host sync on a device tensor)."""
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    return torch.arange(total, device=seq_lens.device) - torch.repeat_interleave(
        starts, seq_lens, output_size=total
    )


def doc_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] position ids restarting at 0 per document -> [B, S] document index (0, 1, ...)."""
    return torch.cumsum((position_ids == 0).long(), dim=1) - 1
