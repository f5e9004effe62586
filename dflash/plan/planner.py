"""The plan of one config: per-packet costs, memory per role, every N:M split (with target replicas
of one or more GPUs) and the co-located mode."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash.config import Config, GpuSpec, TargetShape
from dflash.config.modes import layout_of, mode_of
from dflash.plan.links import link_for
from dflash.plan.nccl import nccl_gib_per_role
from dflash.plan.throughput import (
    RoleTimes,
    Split,
    best_split,
    colocated,
    disaggregated,
    muon_flop,
    role_times,
)
from dflash.sizing.costs import AttentionKind, PacketCosts, PacketShape, packet_costs, tp_bytes_per_token
from dflash.sizing.fit import (
    MAX_AUTO_CHUNKS,
    CheckpointDecision,
    ChunkDecision,
    LeverDecisions,
    decide_levers,
    drafter_role,
    gpu_capacity_gib,
    role_memory,
)
from dflash.sizing.inputs import VERIFIER_METRICS, PlanInputs, plan_device
from dflash.sizing.memory import PLAIN, DrafterSettings, drafter_num_params, target_memory
from dflash.sizing.packets import computed_blocks
from dflash.targets.tp import TpLayout, shape_layout, tp_shape_problems

if TYPE_CHECKING:
    from dflash.drafter.arch import DrafterArch

ROLES = ("target", "drafter", "colocated")
FIT_HINTS = {
    "target": "lower data.token_budget (activations and a dense mask grow with it) or use a larger GPU",
    "drafter": "lower drafter.max_anchors_per_packet (activations grow with the blocks per packet)",
    "colocated": "lower drafter.max_anchors_per_packet, or (2+ GPUs) run disaggregated",
}


def fit_hint(role: str, settings: DrafterSettings, chunks_set: bool = False) -> str:
    """What to change when ``role`` does not fit: the drafter's levers not yet in use (``chunks_set``:
    ``drafter.block_chunks`` is a set count, not auto), then FIT_HINTS."""
    if role == "target":
        return FIT_HINTS[role]
    levers = []
    if not settings.checkpoint and chunks_set and settings.block_chunks < MAX_AUTO_CHUNKS:
        levers.append("drafter.block_chunks=null (auto: the fewest chunks that fit)")
    elif not settings.checkpoint:
        levers.append("drafter.activation_checkpointing=layers")
    if settings.shard != "full" and (role == "colocated" or settings.num_drafters > 1):
        levers.append("drafter.shard=full")
    return f"set {' and '.join(levers)}, or {FIT_HINTS[role]}" if levers else FIT_HINTS[role]


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    costs: PacketCosts
    memory: dict[str, dict[str, float]]
    """GiB by item for each of :data:`ROLES` (the target on one GPU)."""
    capacity_gib: float
    """What one GPU offers to tensors: HBM minus ``plan.reserved_gib``."""
    levers: LeverDecisions
    """The drafter's memory levers the estimates assume (``auto`` block chunks and checkpointing resolved)."""
    colocated_levers: LeverDecisions
    """The co-located rank's levers (its memory row and split; :attr:`levers` when it is the
    config's role)."""
    fits: dict[str, bool]
    """Whether each role's memory fits ``capacity_gib`` (the target on one GPU)."""
    times: RoleTimes
    splits: list[Split]
    """Every split of the world: N:M (N = 1 .. W-1) and, for each tensor-parallel degree k of
    :attr:`layouts`, N replicas of k GPUs and the M = W - N*k drafters left."""
    colocated: Split
    best: Split
    """The fastest disaggregated split (that fits, when any does); on one GPU the co-located mode."""
    configured: Split | None
    """The config's own topology, when it uses the whole world."""
    world_size: int
    general_warnings: list[str]
    """What the plan warns of whatever mode runs (target.shape against config.json, dense attention,
    NCCL's buffers)."""
    fit_warnings: dict[str, str]
    """Per role of :data:`ROLES` that fits no GPU: the warning, with its fix."""
    layouts: dict[int, TpLayout]
    """Tensor-parallel degrees k > 1 the target can use on this GPU (k divides gpus_per_node and
    the plan can split the shape k ways), with what a rank holds."""
    replica_memory: dict[int, dict[str, float]]
    """GiB by item on one rank of a k-GPU replica, by k (1: ``memory["target"]``)."""
    replica_fits: dict[int, bool]
    tp_bytes_per_packet: dict[int, dict[str, float]]
    """Bytes one rank of a k-GPU replica sends per packet (``all_reduce``, ``gather``), by k."""
    nccl_gib: dict[str, float]
    """Estimated GiB of NCCL buffers per rank of each role of the configured (else the recommended)
    split (:mod:`dflash.plan.nccl`), inside ``plan.reserved_gib``."""

    @property
    def settings(self) -> DrafterSettings:
        return self.levers.settings

    @property
    def checkpointing(self) -> CheckpointDecision:
        return self.levers.checkpointing

    @property
    def chunking(self) -> ChunkDecision:
        return self.levers.chunking

    @property
    def mode(self) -> str:
        """``colocated`` when it fits and beats the best split (or no split fits), or on one GPU; else
        ``disaggregated``."""
        if self.best is self.colocated:
            return "colocated"
        if self.colocated.fits and (
            not self.best.fits or self.colocated.packets_per_s > self.best.packets_per_s
        ):
            return "colocated"
        return "disaggregated"

    @property
    def warnings(self) -> list[str]:
        """Every warning: the general ones, then each role's that does not fit."""
        return self.general_warnings + list(self.fit_warnings.values())

    def warnings_for(self, mode: str) -> list[str]:
        """The general warnings and those of the roles ``mode`` (``disaggregated`` or ``colocated``) runs."""
        roles = ("colocated",) if mode == "colocated" else ("target", "drafter")
        return self.general_warnings + [w for r, w in self.fit_warnings.items() if r in roles]

    @property
    def gpu(self) -> GpuSpec:
        assert self.inputs.gpu is not None, "a plan needs plan.gpu (dflash.sizing.inputs.resolve_inputs)"
        return self.inputs.gpu

    @property
    def samples_per_packet(self) -> float:
        """Samples per packet over one epoch of the data plan (:class:`dflash.sizing.packets.PacketMix`)."""
        return self.inputs.packets.mix.samples

    @property
    def anchors_per_packet(self) -> float:
        """Anchors trained per packet over the epoch (after ``drafter.max_anchors_per_packet``)."""
        return self.inputs.packets.mix.trained

    @property
    def slots_per_packet(self) -> float:
        """Supervised block slots per packet over the epoch: the training signal of a packet."""
        return self.inputs.packets.mix.slots


def step_extra_flop(costs: PacketCosts, drafter: DrafterArch, settings: DrafterSettings) -> float:
    """FLOPs a drafter step runs beyond the packet's costs with ``settings``: checkpointed layers their
    forward again (a third of their forward + backward); ``n`` block chunks the verifier logits of the
    up to ``bs - 1`` positions a chunk shares with the one before (``(n - 1)(bs - 1)`` rows of ``2HV``)."""
    recompute = costs.drafter_layers_flop / 3 if settings.checkpoint else 0.0
    shared = (settings.block_chunks - 1) * (drafter.block_size - 1)
    verifier = 2 * shared * drafter.hidden_size * drafter.vocab_size
    return recompute + (verifier if costs.drafter_loss_flop["verifier_logits"] > 0 else 0.0)


def tp_layouts(target: TargetShape, gpu: GpuSpec, world_size: int) -> dict[int, TpLayout]:
    """The tensor-parallel degrees ``k > 1`` a replica of ``target`` can use: ``k`` divides the GPUs
    of a node (a replica stays inside one), leaves a GPU for a drafter, and the model's transformers
    plan can split the shape ``k`` ways (:func:`dflash.targets.tp.tp_shape_problems`)."""
    out = {}
    for k in range(2, min(gpu.gpus_per_node, world_size - 1) + 1):
        if gpu.gpus_per_node % k:
            continue
        if not tp_shape_problems(target, k):
            out[k] = shape_layout(target, k)
    return out


def _replicas(
    cfg: Config, inputs: PlanInputs, costs: PacketCosts, layouts: dict[int, TpLayout]
) -> tuple[dict[int, dict[str, float]], dict[int, tuple[TpLayout, float]], dict[int, dict[str, float]]]:
    """Memory of one replica rank, ``(its layout, bytes one rank sends)`` per packet, and those bytes
    by kind."""
    memory: dict[int, dict[str, float]] = {}
    work: dict[int, tuple[TpLayout, float]] = {}
    sent: dict[int, dict[str, float]] = {}
    shape, tokens = inputs.target.meta, inputs.packet.target_tokens or inputs.packet.tokens
    for k, layout in layouts.items():
        memory[k] = target_memory(
            shape,
            inputs.packet,
            inputs.arch.num_taps,
            attention=inputs.target_attention,
            max_in_flight=cfg.topology.max_in_flight,
            dtypes=inputs.dtypes,
            layout=layout,
        )
        sent[k] = {
            kind: b * tokens
            for kind, b in tp_bytes_per_token(shape, layout, inputs.dtypes.target_bytes).items()
        }
        work[k] = (layout, float(sum(sent[k].values())))
    return memory, work, sent


def _warnings(
    plan_fits: dict[str, bool],
    replica_fits: dict[int, bool],
    need: dict[str, float],
    capacity: float,
    cfg: Config,
    gpu: GpuSpec,
    world: int,
    settings: DrafterSettings,
    colocated_settings: DrafterSettings,
    memory: dict[str, dict[str, float]],
) -> dict[str, str]:
    """A warning for every role that fits no GPU (the target: on one GPU, naming the replicas that fit;
    a drafter that the periodic eval's copy of the target pushes over: that cause and its lever first)."""
    warnings = {}
    for role in ROLES if world > 1 else ("colocated",):
        if plan_fits[role]:
            continue
        role_settings = colocated_settings if role == "colocated" else settings
        hint = fit_hint(role, role_settings, cfg.drafter.block_chunks is not None)
        copy = memory[role].get("eval_target", 0.0)
        if copy > 0 and need[role] - copy <= capacity:
            hint = (
                f"{copy:.1f} GiB of it is the periodic eval's copy of the whole target (eval.every="
                f"{cfg.eval.every}), without which it fits: set eval.every=0 and evaluate the export with "
                f"dflash.eval where the target fits; else {hint}"
            )
        if role == "target":
            fitting = [k for k, ok in replica_fits.items() if ok and k > 1]
            hint = (
                f"tensor-parallel replicas fit: topology.target_tp={fitting[0]} (the splits NxK use them)"
                if fitting
                else hint + ", or tensor-parallel replicas (topology.target_tp): none fits either"
            )
        warnings[role] = (
            f"{role} does not fit one GPU: {need[role]:.1f} GiB needed, {capacity:.1f} GiB available on "
            f"{gpu.name} ({gpu.hbm_gb:g} GB minus plan.reserved_gib={cfg.plan.reserved_gib:g}); {hint}"
        )
    return warnings


def _cross_document_flop(cfg: Config, inputs: PlanInputs, costs: PacketCosts) -> float:
    """Target FLOPs per packet spent on pairs of different documents: a packed row under a kernel
    that computes every pair of the row (SDPA with a mask, on a GPU without flash-attn for a model
    transformers runs without flex), else 0."""
    if not (cfg.target.pack and inputs.target_attention == "dense" and plan_device(cfg) == "cuda"):
        return 0.0
    return costs.target_flop - _costs(cfg, inputs, "sparse", PLAIN).target_flop


def computed_mean_packet(inputs: PlanInputs, settings: DrafterSettings) -> PacketShape:
    """The epoch's mean packet with the blocks a static shape makes the drafter compute with
    ``settings`` (:func:`dflash.sizing.packets.computed_blocks`)."""
    mean = inputs.packets.mean
    if mean.drafter_blocks is None:
        return mean
    blocks = computed_blocks(
        inputs.packets.mix, mean.drafter_blocks, settings.block_chunks, not settings.sharded
    )
    return dataclasses.replace(mean, drafter_blocks=max(1, round(blocks)))


def _costs(
    cfg: Config, inputs: PlanInputs, target_attention: AttentionKind, settings: DrafterSettings
) -> PacketCosts:
    """The target's FLOPs on its packet of the most work; the drafter's and the wire's on the epoch's
    mean packet (:class:`dflash.sizing.packets.Packets`), whose blocks under a static shape are what the
    step computes with ``settings`` (:func:`dflash.sizing.packets.computed_blocks`)."""

    def of(packet: PacketShape) -> PacketCosts:
        return packet_costs(
            inputs.target.meta,
            inputs.arch,
            packet,
            cfg.loss,
            target_attention=target_attention,
            drafter_attention=inputs.drafter_attention,
            verifier_metrics=VERIFIER_METRICS,
            hidden_dtype_bytes=inputs.dtypes.target_bytes,
        )

    packets = inputs.packets
    mean_packet = computed_mean_packet(inputs, settings)
    mean = of(mean_packet)
    if mean_packet is packets.target:
        return mean
    target = of(packets.target)
    return dataclasses.replace(
        mean,
        target_flop=target.target_flop,
        target_attention_flop=target.target_attention_flop,
        target_flop_by_part=target.target_flop_by_part,
    )


CUDA_CONTEXT_GIB = 0.5
"""The CUDA context and cuBLAS workspaces per process, roughly (the rest of ``plan.reserved_gib``)."""


def _reserve_warnings(nccl: dict[str, float], reserved_gib: float) -> list[str]:
    """A warning when NCCL's estimated buffers and the CUDA context exceed ``plan.reserved_gib``."""
    role, gib = max(nccl.items(), key=lambda kv: kv[1])
    if gib + CUDA_CONTEXT_GIB <= reserved_gib:
        return []
    return [
        f"a {role} rank's NCCL buffers (~{gib:.1f} GiB estimated) and CUDA context (~{CUDA_CONTEXT_GIB:g} GiB) "
        f"exceed plan.reserved_gib={reserved_gib:g}: raise it to {gib + CUDA_CONTEXT_GIB + 1:.0f} so the plan "
        "keeps them out of the tensors' share (make gpu-check reports the real figure)"
    ]


def _dense_attention_warning(costs: PacketCosts, cross: float) -> str:
    return (
        f"the target's attention computes every pair of the packed row (target.attn_implementation resolves "
        f"to sdpa with a mask): {cross / 1e12:.0f} of its {costs.target_flop / 1e12:.0f} TFLOP per packet "
        "go to pairs of tokens from different documents; install flash-attn on the GPU hosts (auto then picks "
        "flash_attention_2) or set target.pack=false (padded rows, length-bucketed by the data plan)"
    )


def make_plan(cfg: Config, inputs: PlanInputs) -> Plan:
    """Costs, memory and throughput of ``cfg`` on ``plan.world_size`` GPUs of ``plan.gpu``."""
    p, world = cfg.plan, cfg.plan.world_size
    gpu = inputs.gpu
    assert gpu is not None, "make_plan needs plan.gpu (dflash.sizing.inputs.resolve_inputs)"
    capacity = gpu_capacity_gib(gpu, p.reserved_gib)
    # one GPU runs the co-located mode whatever the topology says (the plan's one-GPU table)
    role = "colocated" if world == 1 else drafter_role(cfg)
    levers = decide_levers(cfg, inputs, capacity, world, role)
    # the co-located mode's rank holds the target too: its own levers (the trainer decides per role)
    co_levers = levers if role == "colocated" else decide_levers(cfg, inputs, capacity, world, "colocated")
    settings = levers.settings
    costs = _costs(cfg, inputs, inputs.target_attention, settings)
    memory = role_memory(cfg, inputs, settings)
    if co_levers is not levers:
        memory["colocated"] = role_memory(cfg, inputs, co_levers.settings)["colocated"]
    fits = {role: sum(memory[role].values()) <= capacity for role in ROLES}
    layouts = tp_layouts(inputs.target.meta, gpu, world)
    replica_memory, work, sent = _replicas(cfg, inputs, costs, layouts)
    replica_fits = {1: fits["target"], **{k: sum(m.values()) <= capacity for k, m in replica_memory.items()}}

    def times_with(s: DrafterSettings) -> RoleTimes:
        c = costs if s == settings else _costs(cfg, inputs, inputs.target_attention, s)
        return role_times(
            c,
            gpu,
            mfu_target=p.mfu_target,
            mfu_drafter=p.mfu_drafter,
            mfu_delta_rule=p.mfu_delta_rule,
            drafter_params=drafter_num_params(inputs.arch),
            grad_accum_steps=cfg.optim.grad_accum_steps,
            replicas=work,
            extra_flop=step_extra_flop(c, inputs.arch, s),
            optimizer=str(cfg.optim.name),
            update_flop=muon_flop(inputs.arch, cfg.optim.muon_ns_steps) if cfg.optim.name == "muon" else 0.0,
        )

    times = times_with(settings)
    splits = [
        disaggregated(times, costs.payload_bytes, gpu, world, n, replica_fits[k] and fits["drafter"], k)
        for k in (1, *layouts)
        for n in range(1, (world - 1) // k + 1)
    ]
    co = colocated(
        times if co_levers is levers else times_with(co_levers.settings), gpu, world, fits["colocated"]
    )
    t = cfg.topology
    layout = layout_of(t, world, min(world, gpu.gpus_per_node))
    configured = (
        co
        if mode_of(t).self_produced
        else next(
            (
                s
                for s in splits
                if (s.num_targets, s.num_drafters, s.target_tp)
                == (layout.num_targets, layout.num_drafters, layout.target_tp)
            ),
            None,
        )
    )
    need = {role: sum(memory[role].values()) for role in ROLES}
    cross = _cross_document_flop(cfg, inputs, costs)
    best = best_split(splits) if splits else co
    shown = configured or best
    nccl = nccl_gib_per_role(
        link_for(gpu, world),
        num_targets=shown.num_targets,
        num_drafters=shown.num_drafters,
        target_tp=shown.target_tp,
        colocated=shown.mode == "colocated",
    )
    return Plan(
        inputs=inputs,
        costs=costs,
        memory=memory,
        capacity_gib=capacity,
        levers=levers,
        colocated_levers=co_levers,
        fits=fits,
        times=times,
        splits=splits,
        colocated=co,
        best=best,
        configured=configured,
        world_size=world,
        general_warnings=list(inputs.target.problems)
        + ([_dense_attention_warning(costs, cross)] if cross > 0.05 * costs.target_flop else [])
        + _reserve_warnings(nccl, p.reserved_gib),
        fit_warnings=_warnings(
            fits, replica_fits, need, capacity, cfg, gpu, world, settings, co_levers.settings, memory
        ),
        layouts=layouts,
        replica_memory={1: memory["target"], **replica_memory},
        replica_fits=replica_fits,
        tp_bytes_per_packet=sent,
        nccl_gib=nccl,
    )
