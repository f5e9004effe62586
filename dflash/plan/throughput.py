"""Packets per second of every way to use a world of GPUs: N:M splits and the co-located mode.

Times per packet on one GPU of peak ``P`` FLOP/s (dense BF16, from ``conf/gpu/``):

- ``t_target = (target_flop - delta_rule_flop) / (P * mfu_target) + delta_rule_flop / (P *
  mfu_delta_rule)``: GEMMs and attention at one efficiency, the chunked delta rule of a hybrid
  target's linear-attention layers (small matrices, a sequential scan over chunks) at its own;
- ``t_drafter = drafter_flop / (P * mfu_drafter) + t_sync / accum``: the step's gradient
  all-reduce among the ``M`` drafters (ring: ``2*(M-1)/M`` of the fp32 gradients at the link's
  all-reduce bus bandwidth, :mod:`dflash.plan.links`) and the AdamW update (28 bytes per parameter: read weights,
  gradients and both moments, write weights and both moments, at HBM bandwidth), once per
  optimizer step of ``accum`` packets; ``optim=muon``: 20 bytes per parameter (one momentum buffer)
  plus Newton-Schulz on every matrix (:func:`muon_flop`, at ``mfu_drafter``), which every drafter
  runs whole (a sharded one on its matrices gathered: their all-gather moves the bytes of the weights').

MFU here is the achieved fraction of the peak over the FLOPs the kernels execute (padding and the
masked half of dense attention included), so it is comparable between roles.

Disaggregated ``N:M`` (``N`` targets, ``M`` drafters): packets/s
``= min(N / t_target, M / t_drafter, N * link / bytes, M * link / bytes)``, where ``bytes`` is
what a packet carries and ``link`` one direction of the GPUs' link (NVLink, PCIe peer to peer, or
PCIe through host memory: :mod:`dflash.plan.links`; the network share when the world spans hosts): each target sends, each drafter receives, its share of the packets.
The link and compute bounds are separate because a drafter receives packet g+1 while it computes
packet g (``DrafterLink.prefetch`` posts the payload receive from the link's own stream once the
header is in; ``tests/unit/test_nccl_ordering.py`` checks the order), and a target computes its next
packet while the previous one is on the wire (up to ``transport.max_in_flight`` un-ACKed).

Tensor-parallel replicas ``NxK:M`` (``N`` replicas of ``K`` GPUs, world ``N*K + M``): ``t_target`` is
a replica's time per packet, ``t_replica = t(rank_flop) + tp_bytes / link``:
the FLOPs of one rank (the split parts ``1/K``, the rest whole; :func:`dflash.sizing.costs.target_rank_flop`)
plus its all-reduces and gathers over one direction of the host's link, not overlapped with compute
(transformers' TP runs them on the compute stream). A replica stays inside a node (``K`` divides
``gpus_per_node``), so its collectives never use the network; one rank of it sends each packet.

Co-located (every GPU holds the target and a drafter replica and runs both per packet, no
send/recv): packets/s ``= W / (t_target + t_drafter)`` with the all-reduce among all ``W``.

The recommended split is the one with the most packets/s among those where both roles fit in
memory (among all when none fits), ties going to more drafters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflash.config import GpuSpec
from dflash.plan.links import intranode_link, link_for
from dflash.sizing.costs import PacketCosts, target_seconds
from dflash.targets.tp import TpLayout

if TYPE_CHECKING:
    from dflash.drafter.arch import DrafterArch

ADAMW_BYTES_PER_PARAM = 28
UPDATE_BYTES_PER_PARAM = {"adamw": ADAMW_BYTES_PER_PARAM, "muon": 20}
"""HBM bytes the optimizer's update moves per parameter, by ``optim.name``."""


def muon_flop(drafter: DrafterArch, ns_steps: int) -> float:
    """FLOPs of Muon's Newton-Schulz on every drafter matrix: per iteration on an ``m x n`` matrix
    (``m <= n``) ``X X^T`` (``2m^2 n``), ``A A`` (``2m^3``) and ``B X`` (``2m^2 n``)."""
    h, f, taps = drafter.hidden_size, drafter.intermediate_size, drafter.num_taps
    q, kv = drafter.num_heads * drafter.head_dim, drafter.num_kv_heads * drafter.head_dim
    layer = [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)]
    shapes = layer * drafter.num_layers + [(h, taps * h)]
    return float(ns_steps * sum(4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3 for s in shapes))


@dataclass(frozen=True)
class RoleTimes:
    """Seconds one GPU needs per packet for each role (compute only) and per optimizer step (sync)."""

    target_s: float
    drafter_s: float
    mfu_target: float
    mfu_drafter: float
    mfu_delta_rule: float
    drafter_params: int
    grad_accum_steps: int
    replica_s: dict[int, float] = field(default_factory=dict)
    """Seconds per packet of a tensor-parallel replica of ``k`` GPUs, by ``k`` (1: ``target_s``)."""
    update_bytes_per_param: int = ADAMW_BYTES_PER_PARAM
    """HBM bytes of the optimizer's update per parameter (:data:`UPDATE_BYTES_PER_PARAM`)."""
    update_s: float = 0.0
    """Compute seconds of one optimizer update beyond its memory traffic (Muon's Newton-Schulz)."""

    def target_replica_s(self, target_tp: int) -> float:
        return self.target_s if target_tp == 1 else self.replica_s[target_tp]

    def drafter_step_s(self, num_drafters: int, gpu: GpuSpec, world_size: int) -> float:
        """Drafter seconds per packet including its share of the step's all-reduce and optimizer update."""
        grad_bytes = 4 * self.drafter_params
        link = link_for(gpu, world_size).allreduce_bytes_per_s
        allreduce = 2 * (num_drafters - 1) / num_drafters * grad_bytes / link
        update = self.update_bytes_per_param * self.drafter_params / (gpu.hbm_tbps * 1e12) + self.update_s
        return self.drafter_s + (allreduce + update) / self.grad_accum_steps


@dataclass(frozen=True)
class Split:
    """One way to run on the world: ``N:M`` disaggregated, or co-located (every GPU is both roles)."""

    mode: str
    """``disaggregated`` or ``colocated``."""
    num_targets: int
    """Target replicas (disaggregated) or ranks (co-located)."""
    num_drafters: int
    packets_per_s: float
    bound: str
    """What limits it: ``targets``, ``drafters``, ``link`` (disaggregated) or ``both`` (co-located)."""
    fits: bool
    target_tp: int = 1
    """GPUs per target replica."""

    @property
    def label(self) -> str:
        if self.mode == "colocated":
            return f"co-located x{self.num_targets}"
        replicas = f"{self.num_targets}x{self.target_tp}" if self.target_tp > 1 else str(self.num_targets)
        return f"{replicas}:{self.num_drafters}"

    @property
    def world_size(self) -> int:
        return (
            self.num_drafters
            if self.mode == "colocated"
            else self.num_targets * self.target_tp + self.num_drafters
        )


def role_times(
    costs: PacketCosts,
    gpu: GpuSpec,
    *,
    mfu_target: float,
    mfu_drafter: float,
    drafter_params: int,
    grad_accum_steps: int,
    mfu_delta_rule: float | None = None,
    replicas: dict[int, tuple[TpLayout, float]] | None = None,
    extra_flop: float = 0.0,
    optimizer: str = "adamw",
    update_flop: float = 0.0,
) -> RoleTimes:
    """``t = FLOP / (peak * MFU)`` for each role on one GPU of ``gpu`` (the target's delta rule at
    ``mfu_delta_rule``, default ``mfu_target``); ``replicas``: ``k -> (the replica's layout, bytes one
    rank sends per packet)`` for a ``k``-GPU tensor-parallel replica; ``extra_flop``: what
    the step runs per packet beyond ``costs`` (:func:`dflash.plan.planner.step_extra_flop`); ``optimizer``: ``optim.name``,
    whose update runs ``update_flop`` per step (:func:`muon_flop`) beside its memory traffic."""
    peak = gpu.bf16_tflops * 1e12
    tp_link = intranode_link(gpu).one_way_bytes_per_s
    delta = mfu_target if mfu_delta_rule is None else mfu_delta_rule

    def target_s(layout: TpLayout | None) -> float:
        return target_seconds(
            costs.target_flop_by_part, peak, mfu_target=mfu_target, mfu_delta_rule=delta, layout=layout
        )

    return RoleTimes(
        target_s=target_s(None),
        drafter_s=(costs.drafter_flop + extra_flop) / (peak * mfu_drafter),
        mfu_target=mfu_target,
        mfu_drafter=mfu_drafter,
        mfu_delta_rule=delta,
        drafter_params=drafter_params,
        grad_accum_steps=grad_accum_steps,
        replica_s={k: target_s(layout) + sent / tp_link for k, (layout, sent) in (replicas or {}).items()},
        update_bytes_per_param=UPDATE_BYTES_PER_PARAM[optimizer],
        update_s=update_flop / (peak * mfu_drafter),
    )


def disaggregated(
    times: RoleTimes,
    payload_bytes: int,
    gpu: GpuSpec,
    world_size: int,
    num_targets: int,
    fits: bool,
    target_tp: int = 1,
) -> Split:
    """Packets/s of ``num_targets`` target replicas of ``target_tp`` GPUs and the drafters on the
    ``world_size - num_targets * target_tp`` GPUs left."""
    m = world_size - num_targets * target_tp
    link = link_for(gpu, world_size).one_way_bytes_per_s / payload_bytes
    bounds = {
        "targets": num_targets / times.target_replica_s(target_tp),
        "drafters": m / times.drafter_step_s(m, gpu, world_size),
        "link": min(num_targets, m) * link,
    }
    bound = min(bounds, key=lambda k: bounds[k])
    return Split("disaggregated", num_targets, m, bounds[bound], bound, fits, target_tp)


def colocated(times: RoleTimes, gpu: GpuSpec, world_size: int, fits: bool) -> Split:
    """Packets/s when every GPU runs the target forward and the drafter step of its own packets."""
    per_packet = times.target_s + times.drafter_step_s(world_size, gpu, world_size)
    return Split("colocated", world_size, world_size, world_size / per_packet, "both", fits)


def best_split(splits: list[Split]) -> Split:
    """The disaggregated split with the most packets/s (ties: more drafters, then smaller replicas),
    among those that fit when any does (otherwise among all: the caller warns that a role does not fit)."""
    disaggregated_splits = [s for s in splits if s.mode == "disaggregated"]
    candidates = [s for s in disaggregated_splits if s.fits] or disaggregated_splits
    return max(candidates, key=lambda s: (round(s.packets_per_s, 9), s.num_drafters, -s.target_tp))


def placement(split: Split, gpus_per_node: int) -> list[str]:
    """One line per node: which of its GPUs hold which target replica (``target_tp`` consecutive
    ranks from rank 0, never across a node since ``target_tp`` divides ``gpus_per_node``) or drafters."""
    if split.mode == "colocated":
        return [f"every GPU: the target and a drafter replica ({split.num_drafters} ranks)"]
    k = split.target_tp
    owner = [f"replica {r // k}" if k > 1 else "targets" for r in range(split.num_targets * k)]
    owner += ["drafters"] * split.num_drafters
    lines = []
    for start in range(0, len(owner), gpus_per_node):
        runs: list[list] = []  # [first GPU, last GPU, owner]
        for i, what in enumerate(owner[start : start + gpus_per_node]):
            if runs and runs[-1][2] == what:
                runs[-1][1] = i
            else:
                runs.append([i, i, what])
        gpus = [f"GPU {a} {w}" if a == b else f"GPUs {a}-{b} {w}" for a, b, w in runs]
        lines.append(f"node {start // gpus_per_node}: " + ", ".join(gpus))
    return lines
