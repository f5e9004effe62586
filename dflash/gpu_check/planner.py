"""The run's training config and what the planner says of it: the GPU spec, FLOP, MFU and memory per
role (in-process: pure Python, no CUDA)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.gpu_check.figures import round_sig

if TYPE_CHECKING:
    from dflash.config import Config, GpuSpec


def training_config(overrides: list[str]) -> Config:
    """The training config of ``overrides`` (``hydra.*`` ones dropped), typed."""
    from dflash.cli import compose_config
    from dflash.config import register_configs, to_config

    register_configs()
    return to_config(compose_config("config", [o for o in overrides if not o.startswith("hydra.")]))


def find_gpu_spec(device_name: str | None, override: str | None) -> tuple[str | None, GpuSpec | None]:
    """``(name, GpuSpec)`` of ``--gpu`` or of the conf/gpu profile the device name matches
    (:func:`dflash.plan.gpus.match_profile`); ``(None, None)`` when none matches."""
    from dflash.plan.gpus import load_gpu, match_profile

    if override:
        return Path(override).stem, load_gpu(override)
    name = match_profile(device_name or "")
    return (name, load_gpu(name)) if name is not None else (None, None)


def planner_figures(
    overrides: list[str], gpu: str | None, packet: dict[str, float], t_s: float, d_s: float
) -> dict[str, Any]:
    """The planner on the run's config: FLOP per role for the measured packet, TFLOP/s and MFU from
    the measured seconds per packet, and the memory per role it predicts. With a tensor-parallel
    replica (``topology.target_tp`` > 1) the target's figures are one rank's: its share of the
    FLOPs (``target_rank_flop``; the all-reduces are not counted) and its memory (``target_rank``)."""
    from dflash.config.modes import mode_of
    from dflash.plan.gpus import resolve_inputs
    from dflash.plan.links import link_for
    from dflash.plan.planner import make_plan
    from dflash.sizing.costs import packet_costs, target_rank_flop, target_seconds
    from dflash.sizing.inputs import VERIFIER_METRICS, attention_kinds
    from dflash.targets.tp import shape_layout

    cfg = training_config([*overrides, *([f"plan.gpu={gpu}"] if gpu else [])])
    inputs = resolve_inputs(cfg)
    plan = make_plan(cfg, inputs)
    tokens = max(1, round(packet["tokens"]))
    shape = dataclasses.replace(
        inputs.packet,
        tokens=tokens,
        num_seqs=max(1, round(packet["seqs"])),
        num_anchors=round(packet["blocks"]),
        loss_rows=round(packet["supervised_slots"]),
        verifier_rows=None,  # the estimate from these anchors and tokens
        target_tokens=tokens,
        target_row_tokens=tokens if cfg.target.pack else inputs.packet.target_row_tokens,
    )
    t_kind, d_kind = attention_kinds(cfg, shape.num_seqs, inputs.target.meta.model_type)
    costs = packet_costs(
        inputs.target.meta,
        inputs.arch,
        shape,
        cfg.loss,
        target_attention=t_kind,
        drafter_attention=d_kind,
        verifier_metrics=VERIFIER_METRICS,
        hidden_dtype_bytes=inputs.dtypes.target_bytes,
    )
    peak = plan.gpu.bf16_tflops
    k = cfg.topology.target_tp
    target_flop = costs.target_flop
    if k > 1:
        layout = shape_layout(inputs.target.meta, k)
        target_flop = target_rank_flop(costs.target_flop_by_part, layout)
    out: dict[str, Any] = {
        "gpu_spec": cfg.plan.gpu,
        "bf16_peak_tflops": peak,
        "target_tflop_per_packet": round(costs.target_flop / 1e12, 4),
        "drafter_tflop_per_packet": round(costs.drafter_flop / 1e12, 4),
        "attention": {"target": t_kind, "drafter": d_kind},
        "memory_gib": {role: round_sig(sum(items.values())) for role, items in plan.memory.items()},
        "capacity_gib": round(plan.capacity_gib, 1),
    }
    if k > 1 and k in plan.replica_memory:
        out["memory_gib"]["target_rank"] = round_sig(sum(plan.replica_memory[k].values()))
        out["target_rank_tflop_per_packet"] = round(target_flop / 1e12, 4)
    for role, flop, sec in (("target", target_flop, t_s), ("drafter", costs.drafter_flop, d_s)):
        tflops = flop / sec / 1e12 if sec > 0 else 0.0
        out[f"{role}_tflops"] = round_sig(tflops)
        out[f"{role}_mfu"] = round_sig(tflops / peak)
    # What the planner expects of this packet at plan.mfu_* (0.4): co-located one GPU does both
    # roles in turn; 1 target + 1 drafter is bound by the slower role.
    t_plan = target_seconds(
        costs.target_flop_by_part,
        peak * 1e12,
        mfu_target=cfg.plan.mfu_target,
        mfu_delta_rule=cfg.plan.mfu_delta_rule,
        layout=shape_layout(inputs.target.meta, k) if k > 1 else None,
    )
    d_plan = costs.drafter_flop / (cfg.plan.mfu_drafter * peak * 1e12)
    m = cfg.topology.num_drafters or 1  # co-located: the check runs one rank
    if mode_of(cfg.topology).self_produced:  # each rank does both roles in turn
        packets_per_s = m / (t_plan + d_plan)
    else:  # N replicas and M drafters: the slower side
        packets_per_s = min(cfg.topology.num_targets / t_plan, m / d_plan)
    out["planner_s_per_packet"] = {
        "target": round_sig(t_plan),
        "drafter": round_sig(d_plan),
        "mfu": cfg.plan.mfu_drafter,
    }
    out["planner_samples_per_s"] = round_sig(packet["seqs"] * packets_per_s)
    if m > 1 and not mode_of(cfg.topology).self_produced:
        link = link_for(plan.gpu, cfg.topology.num_targets * k + m)
        out["allreduce_s"] = round_sig(
            2 * (m - 1) / m * 4 * plan.times.drafter_params / link.allreduce_bytes_per_s
        )
        out["link"] = link.kind
    return out


def probe_planner_activations(overrides: list[str], tokens: int, docs: int, num_taps: int) -> float:
    """The memory model's activations of the target's headless forward on the probe's packet (GiB)."""
    from dflash.sizing.costs import PacketShape
    from dflash.sizing.inputs import attention_kinds, planned_target, run_dtypes
    from dflash.sizing.memory import target_memory

    cfg = training_config(overrides)
    packet = PacketShape(tokens=tokens, num_seqs=docs, num_anchors=0)
    target = planned_target(cfg)
    kind = attention_kinds(cfg, docs, target.meta.model_type)[0]
    mem = target_memory(
        target.meta, packet, num_taps, attention=kind, max_in_flight=0, dtypes=run_dtypes(cfg)
    )
    return round(mem["activations"], 3)


def colocated_anchor_cap(overrides: list[str], spec: GpuSpec) -> tuple[int, int]:
    """``(cap the check trains at, the experiment's own cap)``: the experiment's
    ``drafter.max_anchors_per_packet``, or the largest one at which the co-located rank fits this
    GPU (``spec``, minus ``plan.reserved_gib``) with activation checkpointing, when that is less: the
    check runs the shipped experiment on one GPU whatever its memory (the co-located Qwen3-8B at the
    recipe's 8,192 anchors fits an H200, not an H100)."""
    from dflash.plan.gpus import resolve_inputs
    from dflash.sizing.fit import gpu_capacity_gib, largest_anchors
    from dflash.sizing.memory import DrafterSettings

    cfg = training_config([*overrides, "topology=colocated"])
    shipped = cfg.drafter.max_anchors_per_packet
    capacity = gpu_capacity_gib(spec, cfg.plan.reserved_gib)
    fits = largest_anchors(cfg, resolve_inputs(cfg), capacity, "colocated", DrafterSettings(checkpoint=True))
    return (fits if shipped is None else min(shipped, fits)), (shipped or fits)
