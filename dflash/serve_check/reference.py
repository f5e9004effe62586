"""dflash's side of the serve check: the held-out prompts and dflash's own speculative decode of them.

The prompts are the run's held-out conversations (``data.num_eval_prompts``, never trained on) cut at
their first supervised token, as the periodic eval cuts them, as token ids: vLLM gets the same ids. The
decode is :func:`dflash.eval.report.evaluate` (greedy, batch 1, fp32 on CPU) with the block-size-1
baseline, so an output is also checked against the target's own greedy continuation.
"""

from __future__ import annotations

import logging

import torch

from dflash.drafter.arch import DrafterArch
from dflash.eval.loading import eos_ids_of
from dflash.eval.results import EvalReport, evaluate
from dflash.serve_check.exports import build_drafter
from dflash.serve_check.runs import TrainedRun
from dflash.targets.loader import target_embed_and_head

log = logging.getLogger(__name__)


def held_out_prompts(run: TrainedRun, tokenizer, num_prompts: int) -> list[list[int]]:
    """The first ``num_prompts`` held-out prompts of the run as token ids (``ValueError`` if none)."""
    from dflash.data.tokenize import load_eval_samples

    samples = load_eval_samples(run.config.data, tokenizer, run.arch.vocab_size, target_dir=run.target_dir)
    prompts = []
    for i in range(min(num_prompts, len(samples))):
        ids, mask = samples.sample(i)
        first = int(mask.argmax())
        if mask.any() and first > 0:
            prompts.append(ids[:first].tolist())
    if not prompts:
        raise ValueError(
            f"run {run.dir} has no held-out prompt (data.num_eval_prompts={run.config.data.num_eval_prompts}); "
            "train it with data.num_eval_prompts=16"
        )
    return prompts


class Reference:
    """The target, loaded once, the held-out prompts, and dflash's decode of them with any layout."""

    def __init__(self, run: TrainedRun, num_prompts: int, max_new_tokens: int) -> None:
        from transformers import AutoTokenizer

        from dflash.targets.loader import load_target

        self.run, self.max_new_tokens = run, max_new_tokens
        cfg = run.config.target
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or str(run.target_dir))
        self.prompts = held_out_prompts(run, self.tokenizer, num_prompts)
        self.target = load_target(cfg, torch.device("cpu"), torch.float32)
        self.embed, self.head = target_embed_and_head(self.target)
        self.eos_ids = eos_ids_of(self.tokenizer, self.target)

    def decode(self, arch: DrafterArch) -> EvalReport:
        """dflash's speculative decode (block size ``arch.block_size``) of every prompt with the run's
        weights under ``arch``, and the plain greedy baseline."""
        drafter = build_drafter(arch, self.run.state)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # batch-1 forwards of a tiny model: a second thread only contends
        try:
            return self._evaluate(drafter, arch)
        finally:
            torch.set_num_threads(threads)

    def _evaluate(self, drafter, arch: DrafterArch) -> EvalReport:
        return evaluate(
            self.target,
            drafter,
            self.embed,
            self.head,
            self.tokenizer,
            self.prompts,
            max_new_tokens=self.max_new_tokens,
            layer_ids=list(arch.target_layer_ids),
            block_size=arch.block_size,
            eos_ids=self.eos_ids,
            baseline=True,
            warmup=False,
            verbose=False,
        )
