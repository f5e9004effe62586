"""The planner refuses figures no GPU or run has (issue 43, item 1): NaN, infinite or negative GPU
figures, memory not above the reserve, a packet that cannot hold the longest sample, a bad sample
count, each in one line naming the field; a plan's JSON line holds no NaN, infinite or negative
number; when nothing fits, no split is recommended and no launch line is printed.

Before: ``plan.gpu_spec.bf16_tflops=nan`` recommended "1:7 ... nan samples/s" with a launch line and
JSON ``NaN``; ``hbm_tbps=-4.8`` made the plan faster; ``hbm_gb=0`` printed a launch line with every
role DOES NOT FIT; ``data.token_budget=1`` priced a whole sample in a 1-token packet."""

from __future__ import annotations

import math

import pytest

from dflash.cli import compose_config
from dflash.config import UserError, register_configs
from dflash.plan.app import plan_config, run

BASE = ["experiment=qwen3_8b_8gpu", "plan.world_size=8", "plan.gpu=h200"]


def _compose(*more: str):
    register_configs()
    return compose_config("plan_app", [*BASE, *more])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "plan.gpu_spec.bf16_tflops=nan",
            "plan.gpu_spec.bf16_tflops=nan (plan.gpu=h200): must be a finite number > 0",
        ),
        (
            "plan.gpu_spec.bf16_tflops=inf",
            "plan.gpu_spec.bf16_tflops=inf (plan.gpu=h200): must be a finite number > 0",
        ),
        (
            "plan.gpu_spec.hbm_tbps=-4.8",
            "plan.gpu_spec.hbm_tbps=-4.8 (plan.gpu=h200): must be a finite number > 0",
        ),
        (
            "plan.gpu_spec.pcie_gbps=-1",
            "plan.gpu_spec.pcie_gbps=-1.0 (plan.gpu=h200): must be a finite number >= 0",
        ),
        (
            "plan.gpu_spec.gpus_per_node=0",
            "plan.gpu_spec.gpus_per_node=0 (plan.gpu=h200): must be a finite number >= 1",
        ),
        ("plan.gpu_spec.hbm_gb=0", "plan.gpu_spec.hbm_gb=0.0 (plan.gpu=h200): 0.0 GiB leaves nothing above"),
        ("plan.gpu_spec.hbm_gb=4", "plan.gpu_spec.hbm_gb=4.0 (plan.gpu=h200): 3.7 GiB leaves nothing above"),
        ("plan.reserved_gib=inf", "plan.reserved_gib=inf: must be a finite number >= 0"),
        ("plan.num_samples=0", "plan.num_samples=0: must be >= 1 or null"),
        (
            "data.token_budget=1",
            "data.token_budget=1: a packet must hold at least one sample, and the planned ones have 1024 tokens",
        ),
        (
            "data.token_budget=512",
            "data.token_budget=512: a packet must hold at least one sample, and the planned ones have 1024 tokens",
        ),
    ],
)
def test_an_impossible_figure_is_refused_in_one_line_naming_the_field(override, needle):
    with pytest.raises(UserError) as err:
        plan_config(_compose(override))
    assert str(err.value).startswith(needle), str(err.value)
    assert "\n" not in str(err.value)


def bad_numbers(value: object, where: str = "") -> list[str]:
    """The paths of every NaN, infinite or negative number in a JSON value."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in bad_numbers(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in bad_numbers(v, f"{where}[{i}]")]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return []
    return [where] if not math.isfinite(value) or value < 0 else []


def test_the_json_check_catches_an_injected_nan():
    assert bad_numbers({"a": 1.0, "b": [2, {"c": float("nan")}], "d": -1, "e": True}) == ["b[1].c", "d"]


@pytest.mark.parametrize(
    "overrides",
    [[], ["experiment=qwen3_6_27b_rtx6000"], ["plan.gpu=h100", "drafter.max_anchors_per_packet=16384"]],
    ids=["qwen3_8b", "rtx6000", "h100-cut"],
)
def test_a_plans_json_line_has_only_finite_non_negative_numbers(overrides, capsys):
    out = run(_compose(*overrides))
    capsys.readouterr()
    assert out["recommended"] and bad_numbers(out) == []


def test_nothing_fits_recommends_nothing_and_prints_no_launch_line(capsys):
    out = run(_compose("plan.gpu_spec.hbm_gb=8"))  # 7.5 GiB, 3.5 above the reserve: no role fits
    text = capsys.readouterr().out
    assert not out["recommended"] and not any(out["fits"].values())
    assert "Nothing fits 8 x NVIDIA H200" in text and "no split is recommended" in text
    assert "torchrun" not in text and not [ln for ln in text.splitlines() if ln.startswith("Recommended")]


def test_a_drafter_the_eval_copy_pushes_over_is_told_that_cause_and_its_lever(capsys):
    """With ``eval.every`` each drafter holds the whole target to verify with (50.1 GiB of Qwen3.6-27B
    on a 96 GB card): the configured run's fix names it and ``eval.every=0``, not sharding alone."""
    out = run(_compose("experiment=qwen3_6_27b_rtx6000", "plan.gpu=rtx_pro_6000", "eval.every=500"))
    text = capsys.readouterr().out
    assert out["memory_gib"]["drafter"] <= 85.4 and not out["configured_fits"]["drafter"]
    fix = out["fits_with"]["drafter"]
    assert "50.1 GiB of it is the periodic eval's copy of the target (eval.every=500)" in fix
    assert "set eval.every=0" in fix and f"To fit a drafter as configured: {fix}" in text
