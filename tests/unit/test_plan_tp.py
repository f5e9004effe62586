"""The planner for targets bigger than one GPU: mixture-of-experts FLOPs from active parameters and
memory from all experts, tensor-parallel replicas (memory per rank, all-reduce bytes, time), N x k : M
splits with their placement on nodes, and the shipped 70B / 235B experiments, by hand."""

from __future__ import annotations

import pytest

from dflash.cli import compose_config
from dflash.config import Config, GpuSpec, LossConfig, TargetShape, register_configs
from dflash.drafter.model import DrafterArch
from dflash.plan.app import plan_config, run
from dflash.plan.gpus import resolve_inputs
from dflash.plan.planner import make_plan
from dflash.plan.tables import override
from dflash.plan.throughput import RoleTimes, disaggregated, placement, role_times
from dflash.sizing.costs import PacketShape, packet_costs, target_rank_flop, tp_bytes_per_token
from dflash.sizing.memory import GIB, target_memory, target_rank_params
from dflash.targets.families import active_params as target_active_params
from dflash.targets.families import num_params as target_num_params
from dflash.targets.tp import TpLayout

MOE = TargetShape(
    num_layers=2,
    hidden_size=8,
    intermediate_size=16,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    vocab_size=10,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=6,
    shared_expert_intermediate_size=3,
)
EP2 = TpLayout(2, frozenset({"attention", "experts", "embedding", "lm_head"}), "ep")


def _config(overrides: list[str]) -> Config:
    register_configs()
    return plan_config(compose_config("plan_app", overrides))


def _arch(hidden: int) -> DrafterArch:
    return DrafterArch(
        hidden_size=hidden,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        vocab_size=10,
        target_layer_ids=[0, 1],
        block_size=4,
        mask_token_id=0,
    )


def test_moe_flops_come_from_active_parameters_and_memory_from_all_experts():
    packet = PacketShape(tokens=6, num_seqs=2, num_anchors=2, anchor_context=1.0)
    c = packet_costs(
        MOE, _arch(8), packet, LossConfig(), target_attention="sparse", drafter_attention="sparse"
    )
    # per token and layer: q/k/v 2*8*(2*4 + 2*1*4) = 256, o 2*8*8 = 128, attention 4*2*4 * (3+1)/2 = 64,
    # router 2*8*4 = 64, 2 active experts 2*6*8*6 = 576, shared expert 6*8*3 + 2*8 = 160: 1248
    assert c.target_flop == 2 * 6 * 1248 and c.target_attention_flop == 2 * 6 * 64
    assert c.target_flop_by_part["experts"] == 2 * 6 * 576 and c.target_flop_by_part["mlp"] == 0
    # parameters per layer: attention 8*(8 + 8) + 8*8 = 192, 4 experts 4*3*8*6 = 576, router 32,
    # shared 3*8*3 + 8 = 80; 2 layers + embedding 80 + lm_head 80
    assert target_num_params(MOE) == 2 * (192 + 576 + 32 + 80) + 160
    assert target_active_params(MOE) == 2 * (192 + 2 * 3 * 8 * 6 + 32 + 80)


def test_a_tp_rank_holds_its_split_parts_and_sends_its_all_reduces():
    # EP over 2 ranks: attention, experts, embedding and lm_head halved; router and shared expert whole
    assert target_rank_params(MOE, EP2) == (2 * 192 + 2 * 576 + 80 + 80) / 2 + 2 * 32 + 2 * 80
    packet = PacketShape(tokens=6, num_seqs=2, num_anchors=2)
    mem = target_memory(MOE, packet, 2, attention="sparse", max_in_flight=1, dtypes=_dtypes(), layout=EP2)
    assert mem["weights"] == pytest.approx(target_rank_params(MOE, EP2) * 2 / GIB)
    # the tap buffer (6 tokens x 2 taps x 8) and the larger layer working set per token: the MoE MLP's
    # 4*8 + 3*2*6/2 (experts halved) + 3*3 (shared) + 4 (router logits), above attention's
    # 3*8 + (3*8 + 4)/2 (q, the repeated k and v, and k, halved); 2 bytes each
    assert mem["activations"] == pytest.approx((6 * 2 * 8 + 6 * (32 + 18 + 9 + 4)) * 2 / GIB)
    # all-reduces of [T, H]: attention and experts in both layers, the embedding once = 5, each
    # sending 2*(2-1)/2 * 8 * 2 bytes per token
    assert tp_bytes_per_token(MOE, EP2, 2) == {"all_reduce": 5 * 16.0, "gather": 0.0}
    c = packet_costs(
        MOE, _arch(8), packet, LossConfig(), target_attention="sparse", drafter_attention="sparse"
    )
    by_part = c.target_flop_by_part
    expected = (by_part["attention"] + by_part["experts"]) / 2 + by_part["router"] + by_part["shared_expert"]
    assert target_rank_flop(by_part, EP2) == pytest.approx(expected)
    gpu = _gpu()
    times = role_times(
        c,
        gpu,
        mfu_target=0.5,
        mfu_drafter=0.5,
        drafter_params=0,
        grad_accum_steps=1,
        replicas={2: (EP2, 2e9)},
    )
    # the rank's FLOPs at half of 100 TFLOP/s, 2 GB over half of 400 GB/s
    assert times.replica_s[2] == pytest.approx(expected / 50e12 + 2e9 / 200e9)


def _dtypes():
    from dflash.sizing.memory import RunDtypes

    return RunDtypes(target_bytes=2)


def _gpu(**kw) -> GpuSpec:
    base = dict(
        name="g", bf16_tflops=100.0, hbm_gb=80.0, hbm_tbps=2.0, nvlink_gbps=400.0, internode_gbps=50.0
    )
    return GpuSpec(**{**base, **kw})


def test_replica_splits_use_n_times_k_plus_m_gpus_and_stay_inside_nodes():
    times = RoleTimes(
        target_s=4.0,
        drafter_s=1.0,
        mfu_target=0.4,
        mfu_drafter=0.4,
        mfu_delta_rule=0.4,
        drafter_params=0,
        grad_accum_steps=1,
        replica_s={4: 1.25},
    )
    s = disaggregated(times, 10**6, _gpu(), 16, 3, True, target_tp=4)
    # 3 replicas of 4 GPUs and 4 drafters: min(3 / 1.25, 4 / 1.0) = 2.4 packets/s, target-bound
    assert (s.label, s.num_drafters, s.world_size, s.bound) == ("3x4:4", 4, 16, "targets")
    assert s.packets_per_s == pytest.approx(2.4)
    assert placement(s, 8) == [
        "node 0: GPUs 0-3 replica 0, GPUs 4-7 replica 1",
        "node 1: GPUs 0-3 replica 2, GPUs 4-7 drafters",
    ]
    assert override(s) == "topology.num_targets=3 topology.target_tp=4 topology.num_drafters=4"
    one = disaggregated(times, 10**6, _gpu(), 8, 5, True)
    assert one.label == "5:3" and placement(one, 8) == ["node 0: GPUs 0-4 targets, GPUs 5-7 drafters"]


def test_llama3_70b_on_8_h200s_by_hand():
    """141 GB of bf16 weights fit no H200; TP=2 halves every matrix (the Llama plan splits heads, MLP,
    embedding and lm_head); the replica's time is half the FLOPs plus 161 all-reduces of [T, H]."""
    cfg = _config(["experiment=llama3_70b_8gpu", "plan.gpu=h200", "plan.world_size=8"])
    inputs = resolve_inputs(cfg)
    plan = make_plan(cfg, inputs)
    shape = inputs.target.meta
    assert 70.5e9 < target_num_params(shape) < 70.6e9
    assert not plan.fits["target"] and sorted(plan.layouts) == [2, 4]  # 8 would leave no drafter
    assert plan.replica_memory[2]["weights"] == pytest.approx(target_num_params(shape) / 2 * 2 / GIB)
    tokens = inputs.packet.tokens
    sent = (2 * 80 + 1) * 1 * tokens * 8192 * 2  # 2*(k-1)/k = 1 for k = 2
    assert plan.tp_bytes_per_packet[2]["all_reduce"] == pytest.approx(sent)
    peak = 989e12 * 0.4
    assert plan.times.replica_s[2] == pytest.approx(plan.costs.target_flop / 2 / peak + sent / 450e9)
    assert plan.best is plan.configured and plan.best.label == "2x2:4" and plan.best.fits
    assert all(not s.fits for s in plan.splits if s.target_tp == 1)


def test_qwen3_235b_on_16_h200s_by_hand():
    """All 128 experts in memory, 8 per token in the FLOPs; 4 KV heads cap a replica at 4 GPUs."""
    cfg = _config(["experiment=qwen3_235b_a22b_16gpu", "plan.gpu=h200", "plan.world_size=16"])
    inputs = resolve_inputs(cfg)
    plan = make_plan(cfg, inputs)
    shape = inputs.target.meta
    assert 235.0e9 < target_num_params(shape) < 235.2e9 and 20.9e9 < target_active_params(shape) < 21.0e9
    assert sorted(plan.layouts) == [2, 4] and plan.layouts[4].experts == "ep"
    assert not plan.replica_fits[2] and plan.replica_fits[4]
    layers, h = 94, 4096
    router = layers * h * 128
    assert plan.replica_memory[4]["weights"] == pytest.approx(
        ((target_num_params(shape) - router) / 4 + router) * 2 / GIB
    )
    # per token and layer: attention 2*4096*(64*128 + 2*4*128) + 2*64*128*4096, 8 experts 8*6*4096*1536
    per_token = layers * (2 * h * (8192 + 1024) + 2 * 8192 * h + 8 * 6 * h * 1536 + 2 * h * 128)
    t = inputs.packet.tokens
    assert plan.costs.target_flop - plan.costs.target_attention_flop == pytest.approx(per_token * t)
    assert plan.best is plan.configured and plan.best.label == "2x4:8"
    assert placement(plan.best, 8) == [
        "node 0: GPUs 0-3 replica 0, GPUs 4-7 replica 1",
        "node 1: GPUs 0-7 drafters",
    ]


def test_the_app_prints_the_replica_override(capsys):
    register_configs()
    out = run(
        compose_config("plan_app", ["experiment=llama3_70b_8gpu", "plan.world_size=8", "plan.gpu=h200"])
    )
    text = capsys.readouterr().out
    assert (out["num_targets"], out["target_tp"], out["num_drafters"]) == (2, 2, 4)
    assert "topology.num_targets=2 topology.target_tp=2 topology.num_drafters=4" in text
    assert "node 0: GPUs 0-1 replica 0, GPUs 2-3 replica 1, GPUs 4-7 drafters" in text
    assert "tensor-parallel replicas fit: topology.target_tp=2" in text
