"""The target's cache during speculative decoding, and how the tokens of a rejected draft are undone.

Attention layers (full or sliding window) keep one entry per position, so a rejection crops them.
Linear-attention layers (the gated delta net of Qwen3.5/3.6 and other hybrid targets) keep a conv
state and a recurrent state that summarise every token seen, which no crop can take a token out of.
So before each verify forward ``mark`` clones those states (a few MB per layer, independent of the
context length), and ``rewind`` after a rejection crops the attention layers back to the mark,
restores the states and returns how many accepted tokens the caller must run through the target
again (the replay) to bring every layer to the same position. On a target without linear-attention
layers ``rewind`` only crops and nothing is replayed.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionCacheLayerMixin

LinearStates = list[
    tuple[list[torch.Tensor | None], list[torch.Tensor | None], list[bool], torch.Tensor | None]
]
"""Per linear-attention layer: conv states, recurrent states, has-previous flags, and the layer's own
token count where transformers keeps one (``cumulative_length_linear``, 5.25 on)."""


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def _token_count(layer: object) -> torch.Tensor | None:
    """The tokens a linear-attention cache layer has seen, where transformers counts them (5.25 on:
    ``get_seq_length`` of a hybrid cache reads it, so it must be restored with the states)."""
    count = getattr(layer, "cumulative_length_linear", None)
    return count if isinstance(count, torch.Tensor) else None


class TargetCache:
    """A DynamicCache for ``target`` (``.cache``, what the target's forward takes) with a rollback."""

    def __init__(self, target: nn.Module, *, rollback: bool) -> None:
        self.cache = DynamicCache(config=getattr(target, "config", None))
        combined = [
            type(layer).__name__
            for layer in self.cache.layers
            if isinstance(layer, LinearAttentionCacheLayerMixin) and isinstance(layer, DynamicLayer)
        ]
        if rollback and combined:
            raise ValueError(
                f"target {type(target).__name__}: cache layers {sorted(set(combined))} hold linear-attention and "
                "attention state in one layer, which cannot be rolled back here; evaluate with block_size=1"
            )
        self.linear = [
            layer for layer in self.cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)
        ]
        self.attention = [layer for layer in self.cache.layers if isinstance(layer, DynamicLayer)]
        if rollback:
            for layer in self.attention:  # sliding-window layers keep what a crop needs
                if hasattr(layer, "activate_past_recording"):
                    layer.activate_past_recording()
        self._mark: tuple[int, LinearStates] | None = None

    @property
    def has_linear_attention(self) -> bool:
        return bool(self.linear)

    def seq_length(self) -> int:
        """Positions held by the attention layers (transformers 5.25 answers ``get_seq_length()`` from
        layer 0, a linear-attention layer's own count on a hybrid target)."""
        if self.attention:
            return int(self.attention[0].get_seq_length())
        return int(self.cache.get_seq_length())

    def mark(self, length: int) -> None:
        """Remember the state at ``length`` positions, before a verify forward appends a block."""
        states: LinearStates = [
            (
                [_clone(layer.conv_states[i]) for i in range(layer.number_of_states)],
                [_clone(layer.recurrent_states[i]) for i in range(layer.number_of_states)],
                [layer.has_previous_state[i] for i in range(layer.number_of_states)],
                _clone(_token_count(layer)),
            )
            for layer in self.linear
        ]
        self._mark = (length, states)

    def _crop(self, length: int) -> None:
        for layer in self.attention:
            remove = layer.get_seq_length() - length
            if remove < 0:
                raise ValueError(f"cannot crop a cache of {layer.get_seq_length()} positions to {length}")
            if remove:
                layer.crop(-remove)

    def rewind(self, length: int) -> int:
        """Drop the positions >= ``length`` (all appended since the mark); returns the number of tokens
        from the mark on (positions mark..length-1) that the caller must run through the target again."""
        if not self.linear:
            self._crop(length)
            return 0
        if self._mark is None:
            raise RuntimeError("rewind without a mark: call mark(length) before the verify forward")
        start, states = self._mark
        if length < start:
            raise ValueError(f"cannot rewind to {length}: the mark is at {start}")
        self._crop(start)
        for layer, (conv, recurrent, has_previous, count) in zip(self.linear, states, strict=True):
            for i in range(layer.number_of_states):
                for live, saved in ((layer.conv_states, conv[i]), (layer.recurrent_states, recurrent[i])):
                    current = live[i]
                    if saved is None or current is None or current.shape != saved.shape:
                        live[i] = saved
                    else:
                        current.copy_(saved)  # in place: keeps the cache's static addresses
                layer.has_previous_state[i] = has_previous[i]
            live_count = _token_count(layer)
            if live_count is not None and count is not None:
                live_count.copy_(count)  # the position the next forward starts from
        return length - start
