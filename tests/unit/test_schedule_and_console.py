"""Stops and resumes without a process group: the learning-rate schedule a resumed run follows when
its settings changed, the stop message's command, a console whose reader went away, a step that
trained on nothing (issue 19 items 6 and 11)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dflash.cli import ConsoleStream
from dflash.config import OptimConfig
from dflash.drafter.optim import LrSchedule, build_optimizer, build_scheduler, lr_factor
from dflash.train.step_stats import StepSums, step_metrics
from dflash.train.summary import status_line


def _run(sched, opt, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(float(sched.get_last_lr()[0]))
        opt.step()
        sched.step()
    return lrs


def test_the_schedule_is_saved_with_the_scheduler_and_restored_as_it_was():
    p = [torch.nn.Parameter(torch.zeros(2))]
    cfg = OptimConfig(warmup_ratio=0.1)
    opt = build_optimizer(p, cfg)
    sched = build_scheduler(opt, cfg, 20)
    _run(sched, opt, 7)
    state = json.loads(json.dumps(sched.state_dict()))  # the checkpoint keeps it as JSON
    opt2 = build_optimizer(p, cfg)
    sched2 = build_scheduler(opt2, cfg, 20)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(state)
    assert sched2.lr_lambdas[0] == sched.lr_lambdas[0]
    assert sched2.get_last_lr() == sched.get_last_lr()


@pytest.mark.parametrize("new_total,new_lr", [(40, 6e-4), (30, 3e-4), (12, 6e-4)])
def test_a_replanned_schedule_continues_without_a_jump_and_ends_at_the_new_minimum(new_total, new_lr):
    """Extending (or shortening) a run, or a new optim.lr, applies from the resumed step: the first
    resumed step has the lr reached (times new/old lr), then a cosine to the new minimum at the end."""
    cfg = OptimConfig(lr=6e-4, warmup_ratio=0.1, min_lr_ratio=0.1)
    s = LrSchedule(20, cfg.warmup_ratio, cfg.min_lr_ratio)
    reached = s(10)
    new = OptimConfig(lr=new_lr, warmup_ratio=0.1, min_lr_ratio=0.1)
    s.replan(10, reached, new, new_total)  # the trainer passes lr reached x new/old lr, over the new lr
    lrs = [new_lr * s(k) for k in range(10, new_total)]
    assert lrs[0] == pytest.approx(cfg.lr * reached * new_lr / cfg.lr)
    assert lrs[-1] == pytest.approx(new_lr * 0.1)
    assert all(a >= b - 1e-15 for a, b in zip(lrs, lrs[1:], strict=False))  # no jump up anywhere
    assert [s(k) for k in range(10)] == [lr_factor(k, new_total, 0.1, 0.1) for k in range(10)]


def test_a_resume_inside_the_new_warmup_follows_the_new_schedule():
    s = LrSchedule(10, 0.1, 0.0)
    s.replan(2, s(2), OptimConfig(warmup_ratio=0.2), 40)  # warmup of 8 steps at the new length
    assert s.resume_step == -1 and s(3) == lr_factor(3, 40, 0.2, 0.0)


def test_the_stop_message_gives_the_command_that_continues():
    asked = status_line(10, 113, "train.stop_after_steps=10")
    assert "launch the same command without train.stop_after_steps (or with a larger value)" in asked
    assert "relaunch the same command to resume" in status_line(51, 505, "SIGTERM")
    assert status_line(113, 113, None) == "finished: 113 of 113 steps"


def test_a_console_whose_reader_went_away_drops_writes_instead_of_raising():
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = ConsoleStream(os.fdopen(write_end, "w", buffering=1))
    stream.write("step 1 loss 3.2\n")
    stream.flush()
    assert stream.closed_by_reader
    assert stream.write("the checkpoint line\n") == len("the checkpoint line\n")
    stream.flush()
    assert not stream.isatty()


def test_a_step_that_trained_on_nothing_reports_nan_not_a_division_by_zero():
    m = step_metrics(
        StepSums(4),
        step=1,
        step_s=1.0,
        lr=1e-3,
        grad_norm=0.0,
        loss_weights={"ce": 1.0},
        num_targets=1,
        num_drafters=1,
        self_produced=False,
    )
    for key in ("train/loss", "train/tau_hat", "train/tau_hat_arith", "train/acc", "train/acc_slot_1"):
        assert m[key] != m[key], key  # NaN (written as null), never 1e12
