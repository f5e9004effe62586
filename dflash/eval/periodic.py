"""Eval during training, on the drafter leader: the real tau beside the cheap estimate.

Every ``eval.every`` steps the leader decodes the first ``eval.num_prompts`` held-out conversations
(``data.num_eval_prompts``, never trained on) from their prompts with speculative decoding
(``eval/tau``), and computes the training objective's block-prefix estimate on the same
conversations (``eval/tau_hat``: every eligible anchor, against the target's greedy tokens). With
target-regenerated data the two should agree; a gap means train/serve misalignment. It needs a
full copy of the target on the drafter's device (its lm_head verifies), so it is off by default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext

import torch

from dflash.config import Config
from dflash.data.tokenize import load_eval_samples
from dflash.drafter.blocks import doc_ids_from_positions, eligible_anchors
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.objective import dflash_loss
from dflash.eval.loading import eos_ids_of
from dflash.eval.report import evaluate, report_metrics
from dflash.setup import RunSetup, torch_dtype
from dflash.targets.forward import target_forward
from dflash.targets.loader import load_target

log = logging.getLogger(__name__)


class EvalAborted(RuntimeError):
    """The periodic eval stopped early because a stop was requested (it never delays a checkpoint)."""


class PeriodicEval:
    """Held-out prompts, a target copy, and ``run(drafter, embed, head) -> eval/* metrics``."""

    def __init__(self, cfg: Config, setup: RunSetup, device: torch.device) -> None:
        self.cfg, self.setup, self.device = cfg, setup, device
        samples = load_eval_samples(cfg.data, setup.tokenizer, setup.meta.vocab_size)
        n = min(cfg.eval.num_prompts, len(samples))
        if n == 0:
            raise ValueError(
                "eval.every > 0 but there are no held-out conversations; set data.num_eval_prompts to a few"
            )
        self.samples = [samples.sample(i) for i in range(n)]
        self.prompts = [ids[: int(mask.argmax())].tolist() for ids, mask in self.samples]
        self.target = load_target(cfg.target, device, torch_dtype(cfg.target.dtype, device))
        self.eos_ids = eos_ids_of(setup.tokenizer, self.target)
        autocast = torch_dtype(cfg.drafter.dtype, device)
        self.autocast = (
            torch.autocast(device.type, dtype=autocast) if autocast != torch.float32 else nullcontext()
        )
        log.info("periodic eval: %d held-out prompts every %d steps", n, cfg.eval.every)

    @torch.no_grad()
    def tau_hat(
        self, drafter: DFlashDraftModel, embed: torch.Tensor, head: torch.Tensor, check: Callable[[], None]
    ) -> tuple[float, float]:
        """The objective's tau_hat (harmonic, as train/tau_hat) and its arithmetic mean, against the
        verifier argmax, over every eligible anchor of the held-out samples."""
        tau = inv = blocks = 0.0
        for ids, mask in self.samples:
            check()
            ids, mask = ids.to(self.device).unsqueeze(0), mask.to(self.device).unsqueeze(0)
            aux, final = target_forward(self.target, ids, None, self.setup.layer_ids)
            pos = torch.arange(ids.shape[1], device=self.device).unsqueeze(0)
            anchors = eligible_anchors(mask, doc_ids_from_positions(pos))[0].nonzero().view(1, -1)
            if anchors.numel() == 0:
                continue
            out = dflash_loss(
                drafter,
                aux.clone(),
                final.clone(),
                ids,
                mask,
                anchors,
                embed,
                head,
                self.cfg.loss,
                attention="sdpa",
            )
            tau += float(out.tau_verifier_sum)
            inv += float(out.inv_tau_verifier_sum)
            blocks += float(out.num_blocks)
        return blocks / max(inv, 1e-12), tau / max(blocks, 1.0)

    def run(
        self,
        drafter: DFlashDraftModel,
        embed: torch.Tensor,
        head: torch.Tensor,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> dict[str, float]:
        """``eval/*`` metrics of the drafter now; raises ``EvalAborted`` within one decode step (or
        one tau_hat sample) of ``should_stop()`` turning true."""

        def check(_trace: object = None) -> None:
            if should_stop():
                raise EvalAborted("a stop was requested: checkpoint first")

        was_training = drafter.training
        drafter.eval()
        try:
            with self.autocast:
                report = evaluate(
                    self.target,
                    drafter,
                    embed,
                    head,
                    self.setup.tokenizer,
                    self.prompts,
                    max_new_tokens=self.cfg.eval.max_new_tokens,
                    layer_ids=self.setup.layer_ids,
                    block_size=self.setup.arch.block_size,
                    eos_ids=self.eos_ids,
                    baseline=False,
                    warmup=False,
                    on_step=check,
                    verbose=False,
                )
                metrics = report_metrics(report)
                metrics["eval/tau_hat"], metrics["eval/tau_hat_arith"] = self.tau_hat(
                    drafter, embed, head, check
                )
        finally:
            drafter.train(was_training)
        return metrics
