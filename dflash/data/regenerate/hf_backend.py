"""Generation with HF ``generate`` in this process: ``backend=hf`` and the embedded corpus.

Batched, left-padded, sorted by prompt length (fewer pad tokens); the results come back in input
order. Memory does not grow with the number of generated tokens beyond the KV cache: no scores or
logits are kept per step (``output_scores``/``output_logits`` off), so nothing of shape
``[batch, steps, vocab]`` ever exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dflash.data.chat import generation_prompt_ids
from dflash.data.regenerate.conversation import Reply


def eos_ids(tokenizer: Any, model: Any) -> list[int]:
    """The tokenizer's eos and the model's generation_config eos (an int or a list), in that order."""
    ids: list[int] = []
    for tid in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        for t in tid if isinstance(tid, (list, tuple)) else [tid]:
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    if not ids:
        raise ValueError(
            "the target has no eos token (tokenizer or generation_config): generation cannot stop"
        )
    return ids


class GenerationStopped(Exception):
    """``should_stop()`` became true during :func:`generate`: its results are incomplete."""


class _StopWhen:
    """A ``generate`` stopping criterion: ends every row once ``should_stop()`` is true (checked per
    token)."""

    def __init__(self, should_stop: Callable[[], bool]) -> None:
        self.should_stop = should_stop

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full(
            (input_ids.shape[0],), self.should_stop(), dtype=torch.bool, device=input_ids.device
        )


@torch.inference_mode()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    batch_size: int = 64,
    temperature: float = 0.0,
    top_p: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[list[list[int]], list[int | None]]:
    """Responses to token-id prompts, in input order: (ids without the eos, the eos id that ended
    each one or None when it was cut at ``max_new_tokens``).

    ``temperature=0`` is greedy; otherwise sampling with ``temperature`` and ``top_p`` (seed torch
    beforehand for reproducibility). Stops at any of :func:`eos_ids`. ``should_stop()`` is checked
    after every token: once true, :class:`GenerationStopped` is raised (nothing is returned).
    """
    from transformers import StoppingCriteriaList

    eos = eos_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": None}
        if temperature > 0
        else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    )
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    stops: list[int | None] = [None] * len(prompts)
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        input_ids = torch.full((len(idx), width), pad, dtype=torch.long)
        attention = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = prompts[i]
            input_ids[row, width - len(p) :] = torch.tensor(p)
            attention[row, width - len(p) :] = 1
        gen = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention.to(model.device),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            output_scores=False,
            output_logits=False,
            return_dict_in_generate=False,
            stopping_criteria=StoppingCriteriaList([_StopWhen(should_stop)]) if should_stop else None,
            **sampling,
        )[:, width:]
        if should_stop is not None and should_stop():
            raise GenerationStopped
        for row, i in enumerate(idx):
            ids = gen[row].cpu().tolist()
            end = next((k for k, t in enumerate(ids) if t in eos), None)
            if end is not None:
                ids, stops[i] = ids[:end], ids[end]
            out[i] = ids
    return out, stops


class HFBackend:
    """``generate(conversations) -> replies`` with the target loaded in this process."""

    def __init__(
        self,
        model_path: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        template_kwargs: dict[str, Any],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float | None = None,
        batch_size: int = 32,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval().to(device)
        self.template_kwargs, self.max_tokens = template_kwargs, max_tokens
        self.temperature, self.top_p, self.batch_size = temperature, top_p, batch_size
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    def generate(
        self, conversations: list[list[dict]], should_stop: Callable[[], bool] | None = None
    ) -> list[Reply | Exception]:
        """One reply per conversation (the next assistant turn), or the exception that prevents it
        (e.g. a prompt too long for the model); the others of the batch are unaffected. Raises
        :class:`GenerationStopped` once ``should_stop()`` is true."""
        results: list[Reply | Exception] = []
        prompts: list[list[int]] = []
        slots: list[int] = []
        for conv in conversations:
            try:
                ids = generation_prompt_ids(self.tokenizer, conv, **self.template_kwargs)
                if self.max_positions and len(ids) + self.max_tokens > self.max_positions:
                    raise ValueError(
                        f"prompt of {len(ids)} tokens + max_tokens={self.max_tokens} exceeds the model's "
                        f"max_position_embeddings={self.max_positions}"
                    )
            except Exception as exc:  # noqa: BLE001 - reported per conversation
                results.append(exc)
                continue
            slots.append(len(results))
            results.append(ValueError("not generated"))
            prompts.append(ids)
        if prompts:
            outs, stops = generate(
                self.model,
                self.tokenizer,
                prompts,
                self.max_tokens,
                batch_size=self.batch_size,
                temperature=self.temperature,
                top_p=self.top_p,
                should_stop=should_stop,
            )
            for slot, ids, stop in zip(slots, outs, stops, strict=True):
                results[slot] = Reply(
                    content=str(self.tokenizer.decode(ids, skip_special_tokens=True)),
                    finish_reason="length" if stop is None else "stop",
                    completion_tokens=len(ids) + (stop is not None),
                )
        return results
