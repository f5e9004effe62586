"""The target's attention masks, made from the document lengths the host already knows.

transformers prepares the mask of every forward from the tensors it is given, and reads them on the
host to do it: the position ids (``find_packed_sequence_indices``: are there several documents in a
row?) and the padding mask (``_ignore_causal_mask_sdpa``, flex's ``fast_all``, the linear-attention
layers' all-ones test). On a GPU each read waits for the device. The target ranks lay the batch out
themselves (``dflash.targets.forward.build_batch``), so they know the answers, and
``document_inputs`` hands transformers masks it uses as given (one per layer type where the config
lists them: ``layer_types``), made with transformers' own mask primitives:

- a packed row of several documents (position ids restarting at 0 per document): causal within
  each document (and within the window on a sliding layer). ``flex_attention`` gets a ``BlockMask``
  (only the tiles inside documents are computed; built by a compiled kernel on CUDA, eagerly
  elsewhere), ``sdpa`` / ``eager`` a [1, 1, T, T] bool / additive mask (every pair computed),
  ``flash_attention_*`` no mask but the documents' boundaries (``cu_seq_lens_*``, ``max_length_*``:
  flash-attn's varlen kernel). Linear-attention layers get the boundaries and the lengths, which
  their kernels restart at (``dflash.targets.linear_attention``, installed by the loader).
- one document per row (right-padded rows, or a packed row of one document): causal only, the
  padding mask dropped. Every layer of a causal LM is causal (attention, sliding windows, linear
  attention and its convolution), so a real token never sees the padding after it: the padding mask
  changes only the padded positions' outputs, which are dropped. SDPA runs ``is_causal`` (its fused
  kernels skip the masked half), flash-attn its plain causal kernel, flex a causal ``BlockMask``.

A model with one mask for every layer (no ``layer_types``: Llama, Qwen3-MoE) has no prepared form
of "no mask": under SDPA with one document per row, and under flash-attn, transformers still looks
at the position ids once per forward. Anything else (a layer type or implementation not named here,
a single-mask model with a sliding window) returns None:
transformers then prepares the mask itself from ``attention_mask`` / ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from dflash.targets.linear_attention import doc_lengths_inputs
from dflash.targets.packing import doc_ids_from_positions

MaskFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""A transformers / flex ``mask_mod``: (batch, head, query, key) indices -> attend."""

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
MASKED_KERNELS = ("sdpa", "eager", "flex_attention")
"""Implementations that get a prepared mask on a packed row; ``flash_attention_*`` get the documents'
boundaries."""


def document_inputs(
    config: Any,
    seq_lens: Sequence[int],
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor,
    dtype: torch.dtype,
) -> dict[str, Any] | None:
    """The ``attention_mask`` / ``position_ids`` (and flash-attn) keyword arguments of the base
    model's forward for a batch laid out by ``build_batch``, or None when transformers must prepare
    the mask itself (see the module docstring).

    ``seq_lens``: the documents' lengths (host ints) in batch order. ``input_ids`` [1, T] with
    ``attention_mask`` None (a packed row, ``sum(seq_lens) == T``) or [S, Lmax] with the [S, Lmax]
    padding mask (``S == len(seq_lens)``, ``Lmax == max(seq_lens)``, right padding); ``position_ids``
    [B, L] on the device; ``dtype``: the model's (an eager mask is additive in it). Nothing here reads
    a device tensor on the host.
    """
    from transformers.masking_utils import packed_sequence_mask_function, sliding_window_causal_mask_function

    lens = [int(n) for n in seq_lens]
    batch, length = int(input_ids.shape[0]), int(input_ids.shape[1])
    packed = attention_mask is None
    if packed and (batch != 1 or sum(lens) != length):
        raise ValueError(f"packed row {tuple(input_ids.shape)} does not hold documents of lengths {lens}")
    if not packed and (batch != len(lens) or max(lens) != length):
        raise ValueError(f"padded rows {tuple(input_ids.shape)} do not hold documents of lengths {lens}")
    impl = str(getattr(config, "_attn_implementation", None))
    flash = impl.startswith("flash_attention")
    layer_types = getattr(config, "layer_types", None)
    types = list(dict.fromkeys(layer_types)) if layer_types else [FULL]
    window = getattr(config, "sliding_window", None)
    several = packed and len(lens) > 1
    if (
        not (flash or impl in MASKED_KERNELS)
        or any(t not in (FULL, SLIDING, LINEAR) for t in types)
        or (SLIDING in types and window is None)
        or (not layer_types and window is not None)  # such a model picks its sliding mask itself
    ):
        return None
    out: dict[str, Any] = {"position_ids": position_ids}
    if (flash or LINEAR in types) and several:
        out.update(_varlen_boundaries(lens, position_ids.device))
    if LINEAR in types and several:  # the linear-attention kernels restart at each document
        out.update(doc_lengths_inputs(lens))
    same_doc = packed_sequence_mask_function(doc_ids_from_positions(position_ids)) if several else None
    masks: dict[str, Any] = {}
    for kind in types:
        if kind == LINEAR or flash or (impl == "sdpa" and not several):
            masks[kind] = None  # linear layers, flash-attn and SDPA's is_causal need no mask here
        else:
            pattern = sliding_window_causal_mask_function(window) if kind == SLIDING and window else None
            masks[kind] = _kernel_mask(impl, pattern, same_doc, length, position_ids.device, dtype)
    out["attention_mask"] = masks if layer_types else masks[FULL]
    return out


def _kernel_mask(
    impl: str,
    pattern: MaskFn | None,
    same_doc: MaskFn | None,
    length: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Any:
    """The mask ``impl`` takes over rows of ``length`` tokens, one for every row: ``pattern`` (None:
    causal), within each document when ``same_doc`` is given (a packed row); a ``BlockMask`` (flex),
    or a bool (sdpa) / additive (eager) [1, 1, L, L] tensor."""
    from transformers.masking_utils import and_masks, causal_mask_function, eager_mask, sdpa_mask

    base: Any = pattern or causal_mask_function
    fn: MaskFn = base if same_doc is None else and_masks(base, same_doc)
    if impl == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        # compiled on CUDA (no [T, T] tensor), eager elsewhere
        return create_block_mask(fn, 1, None, length, length, device=device, _compile=device.type == "cuda")
    shape: dict[str, Any] = dict(
        batch_size=1, q_length=length, kv_length=length, mask_function=fn, device=device
    )
    if impl == "eager":
        return eager_mask(**shape, dtype=dtype)
    return sdpa_mask(**shape, allow_is_causal_skip=False)


def _varlen_boundaries(lens: list[int], device: torch.device) -> dict[str, Any]:
    """flash-attn's varlen arguments of a packed row: cumulative lengths [S + 1] (int32, copied without
    waiting) and the longest document (a host int, so transformers does not read it back)."""
    bounds = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu = bounds.to(device, non_blocking=True)
    longest = max(lens)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
