"""Greedy DFlash speculative decoding (batch 1), the loop training must reproduce (spec §1.9).

One generation::

    prefill   target(prompt[0:P]) with a fresh DynamicCache, taps captured -> x_P = argmax(last logits)
              drafter context = taps of positions 0..P-1 (nothing in the drafter's KVCache yet)
    step      (anchor t = position of the newest token x_t; the target cache holds positions < t)
      draft   drafter(noise = embed([x_t, MASK x (B-1)]) at positions t..t+B-1,
                      new context = taps of the positions not yet in the drafter cache, at their
                      positions, + its KVCache)  ->  d_1..d_{B-1} = argmax(lm_head(hidden[1:]))
              the drafter KVCache grows by the new context rows only (never the block rows), so after
              the call it holds exactly positions 0..t-1
      verify  target([x_t, d_1..d_{B-1}]) at positions t..t+B-1 with its cache, taps captured
              -> y_0..y_{B-1}; k = longest prefix with d_j == y_{j-1}
      accept  output += d_1..d_k, y_k; tau_step = k + 1; crop the target cache to t + k + 1
              (drops the rejected drafts); next context = taps of block rows 0..k (positions t..t+k);
              next anchor t + k + 1 with x = y_k
    stop      after an eos (kept) or max_new_tokens new tokens (output cut to exactly that many)

``block_size == 1`` (or no drafter) is plain greedy decoding with the same machinery: one target
forward per token, no taps. The target's own lm_head verifies (eval is the one place it runs).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash.drafter.model import DFlashDraftModel
from dflash.targets.hooks import capture_hidden_states


@dataclass
class StepTrace:
    """What one decode step did (for tests and debugging; passed to ``on_step``)."""

    anchor: int
    """Position t of the block's slot 0 (the newest verified token x_t)."""
    block: list[int]
    """``[x_t, d_1..d_{B-1}]`` as verified (just ``[x_t]`` for block size 1)."""
    predictions: list[int]
    """Target greedy predictions y_0..y_{B-1} at the block positions."""
    accepted: int
    """k: draft tokens accepted (tau_step = k + 1)."""
    context_fed: int
    """Context rows given to the drafter in this step (0 without a drafter)."""
    drafter_cache_len: int
    """Drafter KVCache length after its call (== anchor); 0 without a drafter."""
    target_cache_len: int
    """Target cache length after cropping (== anchor + k + 1)."""


@dataclass
class GenerationResult:
    output_ids: list[int]
    """New tokens only (eos included when hit), at most max_new_tokens."""
    accept_lengths: list[int] = field(default_factory=list)
    """tau_step = accepted + 1 of every decode step (each in 1..block_size); the last step's value
    is recorded before the output is cut at an eos or max_new_tokens (as z-lab's benchmark)."""
    num_target_forwards: int = 0
    """Target forwards, the prefill included."""
    num_drafter_forwards: int = 0
    prompt_len: int = 0
    block_size: int = 1
    stopped_on_eos: bool = False
    prefill_time_s: float = 0.0
    """Target prefill (time to first token)."""
    wall_time_s: float = 0.0
    """The whole generation, prefill included."""

    @property
    def num_steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def decode_time_s(self) -> float:
        return self.wall_time_s - self.prefill_time_s

    @property
    def tpot_s(self) -> float:
        """Time per output token: decode time (everything after the prefill, the drafter's first
        context pass included) / number of new tokens (the prefill's token included, as z-lab's
        benchmark); nan without a decode step (the first token was an eos, or max_new_tokens == 1)."""
        return self.decode_time_s / len(self.output_ids) if self.accept_lengths else float("nan")

    @property
    def tau(self) -> float:
        """Mean accepted + 1 over the decode steps; nan when there was no decode step."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else float("nan")


def accepted_prefix(block: torch.Tensor, predictions: torch.Tensor) -> int:
    """k = length of the longest prefix with ``block[j] == predictions[j-1]`` for j = 1..B-1.

    block [B] = ``[x_t, d_1..d_{B-1}]``; predictions [B] = the target's greedy tokens y_0..y_{B-1}
    at the block positions (y_{j-1} is what the target says follows d_{j-1}, i.e. the true token j).
    """
    if block.shape != predictions.shape or block.dim() != 1:
        raise ValueError(
            f"block {tuple(block.shape)} and predictions {tuple(predictions.shape)} must be equal 1-D shapes"
        )
    if block.numel() <= 1:
        return 0
    match = (block[1:] == predictions[:-1]).to(torch.int64)
    return int(match.cumprod(0).sum().item())


def _cache_kwarg(model: nn.Module) -> str:
    """transformers >= 5.x calls the cache ``cache`` (``past_key_values`` deprecated); older ones not."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def new_target_cache(target: nn.Module, rollback: bool):
    """A DynamicCache for ``target``; with ``rollback`` it must be croppable (speculative decoding)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=target.config)
    except TypeError:  # older transformers: no config argument
        cache = DynamicCache()
    if rollback:
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()  # sliding-window layers keep what a crop needs
        if not getattr(cache, "is_croppable", True):
            raise ValueError(
                f"target {type(target).__name__}: its cache has layers that cannot be rolled back "
                "(linear attention / recurrent state), so rejected drafts cannot be undone; "
                "evaluate with block_size=1 or a full-attention target"
            )
    return cache


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of a DynamicCache (crop(-n) removes the last n tokens in
    every transformers version; a positive argument means different things across versions)."""
    remove = cache.get_seq_length() - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if remove:
        cache.crop(-remove)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    drafter: DFlashDraftModel | None,
    embed_weight: torch.Tensor | None,
    lm_head_weight: torch.Tensor | None,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    eos_token_ids: set[int],
    layer_ids: list[int],
    block_size: int,
    on_step: Callable[[StepTrace], None] | None = None,
) -> GenerationResult:
    """Greedy generation of at most ``max_new_tokens`` new tokens; with a drafter and
    ``block_size > 1`` DFlash speculative decoding, else plain autoregressive decoding.

    target: a ``*ForCausalLM`` (its lm_head verifies). drafter: a DFlashDraftModel whose
    ``target_layer_ids`` are ``layer_ids``. embed_weight / lm_head_weight [V, H]: the target's
    embedding (noise tokens) and lm_head (draft logits), moved to the drafter's device and dtype here
    (a no-op when they are already there). The output is identical to greedy autoregressive decoding
    up to floating-point differences between the block and single-token target forwards.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if not prompt_ids:
        raise ValueError("empty prompt: need at least one prompt token")
    speculative = drafter is not None and block_size > 1
    device = next(target.parameters()).device
    eos = {int(e) for e in eos_token_ids}
    if speculative:
        if embed_weight is None or lm_head_weight is None:
            raise ValueError("speculative decoding needs the target's embed_weight and lm_head_weight")
        if list(drafter.arch.target_layer_ids) != [int(i) for i in layer_ids]:
            raise ValueError(
                f"layer_ids={list(layer_ids)} differ from the drafter's target_layer_ids="
                f"{list(drafter.arch.target_layer_ids)}; pass the drafter's tap ids"
            )
        d_param = next(drafter.parameters())
        d_dev, d_dtype = d_param.device, d_param.dtype
        embed = embed_weight.to(d_dev, d_dtype)
        head = lm_head_weight.to(d_dev, d_dtype)
        mask_id = int(drafter.arch.mask_token_id)
        if not 0 <= mask_id < embed.shape[0]:
            raise ValueError(
                f"drafter mask_token_id={mask_id} is outside the embedding's {embed.shape[0]} rows"
            )
        d_cache = drafter.new_cache()
    else:
        block_size = 1
    cache_kw = _cache_kwarg(target)
    P = len(prompt_ids)
    res = GenerationResult(output_ids=[], prompt_len=P, block_size=block_size)

    def taps_of(captured: dict[int, torch.Tensor], rows: int | None = None) -> torch.Tensor:
        feats = torch.cat([captured[int(i)] for i in layer_ids], dim=-1)  # [1, L, n_tap*H]
        return feats if rows is None else feats[:, :rows]

    capture = capture_hidden_states(target, layer_ids) if speculative else nullcontext({})
    t_cache = new_target_cache(target, rollback=speculative)
    _sync(device)
    t0 = time.perf_counter()
    with capture as captured:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        out = target(
            input_ids=ids,
            position_ids=torch.arange(P, device=device).unsqueeze(0),
            use_cache=True,
            logits_to_keep=1,
            **{cache_kw: t_cache},
        )
        res.num_target_forwards += 1
        x = int(out.logits[0, -1].argmax().item())
        _sync(device)
        res.prefill_time_s = time.perf_counter() - t0
        new_ctx = taps_of(captured) if speculative else None  # positions 0..P-1
        res.output_ids.append(x)
        t = P  # position of x (the target cache holds positions < t)
        done = x in eos or len(res.output_ids) >= max_new_tokens
        res.stopped_on_eos = x in eos
        while not done:
            context_fed = 0
            if speculative:
                c0 = d_cache.length
                context_fed = new_ctx.shape[1]
                block_ids = torch.full((1, block_size), mask_id, dtype=torch.long, device=d_dev)
                block_ids[0, 0] = x
                hidden = drafter(
                    embed[block_ids],
                    new_ctx.to(d_dev),
                    torch.arange(c0, c0 + context_fed, device=d_dev).unsqueeze(0),
                    torch.arange(t, t + block_size, device=d_dev).unsqueeze(0),
                    None,
                    d_cache,
                )
                res.num_drafter_forwards += 1
                drafts = (hidden[0, 1:] @ head.T).argmax(-1)
                block = torch.cat([torch.tensor([x], device=device), drafts.to(device)])
            else:
                block = torch.tensor([x], device=device)
            B = block.numel()
            out = target(
                input_ids=block.unsqueeze(0),
                position_ids=torch.arange(t, t + B, device=device).unsqueeze(0),
                use_cache=True,
                **{cache_kw: t_cache},
            )
            res.num_target_forwards += 1
            preds = out.logits[0].argmax(-1)
            k = accepted_prefix(block, preds)
            crop_cache(t_cache, t + k + 1)
            if speculative:
                new_ctx = taps_of(captured, k + 1)  # positions t..t+k
            block_l, preds_l = block.tolist(), preds.tolist()
            res.accept_lengths.append(k + 1)
            if on_step is not None:
                on_step(
                    StepTrace(
                        anchor=t,
                        block=block_l,
                        predictions=preds_l,
                        accepted=k,
                        context_fed=context_fed,
                        drafter_cache_len=d_cache.length if speculative else 0,
                        target_cache_len=t_cache.get_seq_length(),
                    )
                )
            for tok in block_l[1 : k + 1] + [preds_l[k]]:
                res.output_ids.append(tok)
                if tok in eos:
                    res.stopped_on_eos = done = True
                    break
                if len(res.output_ids) >= max_new_tokens:
                    done = True
                    break
            t += k + 1
            x = preds_l[k]
    _sync(device)
    res.wall_time_s = time.perf_counter() - t0
    return res
