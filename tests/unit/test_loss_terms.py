"""The loss-term records (``dflash.loss.terms``) and the places that derive from them: the config's
coefficient fields, the checks, the planner's verifier GEMM, the metrics and the report."""

from __future__ import annotations

import dataclasses

import pytest

from dflash.config import LossConfig
from dflash.loss.terms import (
    BY_NAME,
    TERM_FIELD,
    TERMS,
    coefficients,
    gradient_plan,
    metric_keys,
    needs_verifier_logits,
)


def test_every_term_has_its_config_field_and_nothing_else_is_one():
    fields = {f.name: f for f in dataclasses.fields(LossConfig)}
    marked = {name for name, f in fields.items() if f.metadata.get(TERM_FIELD)}
    assert marked == set(BY_NAME)
    for term in TERMS:
        assert fields[term.name].default == term.default, term.name
        assert fields[term.name].metadata["resume"] == "contract"
    assert coefficients(LossConfig()) == {t.name: t.default for t in TERMS}


def test_the_verifier_gemm_runs_when_a_weighted_term_or_the_metrics_need_it():
    assert not needs_verifier_logits({"ce": 1.0, "kl": 0.0, "verifier_ce": 0.0}, verifier_metrics=False)
    assert needs_verifier_logits({"ce": 1.0, "kl": 0.0, "verifier_ce": 0.0}, verifier_metrics=True)
    for term in TERMS:
        coefs = {t.name: 0.0 for t in TERMS} | {term.name: 1.0}
        assert needs_verifier_logits(coefs, verifier_metrics=False) == term.needs_verifier


def test_gradient_plan_sums_the_weighted_terms():
    plan = gradient_plan({"ce": 0.5, "kl": 2.0, "verifier_ce": 0.25})
    assert plan.q1 == 0.75 and plan.kl_basis == 2.0
    assert plan.onehots == (("label", 0.5), ("verifier_argmax", 0.25))
    assert gradient_plan({"ce": 1.0, "kl": 0.0, "verifier_ce": 0.0}).onehots == (("label", 1.0),)


def test_metrics_and_report_follow_the_records():
    from dflash.report import CHARTS
    from dflash.train.step_stats import OBJECTIVE_SUMS

    assert metric_keys() == tuple(f"train/loss_{t.name}" for t in TERMS)
    charted = dict(CHARTS)["loss"]
    assert set(metric_keys()) <= set(charted)
    assert OBJECTIVE_SUMS["term_sums"] == len(TERMS)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_a_negative_or_all_zero_coefficient_is_refused_naming_the_field(name):
    from dflash.config.checks import _loss_problems, _Problems

    cfg = type("C", (), {"loss": LossConfig(**{name: -1.0})})()
    p = _Problems()
    _loss_problems(cfg, p)  # type: ignore[arg-type]
    assert any(f"loss.{name}=-1.0" in m for m in p), list(p)
    zero = type("C", (), {"loss": LossConfig(**{t.name: 0.0 for t in TERMS})})()
    p = _Problems()
    _loss_problems(zero, p)  # type: ignore[arg-type]
    assert any("nothing to train" in m and "loss.ce=1.0" in m for m in p), list(p)
