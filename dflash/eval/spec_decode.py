"""Greedy DFlash speculative decoding (batch 1), the loop training must reproduce (spec §1.9).

One generation::

    prefill   target(prompt[0:P]) with a fresh cache, taps captured -> x_P = argmax(last logits)
              drafter context = taps of positions 0..P-1 (nothing in the drafter's KVCache yet)
    step      (anchor t = position of the newest token x_t; the target cache holds positions < t)
      draft   drafter(noise = embed([x_t, MASK x (B-1)]) at positions t..t+B-1,
                      new context = taps of the positions not yet in the drafter cache, at their
                      positions, + its KVCache)  ->  d_1..d_{B-1} = the family's ``propose`` of
                      hidden[1:]: argmax(lm_head(.)) for DFlash-1, DFlash2's selector chain from x_t
              the drafter KVCache grows by the new context rows only (never the block rows), so after
              the call it holds exactly positions 0..t-1
      verify  target([x_t, d_1..d_{B-1}]) at positions t..t+B-1 with its cache, taps captured
              -> y_0..y_{B-1}; k = longest prefix with d_j == y_{j-1}
      accept  output += d_1..d_k, y_k; tau_step = k + 1; roll the target cache back to t + k + 1
              (drops the rejected drafts: attention layers are cropped; linear-attention layers are
              restored to their state at t and x_t, d_1..d_k replayed, see ``target_cache``);
              next context = taps of block rows 0..k (positions t..t+k); next anchor t + k + 1, x = y_k
    stop      after an eos (kept) or max_new_tokens new tokens (output cut to exactly that many)

``block_size == 1`` (or no drafter) is plain greedy decoding with the same machinery: one target
forward per token, no taps. The target's own lm_head verifies (eval is the one place it runs).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash.drafter.model import DFlashDraftModel
from dflash.eval.target_cache import TargetCache
from dflash.metrics import sync_current_stream
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
    """Target forwards: the prefill, one verify per decode step and the replays."""
    num_replay_forwards: int = 0
    """Target forwards that re-ran accepted tokens after a rejection (targets with linear attention)."""
    num_drafter_forwards: int = 0
    prompt_len: int = 0
    block_size: int = 1
    stopped_on_eos: bool = False
    cut_short: bool = False
    """Ended by ``should_end`` before an eos or ``max_new_tokens``."""
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


class _Drafter:
    """The drafter side of one generation: the drafter, the target's embedding and head in its
    device/dtype, the MASK id and the drafter's decoding cache."""

    def __init__(
        self,
        drafter: DFlashDraftModel,
        embed_weight: torch.Tensor | None,
        lm_head_weight: torch.Tensor | None,
        layer_ids: list[int],
    ) -> None:
        if embed_weight is None or lm_head_weight is None:
            raise ValueError("speculative decoding needs the target's embed_weight and lm_head_weight")
        if list(drafter.arch.target_layer_ids) != [int(i) for i in layer_ids]:
            raise ValueError(
                f"layer_ids={list(layer_ids)} differ from the drafter's target_layer_ids="
                f"{list(drafter.arch.target_layer_ids)}; pass the drafter's tap ids"
            )
        param = next(drafter.parameters())
        self.model, self.device = drafter, param.device
        self.embed = embed_weight.to(param.device, param.dtype)
        self.head = lm_head_weight.to(param.device, param.dtype)
        self.mask_id = int(drafter.arch.mask_token_id)
        if not 0 <= self.mask_id < self.embed.shape[0]:
            raise ValueError(
                f"drafter mask_token_id={self.mask_id} is outside the embedding's {self.embed.shape[0]} rows"
            )
        self.cache = drafter.new_cache()

    def propose(self, x: int, anchor: int, new_ctx: torch.Tensor, block_size: int) -> torch.Tensor:
        """Draft tokens d_1..d_{B-1} [B-1] of the block ``[x, MASK x (B-1)]`` at ``anchor``; ``new_ctx``
        [1, L, n_tap*H] are the taps of the positions the cache lacks (cache.length .. anchor-1)."""
        c0 = self.cache.length
        block_ids = torch.full((1, block_size), self.mask_id, dtype=torch.long, device=self.device)
        block_ids[0, 0] = x
        hidden = self.model(
            self.embed[block_ids],
            new_ctx.to(self.device),
            torch.arange(c0, c0 + new_ctx.shape[1], device=self.device).unsqueeze(0),
            torch.arange(anchor, anchor + block_size, device=self.device).unsqueeze(0),
            None,
            self.cache,
        )
        previous = torch.tensor([x], dtype=torch.long, device=self.device)
        return self.model.propose(hidden[:, 1:], previous, self.head)[0]


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
    should_end: Callable[[], bool] | None = None,
) -> GenerationResult:
    """Greedy generation of at most ``max_new_tokens`` new tokens; with a drafter and
    ``block_size > 1`` DFlash speculative decoding, else plain autoregressive decoding.
    ``should_end()`` turning true ends it after the current decode step, as if ``max_new_tokens``
    had been reached there (``GenerationResult.cut_short``; the periodic eval's time budget).

    target: a ``*ForCausalLM`` (its lm_head verifies), full attention or hybrid with linear-attention
    layers (rejected drafts are undone by ``TargetCache``). drafter: a DFlashDraftModel whose
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
    draft = None
    if drafter is not None and block_size > 1:
        draft = _Drafter(drafter, embed_weight, lm_head_weight, layer_ids)
    gen = _Generation(target, draft, layer_ids, eos_token_ids, max_new_tokens, block_size if draft else 1)
    capture: AbstractContextManager[dict[int, torch.Tensor]] = (
        capture_hidden_states(target, layer_ids) if draft is not None else nullcontext({})
    )
    sync_current_stream(gen.device)
    t0 = time.perf_counter()
    with capture as captured:
        x, new_ctx = gen.prefill(captured, prompt_ids)
        sync_current_stream(gen.device)
        gen.res.prefill_time_s = time.perf_counter() - t0
        t = len(prompt_ids)  # position of x (the target cache holds positions < t)
        done = x in gen.eos or max_new_tokens <= 1
        while not done:
            x, t, new_ctx, done = gen.step(captured, x, t, new_ctx, on_step)
            if not done and should_end is not None and should_end():
                gen.res.cut_short = done = True
    sync_current_stream(gen.device)
    gen.res.wall_time_s = time.perf_counter() - t0
    return gen.res


class _Generation:
    """One generation's state: the target, its cache, the optional drafter and the result so far."""

    def __init__(
        self,
        target: nn.Module,
        draft: _Drafter | None,
        layer_ids: list[int],
        eos_token_ids: set[int],
        max_new_tokens: int,
        block_size: int,
    ) -> None:
        self.target, self.draft, self.layer_ids = target, draft, [int(i) for i in layer_ids]
        self.device = next(target.parameters()).device
        self.eos = {int(e) for e in eos_token_ids}
        self.max_new_tokens, self.block_size = max_new_tokens, block_size
        self.cache_kw = _cache_kwarg(target)
        self.t_cache = TargetCache(target, rollback=draft is not None)
        self.res = GenerationResult(output_ids=[], prompt_len=0, block_size=block_size)

    def _taps(self, captured: dict[int, torch.Tensor], rows: int | None = None) -> torch.Tensor:
        feats = torch.cat([captured[i] for i in self.layer_ids], dim=-1)  # [1, L, n_tap*H]
        return feats if rows is None else feats[:, :rows]

    def _run_target(self, ids: torch.Tensor, start: int, **kw):
        self.res.num_target_forwards += 1
        positions = torch.arange(start, start + ids.shape[1], device=self.device).unsqueeze(0)
        return self.target(
            input_ids=ids, position_ids=positions, use_cache=True, **{self.cache_kw: self.t_cache.cache}, **kw
        )

    def prefill(
        self, captured: dict[int, torch.Tensor], prompt_ids: list[int]
    ) -> tuple[int, torch.Tensor | None]:
        """The prompt through the target: its greedy token and the taps of positions 0..P-1."""
        self.res.prompt_len = len(prompt_ids)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        x = int(self._run_target(ids, 0, logits_to_keep=1).logits[0, -1].argmax().item())
        self.res.output_ids.append(x)
        self.res.stopped_on_eos = x in self.eos
        return x, (self._taps(captured) if self.draft is not None else None)

    def step(
        self,
        captured: dict[int, torch.Tensor],
        x: int,
        t: int,
        new_ctx: torch.Tensor | None,
        on_step: Callable[[StepTrace], None] | None,
    ) -> tuple[int, int, torch.Tensor | None, bool]:
        """Draft, verify and accept one block at anchor ``t``; returns the next (x, t, context, done)."""
        block = torch.tensor([x], device=self.device)
        context_fed = 0
        if self.draft is not None and new_ctx is not None:
            context_fed = new_ctx.shape[1]
            block = torch.cat([block, self.draft.propose(x, t, new_ctx, self.block_size).to(self.device)])
            self.res.num_drafter_forwards += 1
            self.t_cache.mark(t)
        preds = self._run_target(block.unsqueeze(0), t).logits[0].argmax(-1)
        k = accepted_prefix(block, preds)
        if self.draft is not None:
            new_ctx = self._taps(captured, k + 1)  # positions t..t+k, before a replay overwrites them
        if k + 1 < block.numel():
            replay = self.t_cache.rewind(t + k + 1)
            if replay:
                self._run_target(block[:replay].unsqueeze(0), t)
                self.res.num_replay_forwards += 1
        block_l, preds_l = block.tolist(), preds.tolist()
        self.res.accept_lengths.append(k + 1)
        if on_step is not None:
            on_step(
                StepTrace(
                    anchor=t,
                    block=block_l,
                    predictions=preds_l,
                    accepted=k,
                    context_fed=context_fed,
                    drafter_cache_len=self.draft.cache.length if self.draft is not None else 0,
                    target_cache_len=self.t_cache.seq_length(),
                )
            )
        done = self._emit(block_l[1 : k + 1] + [preds_l[k]])
        return preds_l[k], t + k + 1, new_ctx, done

    def _emit(self, tokens: list[int]) -> bool:
        """Append the accepted tokens up to an eos or max_new_tokens; True when generation is over."""
        for tok in tokens:
            self.res.output_ids.append(tok)
            if tok in self.eos:
                self.res.stopped_on_eos = True
                return True
            if len(self.res.output_ids) >= self.max_new_tokens:
                return True
        return False
