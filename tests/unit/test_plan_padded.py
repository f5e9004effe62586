"""The planner on hybrid targets: padded rows laid out by the data plan from real lengths, and the
cost of a packed row whose attention kernel computes every pair of the row."""

from __future__ import annotations

import dataclasses

import pytest

from dflash.cli import compose_config
from dflash.config import register_configs
from dflash.plan.app import plan_config
from dflash.plan.gpus import resolve_inputs
from dflash.plan.planner import make_plan
from dflash.sizing.packets import DataStats, plan_packets

QWEN36 = ["experiment=qwen3_6_27b_7x1", "plan.world_size=8", "plan.gpu=h200", "data.token_budget=65536"]


def _cfg(overrides: list[str]):
    register_configs()
    return plan_config(compose_config("plan_app", overrides))


def test_padded_packets_come_from_the_data_plan_over_the_real_lengths():
    """The target's packet is the data plan's of the most ``rows x longest`` tokens, within the budget,
    made of the lengths given (a cache's), not of a spread around their mean; the mean packet costs
    no more than it."""
    cfg = _cfg([*QWEN36, "target.pack=false"])
    budget = cfg.data.token_budget
    short = DataStats(500.0, 0.8, "cache", lengths=(500,) * 4000)
    mixed = DataStats(500.0, 0.8, "cache", lengths=(100, 900) * 2000)
    for stats in (short, mixed):
        p = plan_packets(cfg, stats)
        assert "cache" in p.lengths
        worst = p.target.doc_lengths
        assert worst is not None and len(worst) * max(worst) <= budget
        assert p.mean.tokens <= p.mean.target_tokens <= p.target.target_tokens <= budget
    equal = plan_packets(cfg, short)
    assert equal.mean.tokens == equal.mean.target_tokens  # equal lengths: no padding
    assert set(plan_packets(cfg, mixed).target.doc_lengths or ()) <= {100, 900}
    default = plan_packets(cfg, DataStats(1000.0, 0.8, "defaults"))
    assert "lognormal" in default.lengths and default.mean.target_tokens > default.mean.tokens


def test_padded_rows_plan_the_worst_packet_and_count_the_padding():
    cfg = _cfg([*QWEN36, "target.pack=false"])
    inputs = resolve_inputs(cfg)
    assert inputs.packet.doc_lengths is not None
    assert inputs.packets.mean.target_tokens > inputs.packets.mean.tokens  # the padding is computed
    assert inputs.target_attention == "sparse"  # one document per row: SDPA is_causal
    packed = resolve_inputs(_cfg(QWEN36))
    assert packed.packet.doc_lengths is None and packed.packet.target_tokens == packed.packet.tokens


@pytest.mark.parametrize("pack", [True, False])
def test_a_packed_row_under_dense_attention_is_named_with_its_cost(pack):
    """Qwen3.5/3.6 on a GPU without flash-attn: SDPA with a mask computes every pair of a packed
    row; the plan warns with the FLOPs that go across documents. Padded rows run is_causal."""
    cfg = _cfg([*QWEN36, f"target.pack={str(pack).lower()}"])
    inputs = resolve_inputs(cfg)
    if pack and inputs.target_attention == "sparse":
        pytest.skip("flash-attn is installed: packed rows are document-masked")
    warnings = [w for w in make_plan(cfg, inputs).warnings if "every pair of the packed row" in w]
    assert bool(warnings) == pack
    if pack:
        sparse = make_plan(cfg, dataclasses.replace(inputs, target_attention="sparse"))
        assert not [w for w in sparse.warnings if "every pair" in w]
        assert "install flash-attn" in warnings[0] and "target.pack=false" in warnings[0]
