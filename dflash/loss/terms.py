"""The drafter's loss terms: one record per term, read by every place that knows of terms.

A term is a per-row loss of the drafter logits ``z_d`` of one supervised slot. Its value is a
formula over the quantities the chunked loss's row-block math computes anyway
(:mod:`dflash.loss.kernels`):

- ``lse_d1``: the drafter log-sum-exp at temperature 1 (its softmax ``q_1`` is formed);
- ``zlab`` / ``zav``: the drafter logit at the data label / at the verifier argmax;
- ``kl``: ``T^2 * KL(p_T || q_T)`` against the verifier distribution at temperature ``T``;

and its gradient with respect to ``z_d`` a combination of the basis the kernel forms in place:
``q_1`` (coefficient :attr:`LossTerm.q1`), ``T * (q_T - p_T)`` (:attr:`LossTerm.kl_basis`) and a
``-1`` at one index per row (:attr:`LossTerm.onehot`: the label or the verifier argmax). The loss is
``sum_r w_r sum_t c_t term_t(r) / N`` with the coefficients ``c_t`` of ``loss.<name>``.

Who reads the records: the config checks (every ``LossConfig`` field tagged :data:`TERM_FIELD`),
:func:`dflash.loss.verifier.verifier_loss` (coefficients, values, gradient basis), the objective's
metric sums (:data:`TERMS` order), the planner (:func:`needs_verifier_logits`: the verifier GEMM)
and the report (:func:`metric_keys`). A new term is a record here and its ``LossConfig`` field
(docs/extending.md); a gradient outside the basis also needs its math in ``kernels.py``. Pure
Python: no torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

QUANTITIES = ("lse_d1", "zlab", "zav", "kl")
"""What the row-block math computes per row (module docstring)."""


@dataclass(frozen=True)
class LossTerm:
    name: str
    """``loss.<name>`` (its coefficient), the keyword of ``verifier_loss``, ``train/loss_<name>``."""
    summary: str
    default: float
    """The coefficient when ``loss.<name>`` is not set (``LossConfig``'s default)."""
    needs: frozenset[str]
    """Row quantities its value reads (:data:`QUANTITIES`)."""
    value: Callable[[Mapping[str, Any]], Any]
    """Per-row value from the quantities (a mapping name -> ``[S]`` tensor)."""
    needs_verifier: bool
    """It needs the verifier logits (a verifier GEMM per distinct position the rows read)."""
    q1: float = 0.0
    """Coefficient of ``q_1`` in d(term)/d(z_d)."""
    kl_basis: float = 0.0
    """Coefficient of ``T * (q_T - p_T)`` in d(term)/d(z_d)."""
    onehot: str | None = None
    """``label`` or ``verifier_argmax``: the gradient's ``-1`` at that index of each row."""

    @property
    def metric(self) -> str:
        return f"train/loss_{self.name}"


CE = LossTerm(
    name="ce",
    summary="cross-entropy with the data token",
    default=1.0,
    needs=frozenset({"lse_d1", "zlab"}),
    value=lambda q: q["lse_d1"] - q["zlab"],
    needs_verifier=False,
    q1=1.0,
    onehot="label",
)
KL = LossTerm(
    name="kl",
    summary="T^2 KL(verifier || drafter) at loss.temperature",
    default=0.0,
    needs=frozenset({"kl"}),
    value=lambda q: q["kl"],
    needs_verifier=True,
    kl_basis=1.0,
)
VERIFIER_CE = LossTerm(
    name="verifier_ce",
    summary="cross-entropy with the verifier's argmax (the target's greedy token)",
    default=0.0,
    needs=frozenset({"lse_d1", "zav"}),
    value=lambda q: q["lse_d1"] - q["zav"],
    needs_verifier=True,
    q1=1.0,
    onehot="verifier_argmax",
)
TERMS: tuple[LossTerm, ...] = (CE, KL, VERIFIER_CE)
"""Every term, in the order of the objective's ``term_sums``."""
BY_NAME: dict[str, LossTerm] = {t.name: t for t in TERMS}
TERM_FIELD = "loss_term"
"""The ``LossConfig`` field metadata key that marks a term's coefficient."""


def coefficients(loss: Any) -> dict[str, float]:
    """``name -> coefficient`` of every term from a ``LossConfig`` (or any object with the fields)."""
    return {t.name: float(getattr(loss, t.name, t.default)) for t in TERMS}


def needs_verifier_logits(coefs: Mapping[str, float], verifier_metrics: bool) -> bool:
    """Whether a step computes the verifier logits: a weighted term needs them, or the metrics
    (accuracy against the verifier argmax, tau_hat) do."""
    return verifier_metrics or any(c > 0 and BY_NAME[n].needs_verifier for n, c in coefs.items())


def metric_keys() -> tuple[str, ...]:
    return tuple(t.metric for t in TERMS)


@dataclass(frozen=True)
class GradientPlan:
    """The coefficients of the gradient basis for one call (``sum_t c_t`` over the terms)."""

    q1: float
    """``A``: coefficient of ``q_1``."""
    kl_basis: float
    """``B / T``: coefficient of ``T * (q_T - p_T)`` (the kernel multiplies by ``T``)."""
    onehots: tuple[tuple[str, float], ...]
    """``(index, coefficient)`` of every weighted term with a one-hot part."""


def gradient_plan(coefs: Mapping[str, float]) -> GradientPlan:
    """The gradient basis coefficients of a call with ``coefs`` (weighted terms only)."""
    weighted = [(BY_NAME[n], c) for n, c in coefs.items() if c > 0]
    q1 = 0.0
    kl = 0.0
    for t, c in weighted:
        if t.q1:
            q1 += c * t.q1
        if t.kl_basis:
            kl += c * t.kl_basis
    onehots = tuple((t.onehot, c) for t, c in weighted if t.onehot is not None)
    return GradientPlan(q1=q1, kl_basis=kl, onehots=onehots)


def computed_terms(available: set[str]) -> tuple[LossTerm, ...]:
    """The terms whose value the row quantities ``available`` give."""
    return tuple(t for t in TERMS if t.needs <= available)
