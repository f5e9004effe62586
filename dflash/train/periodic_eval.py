"""Eval during training, shared by every drafter: the real tau beside the cheap estimate.

Every ``eval.every`` steps the drafters decode the first ``eval.num_prompts`` held-out conversations
(``data.num_eval_prompts``, never trained on) from their prompts with speculative decoding
(``eval/tau``), and compute the training objective's block-prefix estimate on the same
conversations (``eval/tau_hat``: every eligible anchor, against the target's greedy tokens). With
target-regenerated data the two should agree; a gap means train/serve misalignment.

There is no eval at step 0 (an untrained drafter accepts nothing: ``python -m dflash.eval`` measures
any export), and an eval's cost is bounded by the run itself: with ``eval.max_share`` = s, the eval
after step k may take s x the seconds trained so far in this launch, less what earlier evals took
(``eval_budget_s``). At that deadline the prompt being decoded ends (its decode steps count) and no
other starts; ``eval/cut_short`` counts the drafters it stopped and ``eval/num_output_tokens`` says
what was decoded. A 10-step run on long prompts thus spends about s of its time in eval, not minutes
per eval; a long run's evals fit their budget and are never cut. ``eval.suite`` is decoded in full.

Prompt i is evaluated by drafter ``i mod M``: all drafters work at the same time and nobody waits
for the leader. Each returns its partial sums (``EVAL_SUMS``), the trainer sums them over the
drafters and turns them into metrics (``eval_metrics``). It needs the target on each drafter's
device (its lm_head verifies): a co-located rank uses its own target, a disaggregated drafter loads
a copy, so it is off by default (``eval.every=0``).

With ``eval.suite`` (``zlab``, ``[gsm8k,mt-bench]``, ...) the drafters also decode the benchmarks of
:mod:`dflash.eval.suites` as ``python -m dflash.eval suite=...`` does (``eval.data_dir``,
``eval.max_samples``, ``eval.seed``; conversation i of a benchmark on drafter ``i mod M``; no
baseline) and log ``eval/<benchmark>/tau`` and its histogram (``dflash.eval.suite_run.SUITE_SUMS``
after the held-out sums).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from dflash.config import Config, UserError
from dflash.config.resolve import torch_dtype
from dflash.data.tokenize import load_eval_samples
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.step import StepPlan, objective_step, plan_anchors
from dflash.eval.loading import eos_ids_of
from dflash.eval.results import PromptResult, evaluate
from dflash.eval.spec_decode import StepTrace
from dflash.eval.suite_run import (
    Decoder,
    benchmark_report,
    decode_conversations,
    suite_sums,
    suite_sums_metrics,
)
from dflash.eval.suites import BenchmarkDataMissing, Conversation, load_suite, suite_template_kwargs
from dflash.targets.forward import target_forward
from dflash.targets.loader import load_target
from dflash.train.setup import RunSetup

log = logging.getLogger(__name__)

EVAL_SUMS = (
    "accept_sum",  # sum over decode steps of accepted + 1
    "steps",
    "output_tokens",
    "prompts",
    "tpot_sum",  # sum over prompts of the speculative TPOT (s)
    "tau_sum",  # tau_hat: sum over blocks of tau_b, of 1 / tau_b, and the number of blocks
    "inv_tau_sum",
    "blocks",
    "aborted",  # drafters whose share was aborted by a stop request
    "cut_short",  # drafters whose share the time budget ended early (eval.max_share)
)
"""Partial sums of one drafter's share, in this order, then the acceptance histogram (1..B), then the
suite's ``suite_sums``."""


class EvalAborted(RuntimeError):
    """The periodic eval stopped early because a stop was requested (it never delays a checkpoint)."""


def eval_budget_s(max_share: float | None, train_s: float, eval_s: float) -> float:
    """Seconds the next eval may take (``inf`` without ``eval.max_share``): ``max_share`` of the
    ``train_s`` seconds trained so far, less the ``eval_s`` seconds earlier evals took (at least 0)."""
    if max_share is None:
        return math.inf
    return max(0.0, max_share * train_s - eval_s)


class PeriodicEval:
    """This drafter's share of the held-out prompts and a target to verify with."""

    def __init__(
        self,
        cfg: Config,
        setup: RunSetup,
        device: torch.device,
        *,
        drafter_index: int = 0,
        num_drafters: int = 1,
        target: torch.nn.Module | None = None,
    ) -> None:
        self.cfg, self.setup, self.device = cfg, setup, device
        samples = load_eval_samples(setup.data, setup.tokenizer, setup.meta.vocab_size)
        n = min(cfg.eval.num_prompts, len(samples))
        if n == 0:
            raise ValueError(
                "eval.every > 0 but there are no held-out conversations; set data.num_eval_prompts to a few"
            )
        self.samples = [samples.sample(i) for i in range(drafter_index, n, num_drafters)]
        self.prompts = [ids[: int(mask.argmax())].tolist() for ids, mask in self.samples]
        self.target = (
            target
            if target is not None
            else load_target(cfg.target, device, torch_dtype(cfg.target.dtype, device), decoding=True)
        )
        self.eos_ids = eos_ids_of(setup.tokenizer, self.target)
        try:
            suite = load_suite(
                cfg.eval.suite, cfg.eval.data_dir, cfg.eval.max_samples, cfg.eval.seed, field_prefix="eval."
            )
        except BenchmarkDataMissing as exc:  # every drafter finds it; the first one says it
            raise UserError(str(exc), scope="here" if drafter_index == 0 else "quiet") from None
        self.suite: dict[str, list[Conversation]] = {
            name: convs[drafter_index::num_drafters] for name, (convs, _) in suite.items()
        }
        self.step_plan = StepPlan.for_eval(cfg, setup.arch.block_size, device=device.type)
        ev = cfg.eval
        log.info(
            "periodic eval every %d steps and after the last one (not at step 0): %d of %d held-out prompts on "
            "this drafter x up to %d new tokens, %s%s",
            ev.every,
            len(self.samples),
            n,
            ev.max_new_tokens,
            "no time limit (eval.max_share=null)"
            if ev.max_share is None
            else f"each eval within eval.max_share={ev.max_share:g} of the training time so far",
            "".join(f", {name} {len(c)} conversations" for name, c in self.suite.items()),
        )

    @property
    def planned_tokens(self) -> int:
        """New tokens this drafter's share decodes at most (prompts x ``eval.max_new_tokens``)."""
        return len(self.prompts) * self.cfg.eval.max_new_tokens

    @torch.no_grad()
    def _tau_hat_sums(
        self, drafter: DFlashDraftModel, embed: torch.Tensor, head: torch.Tensor, check: Callable[[], None]
    ) -> tuple[float, float, float]:
        """The objective's block-prefix sums (tau_b, 1 / tau_b, blocks) against the verifier argmax,
        over every eligible anchor of this share's samples (the training step, ``dflash.drafter.step``)."""
        tau = inv = blocks = 0.0
        for ids, mask in self.samples:
            check()
            anchors = plan_anchors(self.step_plan, torch.tensor([ids.numel()]), mask, 0)
            if anchors.num_blocks == 0:
                continue
            ids, mask = ids.to(self.device), mask.to(self.device)
            aux, final = target_forward(self.target, ids.unsqueeze(0), None, self.setup.layer_ids)
            out = objective_step(
                drafter, embed, head, aux[0].clone(), final[0].clone(), ids, mask, anchors, self.step_plan
            )
            tau += float(out.tau_verifier_sum)
            inv += float(out.inv_tau_verifier_sum)
            blocks += float(out.num_blocks)
        return tau, inv, blocks

    def _suite_sums(
        self,
        drafter: DFlashDraftModel,
        embed: torch.Tensor,
        head: torch.Tensor,
        check: Callable[..., None],
    ) -> torch.Tensor:
        """``suite_sums`` of this drafter's share of every benchmark of ``eval.suite``."""
        bs = self.setup.arch.block_size
        dec = Decoder(
            target=self.target,
            drafter=drafter,
            embed=embed,
            head=head,
            tokenizer=self.setup.tokenizer,
            layer_ids=self.setup.layer_ids,
            block_size=bs,
            eos_ids=self.eos_ids,
            max_new_tokens=self.cfg.eval.max_new_tokens,
            baseline=False,
            template_kwargs=suite_template_kwargs(dict(self.cfg.data.chat_template_kwargs)),
            max_positions=self.setup.meta.max_position_embeddings or None,
        )
        reports = {
            name: benchmark_report(
                name, "", decode_conversations(dec, name, convs, on_step=check), bs, dec.max_new_tokens
            )
            for name, convs in self.suite.items()
        }
        return suite_sums(reports, bs)

    def _held_out_sums(
        self,
        drafter: DFlashDraftModel,
        embed: torch.Tensor,
        head: torch.Tensor,
        check: Callable[..., None],
        deadline: float,
        advance: Callable[[int], None],
    ) -> torch.Tensor:
        """``EVAL_SUMS`` and the histogram of this drafter's held-out prompts (zeros without any),
        decoded until ``deadline`` (``time.perf_counter()``); ``advance(n)``: n more of
        ``planned_tokens`` are done (decoded, or left out by an eos)."""
        bs = self.setup.arch.block_size
        sums = torch.zeros(len(EVAL_SUMS) + bs, dtype=torch.float64)
        if not self.prompts:
            return sums
        max_new = self.cfg.eval.max_new_tokens
        cut = False
        shown = 0  # tokens of the prompt in progress counted in advance()

        def should_end() -> bool:
            nonlocal cut
            cut = cut or time.perf_counter() >= deadline
            return cut

        def on_step(trace: StepTrace) -> None:
            nonlocal shown
            check(trace)
            n = min(trace.accepted + 1, max_new - shown)
            shown += n
            advance(n)

        def on_prompt(_i: int, _r: PromptResult) -> None:
            nonlocal shown
            advance(max_new - shown)
            shown = 0

        if should_end():  # no time left: nothing decoded, no estimate either
            sums[EVAL_SUMS.index("cut_short")] = 1.0
            return sums
        report = evaluate(
            self.target,
            drafter,
            embed,
            head,
            self.setup.tokenizer,
            self.prompts,
            max_new_tokens=max_new,
            layer_ids=self.setup.layer_ids,
            block_size=bs,
            eos_ids=self.eos_ids,
            baseline=False,
            warmup=False,
            progress=on_prompt,
            on_step=on_step,
            should_end=should_end,
            verbose=False,
        )
        tau, inv, blocks = self._tau_hat_sums(drafter, embed, head, check)
        values = {
            "accept_sum": float(sum(a for r in report.results for a in r.accept_lengths)),
            "steps": float(report.num_steps),
            "output_tokens": float(report.num_output_tokens),
            "prompts": float(len(report.results)),
            "tpot_sum": float(sum(r.tpot_s for r in report.results)),
            "tau_sum": tau,
            "inv_tau_sum": inv,
            "blocks": blocks,
            "aborted": 0.0,
            "cut_short": float(cut),
        }
        sums[: len(EVAL_SUMS)] = torch.tensor([values[k] for k in EVAL_SUMS], dtype=torch.float64)
        sums[len(EVAL_SUMS) :] = torch.tensor(
            [report.accept_len_hist[k] for k in range(1, bs + 1)], dtype=torch.float64
        )
        return sums

    def run(
        self,
        drafter: DFlashDraftModel,
        embed: torch.Tensor,
        head: torch.Tensor,
        should_stop: Callable[[], bool] = lambda: False,
        *,
        budget_s: float = math.inf,
        advance: Callable[[int], None] = lambda n: None,
    ) -> torch.Tensor:
        """This share's partial sums (float64 ``[len(EVAL_SUMS) + B]`` held-out, see ``EVAL_SUMS``,
        then the suite's ``suite_sums``); stops within one decode step (or one tau_hat sample) of
        ``should_stop()`` turning true, and then returns zeros with ``aborted = 1``. The held-out
        prompts are decoded for at most ``budget_s`` seconds (``eval_budget_s``); ``advance(n)``
        reports progress in new tokens of ``planned_tokens``."""
        deadline = time.perf_counter() + budget_s
        bs = self.setup.arch.block_size

        def check(_trace: object = None) -> None:
            if should_stop():
                raise EvalAborted("a stop was requested: checkpoint first")

        was_training = drafter.training
        drafter.eval()
        try:
            with self.step_plan.autocast():
                held_out = self._held_out_sums(drafter, embed, head, check, deadline, advance)
                suite = self._suite_sums(drafter, embed, head, check)
        except EvalAborted as e:
            log.warning("eval share aborted: %s", e)
            held_out = torch.zeros(len(EVAL_SUMS) + bs, dtype=torch.float64)
            held_out[EVAL_SUMS.index("aborted")] = 1.0
            suite = suite_sums({}, bs)
        finally:
            drafter.train(was_training)
        return torch.cat([held_out, suite])


def eval_metrics(sums: torch.Tensor, block_size: int) -> dict[str, float]:
    """``eval/*`` metrics from the drafters' summed ``EVAL_SUMS`` and ``eval/<benchmark>/*`` from the
    suite's sums after them (empty when any share was aborted)."""
    v = dict(zip(EVAL_SUMS, sums[: len(EVAL_SUMS)].tolist(), strict=True))
    if v["aborted"] > 0 or v["steps"] == 0:
        return {}
    m = {
        "eval/tau": v["accept_sum"] / v["steps"],
        "eval/tau_hat": v["blocks"] / max(v["inv_tau_sum"], 1e-12),
        "eval/tau_hat_arith": v["tau_sum"] / max(v["blocks"], 1.0),
        "eval/tpot_ms": 1e3 * v["tpot_sum"] / max(v["prompts"], 1.0),
        "eval/block_size": float(block_size),
        "eval/num_prompts": v["prompts"],
        "eval/num_steps": v["steps"],
        "eval/num_output_tokens": v["output_tokens"],
        "eval/cut_short": v["cut_short"],
    }
    for k, c in enumerate(sums[len(EVAL_SUMS) : len(EVAL_SUMS) + block_size].tolist(), start=1):
        m[f"eval/accept_len_hist/{k}"] = c
    return m | suite_sums_metrics(sums[len(EVAL_SUMS) + block_size :], block_size)
