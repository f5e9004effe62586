"""Headless target forward: base model + tap hooks, never the lm_head.

``model(...)`` on a transformers 5 ``*ForCausalLM`` always projects every position through the
lm_head (``[tokens, vocab]`` logits that nobody reads: 30 GB for 65K tokens x 248K vocab in bf16).
The target only needs the tapped layers and the final (post-norm) hidden state, so it calls the
base model (``model.model``) under ``torch.inference_mode()`` and collects the taps with forward
hooks that copy straight into one preallocated ``[B, T, n_tap*H]`` buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dflash.targets.attention import document_inputs
from dflash.targets.hooks import full_tensor, tap_hooks
from dflash.targets.loader import base_model


def target_forward(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    layer_ids: list[int],
    position_ids: Tensor | None = None,
    seq_lens: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(aux_hidden [B, T, n_tap*H], final_hidden [B, T, H])`` of the target.

    Tap i (``layer_ids[i]``) fills ``aux[..., i*H:(i+1)*H]`` with the output of that decoder layer
    (= ``hidden_states[l+1]``); ``final_hidden`` is the base model's ``last_hidden_state`` (after the
    final norm). Runs ``base_model(model)(..., use_cache=False)``; the lm_head never runs. With a
    tensor-parallel target (``dflash.targets.tp``) every rank of the replica calls it on the same
    batch and gets the same full tensors.

    ``seq_lens``: the documents' lengths (host ints) of a batch laid out by ``build_batch``, with its
    ``position_ids``: the attention masks are then made from them (``dflash.targets.attention``) and
    transformers reads neither the position ids nor the padding mask on the host. Without them
    transformers prepares the masks from ``attention_mask`` / ``position_ids`` itself.
    """
    ids = [int(i) for i in layer_ids]
    n = len(ids)
    state: dict[str, Tensor] = {}

    def write(pos: int, hidden: Tensor) -> None:
        aux = state.get("aux")
        if aux is None:
            b, t, h = hidden.shape
            aux = state["aux"] = torch.empty(b, t, n * h, dtype=hidden.dtype, device=hidden.device)
        h = hidden.shape[-1]
        aux[..., pos * h : (pos + 1) * h].copy_(hidden)

    base = base_model(model)
    inputs: dict = {"attention_mask": attention_mask, "position_ids": position_ids}
    if seq_lens is not None and position_ids is not None:
        dtype = next(base.parameters()).dtype
        prepared = document_inputs(base.config, seq_lens, input_ids, attention_mask, position_ids, dtype)
        inputs = prepared if prepared is not None else inputs
    with tap_hooks(model, ids, write), torch.inference_mode():
        out = base(input_ids=input_ids, use_cache=False, **inputs)
    final = full_tensor(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])
    if "aux" not in state:
        raise RuntimeError(f"target forward ran but no tap hook fired (layer_ids={ids})")
    return state["aux"], final


def build_batch(
    seqs: list[Tensor], *, pack: bool, pad_id: int
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Lay out sequences for one target forward: ``(input_ids, attention_mask, position_ids, keep)``.

    - ``pack=True``: one row ``[1, T]`` (T = total tokens), position ids restarting at 0 per
      sequence, ``attention_mask=None``: each restart is a new document (``target_forward`` with
      ``seq_lens`` masks them apart; transformers alone finds them from the position ids).
    - ``pack=False``: right-padded rows ``[S, Lmax]`` with an attention mask (Qwen3.5/3.6: their
      linear-attention state would leak across packed documents).

    ``keep`` [T] indexes the flattened ``[B*L]`` token axis so that ``x.flatten(0, 1)[keep]`` gives
    the real tokens of all sequences, in order, padding removed (see ``gather_tokens``).
    """
    if not seqs:
        raise ValueError("build_batch: no sequences")
    lens = [int(s.numel()) for s in seqs]
    if min(lens) < 1:
        raise ValueError(f"build_batch: empty sequence (lengths {lens})")
    seqs = [s.reshape(-1).to(torch.long) for s in seqs]
    device = seqs[0].device
    if pack:
        input_ids = torch.cat(seqs).unsqueeze(0)
        position_ids = torch.cat([torch.arange(n, device=device) for n in lens]).unsqueeze(0)
        keep = torch.arange(input_ids.shape[1], device=device)
        return input_ids, None, position_ids, keep
    s, lmax = len(seqs), max(lens)
    input_ids = torch.full((s, lmax), int(pad_id), dtype=torch.long, device=device)
    attention_mask = torch.zeros((s, lmax), dtype=torch.long, device=device)
    for i, seq in enumerate(seqs):
        input_ids[i, : lens[i]] = seq
        attention_mask[i, : lens[i]] = 1
    position_ids = torch.arange(lmax, device=device).unsqueeze(0).expand(s, lmax).contiguous()
    keep = torch.cat([i * lmax + torch.arange(n, device=device) for i, n in enumerate(lens)])
    return input_ids, attention_mask, position_ids, keep


def gather_tokens(x: Tensor, keep: Tensor) -> Tensor:
    """``[B, L, ...]`` -> ``[T, ...]``: the real tokens selected by ``build_batch``'s ``keep``."""
    return x.flatten(0, 1).index_select(0, keep)
