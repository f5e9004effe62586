"""The plan of one config: per-packet costs, memory per role, every N:M split and the co-located mode."""

from __future__ import annotations

from dataclasses import dataclass

from dflash.config import Config
from dflash.plan.costs import PacketCosts, packet_costs
from dflash.plan.inputs import VERIFIER_METRICS, PlanInputs
from dflash.plan.memory import GIB, drafter_num_params, memory_per_role
from dflash.plan.throughput import RoleTimes, Split, best_split, colocated, disaggregated, role_times

ROLES = ("target", "drafter", "colocated")
FIT_HINTS = {
    "target": "lower data.token_budget (activations and a dense mask grow with it) or use a larger GPU",
    "drafter": "lower drafter.max_anchors_per_packet (activations grow with the blocks per packet) or "
    "data.token_budget",
    "colocated": "lower drafter.max_anchors_per_packet, or (2+ GPUs) run disaggregated",
}


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    costs: PacketCosts
    memory: dict[str, dict[str, float]]
    """GiB by item for each of :data:`ROLES`."""
    capacity_gib: float
    """What one GPU offers to tensors: HBM minus ``plan.reserved_gib``."""
    fits: dict[str, bool]
    """Whether each role's memory fits ``capacity_gib``."""
    times: RoleTimes
    splits: list[Split]
    """Every N:M of the world, N = 1 .. W-1."""
    colocated: Split
    best: Split
    """The fastest disaggregated split (that fits, when any does); on one GPU the co-located mode."""
    configured: Split | None
    """The config's own topology, when it uses the whole world."""
    world_size: int
    warnings: list[str]

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
    def samples_per_packet(self) -> int:
        return self.inputs.packet.num_seqs


def make_plan(cfg: Config, inputs: PlanInputs) -> Plan:
    """Costs, memory and throughput of ``cfg`` on ``plan.world_size`` GPUs of ``plan.gpu``."""
    p, gpu, world = cfg.plan, inputs.gpu, cfg.plan.world_size
    costs = packet_costs(
        inputs.target.shape,
        inputs.arch,
        inputs.packet,
        cfg.loss,
        target_attention=inputs.target_attention,
        drafter_attention=inputs.drafter_attention,
        verifier_metrics=VERIFIER_METRICS,
        hidden_dtype_bytes=inputs.dtypes.target_bytes,
    )
    memory = memory_per_role(
        inputs.target.shape,
        inputs.arch,
        inputs.packet,
        target_attention=inputs.target_attention,
        max_in_flight=cfg.topology.max_in_flight,
        loss_chunk_rows=inputs.loss_chunk_rows,
        verifier_logits=inputs.verifier_logits,
        dtypes=inputs.dtypes,
    )
    capacity = gpu.hbm_gb * 1e9 / GIB - p.reserved_gib
    fits = {role: sum(memory[role].values()) <= capacity for role in ROLES}
    times = role_times(
        costs,
        gpu,
        mfu_target=p.mfu_target,
        mfu_drafter=p.mfu_drafter,
        drafter_params=drafter_num_params(inputs.arch),
        grad_accum_steps=cfg.optim.grad_accum_steps,
    )
    both = fits["target"] and fits["drafter"]
    splits = [disaggregated(times, costs.payload_bytes, gpu, world, n, both) for n in range(1, world)]
    co = colocated(times, gpu, world, fits["colocated"])
    t = cfg.topology
    configured = (
        co
        if t.colocated
        else next(
            (s for s in splits if (s.num_targets, s.num_drafters) == (t.num_targets, t.num_drafters)), None
        )
    )
    warnings = list(inputs.target.problems)
    for role in ROLES if world > 1 else ("colocated",):
        if not fits[role]:
            need = sum(memory[role].values())
            warnings.append(
                f"{role} does not fit: {need:.1f} GiB needed per GPU, {capacity:.1f} GiB available on "
                f"{gpu.name} ({gpu.hbm_gb:g} GB minus plan.reserved_gib={p.reserved_gib:g}); {FIT_HINTS[role]}"
            )
    return Plan(
        inputs=inputs,
        costs=costs,
        memory=memory,
        capacity_gib=capacity,
        fits=fits,
        times=times,
        splits=splits,
        colocated=co,
        best=best_split(splits) if splits else co,
        configured=configured,
        world_size=world,
        warnings=warnings,
    )
