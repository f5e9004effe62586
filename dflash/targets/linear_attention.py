"""Packed rows through linear-attention layers (Gated DeltaNet: Qwen3.5/3.6, Qwen3-Next) with no
document's state leaking into the next.

A Gated DeltaNet layer runs a causal depthwise convolution over the sequence and then the delta rule,
whose recurrent state summarises every token before. On a packed row both must restart at every
document. transformers hands the documents' boundaries (``cu_seq_lens_q``) to its kernels:
flash-linear-attention's delta rule (CUDA) keeps documents apart with them, but its torch fallback
(CPU, or no ``flash-linear-attention``) and every convolution path (the torch one and the
``causal-conv1d`` kernel, which transformers calls without ``seq_idx``) run straight across them.

:func:`install_varlen` replaces the two functions of the model's modeling module with ones that keep
documents apart whatever kernel runs underneath (the lengths come as host ints in
:data:`DOC_LENGTHS_KWARG`, so nothing is read back from the device):

- the convolution runs once over the documents laid out with ``kernel - 1`` zero columns between
  them (exactly the zero history each document has alone);
- the delta rule goes to flash-linear-attention with the boundaries where it runs (CUDA), else runs
  the torch fallback on each document in turn.

A row with one document, or a call without lengths (decoding with a cache), goes to the original
functions unchanged. :func:`whole_row_delta_rule` (the memory rehearsal) runs the torch delta rule once
over the whole row, as the CUDA kernel runs: the same call shape, so the same working set (its state
then crosses documents: memory only, never training).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

DOC_LENGTHS_KWARG = "dflash_doc_lengths"
"""The forward keyword carrying the packed row's document lengths (host ints) to the kernels."""
PATCHED = "__dflash_varlen__"
FAST_DELTA_DEVICES = ("cuda", "xpu", "mlu", "npu")
"""Where flash-linear-attention's delta rule runs (transformers' own table)."""
_WHOLE_ROW = contextvars.ContextVar("dflash_whole_row_delta_rule", default=False)


@contextlib.contextmanager
def whole_row_delta_rule() -> Iterator[None]:
    """Inside: the torch delta rule runs once over a packed row instead of once per document (the
    working set of the one varlen kernel call CUDA makes; the states cross documents, so only the
    memory rehearsal uses it)."""
    token = _WHOLE_ROW.set(True)
    try:
        yield
    finally:
        _WHOLE_ROW.reset(token)


def has_linear_attention(model: nn.Module) -> bool:
    return any(type(m).__name__.endswith("GatedDeltaNet") for m in model.modules())


def fast_delta_rule(device: torch.device) -> bool:
    """flash-linear-attention's varlen delta rule runs on ``device``."""
    return device.type in FAST_DELTA_DEVICES and importlib.util.find_spec("fla") is not None


def _lengths(kwargs: dict[str, Any]) -> list[int] | None:
    lengths = kwargs.get(DOC_LENGTHS_KWARG)
    return [int(n) for n in lengths] if lengths is not None and len(lengths) > 1 else None


def _strip(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments without the documents' boundaries (what a kernel of one document takes)."""
    drop = {DOC_LENGTHS_KWARG, "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens"}
    return {k: v for k, v in kwargs.items() if k not in drop}


@functools.lru_cache(maxsize=8)
def _spread_columns(lengths: tuple[int, ...], gap: int) -> list[int]:
    """Where each token of the packed row goes when ``gap`` zero columns separate the documents
    (host ints: no data-dependent device op, so fake tensors take it too; one list per packet)."""
    out: list[int] = []
    start = 0
    for i, n in enumerate(lengths):
        out.extend(range(start + i * gap, start + i * gap + n))
        start += n
    return out


def _varlen_conv(inner: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def causal_conv1d_fn(
        hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None, **kwargs: Any
    ) -> Tensor:
        """``inner`` over ``[1, C, T]`` with ``kernel - 1`` zero columns between the documents."""
        lengths = _lengths(kwargs)
        if lengths is None or hidden_states.shape[0] != 1:
            return inner(hidden_states, weight, bias, **kwargs)
        gap = weight.shape[-1] - 1
        where = torch.tensor(_spread_columns(tuple(lengths), gap)).to(hidden_states.device, non_blocking=True)
        spread = hidden_states.new_zeros(1, hidden_states.shape[1], sum(lengths) + gap * (len(lengths) - 1))
        spread.index_copy_(2, where, hidden_states)
        out = inner(spread, weight, bias, **_strip(kwargs))
        return out.index_select(2, where)

    setattr(causal_conv1d_fn, PATCHED, inner)
    return causal_conv1d_fn


def _varlen_delta(inner: Callable[..., Any]) -> Callable[..., Any]:
    def chunk_gated_delta_rule(
        query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        """``inner`` with the boundaries where flash-linear-attention runs, else one document at a
        time (each from a zero state); ``[1, T, heads, dim]`` inputs split along T."""
        lengths = _lengths(kwargs)
        if lengths is None or query.shape[0] != 1:
            return inner(query, key, value, g, beta, *args, **_strip(kwargs) | _boundaries(kwargs))
        if fast_delta_rule(query.device):
            return inner(query, key, value, g, beta, *args, **_strip(kwargs) | _boundaries(kwargs))
        if _WHOLE_ROW.get():
            return inner(query, key, value, g, beta, *args, **_strip(kwargs))
        outs, states = [], []
        pieces = [t.split(lengths, dim=1) for t in (query, key, value, g, beta)]
        for q, k, v, gg, b in zip(*pieces, strict=True):
            out, state = inner(q, k, v, gg, b, *args, **_strip(kwargs))
            outs.append(out)
            states.append(state)
        final = torch.cat(states) if all(s is not None for s in states) else None
        return torch.cat(outs, dim=1), final

    setattr(chunk_gated_delta_rule, PATCHED, inner)
    return chunk_gated_delta_rule


def _boundaries(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``cu_seqlens`` the layer popped from ``cu_seq_lens_q`` (when the caller passed them)."""
    return {"cu_seqlens": kwargs["cu_seqlens"]} if kwargs.get("cu_seqlens") is not None else {}


def install_varlen(model: nn.Module) -> str | None:
    """Make every Gated DeltaNet layer of ``model`` keep packed documents apart (module docstring);
    idempotent. Returns which delta-rule kernel packed rows run on the model's device, or None when
    the model has no linear-attention layer."""
    modules = {type(m).__module__ for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")}
    if not modules:
        return None
    for name in sorted(modules):
        modeling = sys.modules[name]
        for attr, wrap in (
            ("causal_conv1d_fn", _varlen_conv),
            ("torch_chunk_gated_delta_rule", _varlen_delta),
        ):
            current = getattr(modeling, attr, None)
            if current is None:
                raise ValueError(
                    f"{name} has no {attr}: dflash cannot keep packed documents apart in its linear-attention "
                    "layers; set target.pack=false (one document per row)"
                )
            if not hasattr(current, PATCHED):
                setattr(modeling, attr, wrap(current))
    device = next(model.parameters()).device
    if fast_delta_rule(device):
        return "flash-linear-attention delta rule (varlen), convolution with zero gaps between documents"
    return "torch delta rule one document at a time, convolution with zero gaps between documents"


def doc_lengths_inputs(lengths: Sequence[int]) -> dict[str, Any]:
    """The forward keyword that carries a packed row's document lengths to the patched kernels."""
    return {DOC_LENGTHS_KWARG: [int(n) for n in lengths]}
