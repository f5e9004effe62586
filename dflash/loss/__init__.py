"""Losses of the drafter."""

from dflash.loss.verifier import (
    VerifierLossOutput,
    VerifierLossStats,
    default_chunk_size,
    verifier_loss,
)
from dflash.loss.workspace import release_workspace

__all__ = [
    "VerifierLossOutput",
    "VerifierLossStats",
    "default_chunk_size",
    "release_workspace",
    "verifier_loss",
]
