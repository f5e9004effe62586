"""``drafter.hidden_noise_std`` (issue 42, item 2): Gaussian noise on the context hidden states in
training only, a function of (train.seed, the packet's index), so a resumed run adds the same (the
fault suite's stop/resume runs train with it: ``tests/faultkit.py``); never in the eval's step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_drafter import CHUNK_BS, chunk_arch, chunk_packet

from dflash.cli import compose_config
from dflash.config import register_configs, to_config
from dflash.config.checks import config_problems
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.step import NOISE_ROWS, StepPlan, add_hidden_noise_, objective_step, packet_anchors

STD = 0.05


def _cfg(*overrides: str):
    register_configs()
    return to_config(compose_config("config", list(overrides)))


def test_the_noise_is_a_function_of_the_seed_and_the_packet():
    base = torch.zeros(2 * NOISE_ROWS + 7, 48)  # more rows than one draw covers
    one = add_hidden_noise_(base.clone(), STD, seed=3, packet=11)
    assert torch.equal(one, add_hidden_noise_(base.clone(), STD, seed=3, packet=11))  # bitwise
    assert not torch.equal(one, add_hidden_noise_(base.clone(), STD, seed=3, packet=12))
    assert not torch.equal(one, add_hidden_noise_(base.clone(), STD, seed=4, packet=11))
    assert abs(float(one.mean())) < 0.1 * STD and float(one.std()) == pytest.approx(STD, rel=0.02)
    half = base[: NOISE_ROWS + 3].clone()  # a shorter packet draws the same first rows
    assert torch.equal(add_hidden_noise_(half, STD, seed=3, packet=11), one[: NOISE_ROWS + 3])
    bf16 = add_hidden_noise_(torch.zeros(16, 8, dtype=torch.bfloat16), STD, seed=3, packet=11)
    assert bf16.dtype == torch.bfloat16 and bool(bf16.abs().sum() > 0)


def _loss(plan: StepPlan, packet: int | None = 5) -> float:
    torch.manual_seed(0)
    model, p = DFlashDraftModel(chunk_arch("dflash")), chunk_packet()
    anchors = packet_anchors(plan, p["positions"], p["loss_mask"], torch.tensor([[1, 2, 5, 9, 14, 22]]), 6)
    anchors = dataclasses.replace(anchors, packet=packet)
    out = objective_step(
        model, p["embed"], p["head"], p["aux"], p["final"], p["ids"], p["loss_mask"][0], anchors, plan
    )
    return float(out.loss.detach())


def test_training_adds_it_and_the_eval_never_does():
    noisy, plain = _cfg(f"drafter.hidden_noise_std={STD}"), _cfg()
    train = StepPlan.for_training(noisy, CHUNK_BS, device="cpu", token_budget=64)
    assert train.hidden_noise_std == STD
    assert StepPlan.for_training(plain, CHUNK_BS, device="cpu", token_budget=64).hidden_noise_std == 0
    evals = StepPlan.for_eval(noisy, CHUNK_BS, device="cpu")
    assert evals == StepPlan.for_eval(plain, CHUNK_BS, device="cpu") and evals.hidden_noise_std == 0
    # the step: same packet, noise on and off; the eval's plan gives the noiseless figure
    train = dataclasses.replace(
        train, attention="sdpa", static_shape=None, num_anchors=None, max_anchors=None
    )
    clean = dataclasses.replace(train, hidden_noise_std=0.0)
    assert _loss(train) != _loss(clean)
    assert _loss(train) == _loss(train)  # reproducible
    assert _loss(dataclasses.replace(train, hidden_noise_std=0.0), packet=None) == _loss(clean)
    with pytest.raises(ValueError, match="packet's index"):
        _loss(train, packet=None)


@pytest.mark.parametrize("value", ["-0.1", "nan", "inf"])
def test_a_bad_std_is_refused_naming_the_field(value):
    problems = config_problems(_cfg(f"drafter.hidden_noise_std={value}"), 3)
    assert any(p.startswith(f"drafter.hidden_noise_std={float(value)}") for p in problems), problems
