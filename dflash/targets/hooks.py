"""Forward hooks that capture decoder-layer outputs (the taps), always removed afterwards.

Tap l is the output of decoder layer l, i.e. ``output_hidden_states[l + 1]`` in HF numbering
(index 0 is the embedding output). For the last decoder layer the hook sees the residual stream
*before* the final norm, while HF's ``hidden_states[-1]`` is after it; DFlash taps never include
the last layers (they span [1, L-3]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from dflash.targets.loader import check_tap_ids, decoder_layers, tap_ids_fix


def layer_output(output) -> torch.Tensor:
    """The hidden states of a decoder layer's output: a Tensor (transformers 5) or a tuple (4.x),
    as a full local tensor (see :func:`full_tensor`)."""
    return full_tensor(output[0] if isinstance(output, (tuple, list)) else output)


def full_tensor(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` itself, or the full tensor of a DTensor. transformers' tensor-parallel plans hand
    back plain replicated tensors after every split block (``use_local_output``); a plan that left
    the residual stream sharded would be gathered here, so taps are full tensors on every rank."""
    return hidden.full_tensor() if hasattr(hidden, "full_tensor") else hidden


def check_layer_ids(model: nn.Module, layer_ids: list[int]) -> nn.ModuleList:
    layers = decoder_layers(model)
    check_tap_ids(
        list(layer_ids),
        len(layers),
        f"target.layer_ids={list(layer_ids)}",
        tap_ids_fix(list(layer_ids), len(layers)),
    )
    return layers


@contextmanager
def tap_hooks(
    model: nn.Module, layer_ids: list[int], fn: Callable[[int, torch.Tensor], None]
) -> Iterator[None]:
    """Call ``fn(position_in_layer_ids, hidden)`` after each tapped layer; hooks removed on exit."""
    layers = check_layer_ids(model, layer_ids)
    handles = []
    try:
        for pos, layer_id in enumerate(layer_ids):

            def hook(_module, _args, output, _pos=pos):
                fn(_pos, layer_output(output))

            handles.append(layers[int(layer_id)].register_forward_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def capture_hidden_states(model: nn.Module, layer_ids: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """``{layer_id: output of decoder layer layer_id}`` filled during forwards inside the block.

    The hooks are removed when the block exits, also on an exception.
    """
    captured: dict[int, torch.Tensor] = {}
    ids = [int(i) for i in layer_ids]

    def keep(pos: int, hidden: torch.Tensor) -> None:
        captured[ids[pos]] = hidden.detach()

    with tap_hooks(model, ids, keep):
        yield captured
