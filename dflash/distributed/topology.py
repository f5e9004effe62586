"""Which rank does what, and the packet schedule. Pure Python: no torch.distributed, no GPU.

World = N target replicas of k ranks each (``target_tp``, 1 by default) + M drafters. Target ranks
are 0..N*k-1: replica r is ranks [r*k, (r+1)*k) (consecutive, so a replica stays inside a node when
k divides the GPUs of a node), and its first rank r*k, the replica's *sender*, is the one that sends
its packets; the other k-1 ranks run the same forwards (the tensor-parallel shards) and send nothing.
Drafters are ranks N*k..N*k+M-1; the drafter leader is rank N*k. Co-located (``mode=colocated``,
a mode whose drafters make their own packets): N = 0 and every rank is a drafter that also holds the
target (producer of g = consumer of g); the leader is rank 0. The mode's record
(``dflash.config.modes``) gives the layout. Packets are numbered globally g = 0, 1, 2, ...: packet
g is produced by replica g mod N (sent by rank (g mod N)*k) and consumed by drafter g mod M.
Optimizer step s of every drafter consumes ``accum`` packets, so step s covers packets
[s*M*accum, (s+1)*M*accum). Every rank computes the same schedule, so no receive ever needs an
any-source match and a run resumes from a single number.

Seen from one link (sender t -> drafter d), consecutive packets are ``lcm(N, M)`` apart
(``link_period``); with gcd(N, M) > 1 some pairs never exchange a packet (``linked_drafters``,
``linked_targets``). Only senders have links.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash.config import TopologyConfig
from dflash.config.modes import MODES, layout_of


@dataclass(frozen=True)
class Topology:
    num_targets: int
    num_drafters: int
    world_size: int
    grad_accum_steps: int = 1
    mode: str = "split"
    """``topology.mode`` (``dflash.config.modes``): ``split`` or ``colocated``."""
    target_tp: int = 1
    """Ranks per target replica (tensor parallel); ``num_targets`` counts replicas."""

    @classmethod
    def from_config(
        cls,
        cfg: TopologyConfig,
        world_size: int,
        grad_accum_steps: int = 1,
        local_world_size: int | None = None,
    ) -> Topology:
        """The topology of a launch of ``world_size`` ranks, ``local_world_size`` per node (torchrun's
        LOCAL_WORLD_SIZE): the layout the config's mode gives (``dflash.config.modes``)."""
        layout = layout_of(cfg, world_size, local_world_size)
        return cls(
            layout.num_targets,
            layout.num_drafters,
            world_size,
            grad_accum_steps,
            str(cfg.mode),
            layout.target_tp,
        )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"topology.mode={self.mode}: not a mode; choose one of {sorted(MODES)}")
        if self.self_produced != (self.num_targets == 0):
            raise ValueError(
                f"topology.mode={self.mode} with topology.num_targets={self.num_targets}: "
                + (
                    "a self-producing mode has no target ranks; set topology.num_targets=0"
                    if self.self_produced
                    else "need at least 1 target rank (or topology=colocated: target and drafter on every rank)"
                )
            )
        if self.num_drafters < 1:
            raise ValueError(f"topology.num_drafters={self.num_drafters}: need at least 1 drafter rank")
        if self.grad_accum_steps < 1:
            raise ValueError(f"optim.grad_accum_steps={self.grad_accum_steps}: must be >= 1")
        if self.target_tp < 1 or (self.self_produced and self.target_tp != 1):
            raise ValueError(
                f"topology.target_tp={self.target_tp}: must be >= 1, and 1 with topology.mode={self.mode}"
            )
        need = self.num_target_ranks + self.num_drafters
        if self.world_size != need:
            k = self.target_tp
            targets = (
                f"{self.num_targets} target replicas x {k} ranks" if k > 1 else f"{self.num_targets} targets"
            )
            raise ValueError(
                f"topology has {targets} + {self.num_drafters} drafters = {need} ranks but "
                f"WORLD_SIZE={self.world_size}; launch with torchrun --nproc_per_node {need} or set "
                f"topology.num_targets={(self.world_size - self.num_drafters) // k}"
            )

    @property
    def self_produced(self) -> bool:
        """Every drafter makes its own packets with a target of its own (``TopologyMode.self_produced``)."""
        return MODES[self.mode].self_produced

    @property
    def num_target_ranks(self) -> int:
        """N x k: every rank of every target replica."""
        return self.num_targets * self.target_tp

    @property
    def target_ranks(self) -> list[int]:
        """Every target rank (senders and the other ranks of their replicas)."""
        return list(range(self.num_target_ranks))

    @property
    def sender_ranks(self) -> list[int]:
        """The first rank of each replica, which sends the replica's packets (all targets when k = 1)."""
        return list(range(0, self.num_target_ranks, self.target_tp))

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.num_target_ranks, self.world_size))

    @property
    def leader_rank(self) -> int:
        """The drafter that writes checkpoints and logs to W&B."""
        return self.num_target_ranks

    def drafter_index(self, rank: int) -> int:
        """0..M-1: the position of drafter ``rank`` among the drafters."""
        return rank - self.num_target_ranks

    def replica_of(self, rank: int) -> int:
        """0..N-1: the target replica target ``rank`` belongs to."""
        return rank // self.target_tp

    def replica_ranks(self, rank: int) -> list[int]:
        """The ranks of target ``rank``'s replica, its sender first."""
        first = self.replica_of(rank) * self.target_tp
        return list(range(first, first + self.target_tp))

    def role_of(self, rank: int) -> str:
        """``target`` or ``drafter`` (a co-located rank is a drafter that makes its own packets)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return "target" if rank < self.num_target_ranks else "drafter"

    def describe(self, rank: int) -> str:
        """'target 1 (rank 1)', 'target replica 1, TP rank 0 (rank 2)' (``target_tp`` > 1) or
        'drafter 0 (rank 2)': how logs and errors name a peer."""
        if self.role_of(rank) == "drafter":
            return f"drafter {self.drafter_index(rank)} (rank {rank})"
        if self.target_tp == 1:
            return f"target {rank} (rank {rank})"
        return f"target replica {self.replica_of(rank)}, TP rank {rank % self.target_tp} (rank {rank})"

    def producer_of(self, g: int) -> int:
        """Rank that makes packet g: a replica's sender, or the consuming rank itself when drafters
        make their own packets (co-located)."""
        if self.self_produced:
            return self.consumer_of(g)
        return self.producer_replica(g) * self.target_tp

    def producer_replica(self, g: int) -> int:
        """0..N-1: the target replica that makes packet g (not co-located)."""
        return g % self.num_targets

    def consumer_of(self, g: int) -> int:
        """Rank of the drafter that consumes packet g."""
        return self.num_target_ranks + g % self.num_drafters

    @property
    def packets_per_step(self) -> int:
        return self.num_drafters * self.grad_accum_steps

    def packets_of_step(self, step: int, drafter_rank: int) -> list[int]:
        """Packets drafter ``drafter_rank`` trains on in 0-based optimizer step ``step``, in order."""
        d = self.drafter_index(drafter_rank)
        start = step * self.packets_per_step
        return [start + i * self.num_drafters + d for i in range(self.grad_accum_steps)]

    def packets_of_target(self, target_rank: int, start: int, stop: int) -> list[int]:
        """Packets in [start, stop) that the replica of target ``target_rank`` produces, in order
        (the same list on every rank of the replica)."""
        first = start + (self.replica_of(target_rank) - start) % self.num_targets
        return list(range(first, stop, self.num_targets))


def link_period(topology: Topology) -> int:
    """Distance between consecutive packets of one (target, drafter) link: lcm(N, M)."""
    return math.lcm(topology.num_targets, topology.num_drafters)


def first_on_link(topology: Topology, target_rank: int, drafter_rank: int, start: int = 0) -> int | None:
    """First packet index >= start that target_rank sends to drafter_rank (None: the link is unused)."""
    for g in range(start, start + link_period(topology)):
        if topology.producer_of(g) == target_rank and topology.consumer_of(g) == drafter_rank:
            return g
    return None


def linked_drafters(topology: Topology, target_rank: int) -> list[int]:
    """Drafters this target ever sends to (all of them unless gcd(N, M) > 1; none from a rank of a
    replica that is not its sender)."""
    return [d for d in topology.drafter_ranks if first_on_link(topology, target_rank, d) is not None]


def linked_targets(topology: Topology, drafter_rank: int) -> list[int]:
    """Senders that ever send to this drafter."""
    return [t for t in topology.sender_ranks if first_on_link(topology, t, drafter_rank) is not None]


def links(topology: Topology) -> list[tuple[int, int]]:
    """Every (sender rank, drafter rank) pair that exchanges packets, by sender then drafter."""
    return [(t, d) for t in topology.sender_ranks for d in linked_drafters(topology, t)]
