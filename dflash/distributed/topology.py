"""Which rank does what, and the packet schedule. Pure Python: no torch.distributed, no GPU.

World = N targets + M drafters. Targets are ranks 0..N-1, drafters N..N+M-1, the drafter leader
is rank N. Co-located (``colocated=True``): N = 0 and every rank is a drafter that also holds the
target and produces its own packets (producer of g = consumer of g); the leader is rank 0. Packets are numbered globally g = 0, 1, 2, ...: packet g is produced by target g mod N
and consumed by drafter g mod M. Optimizer step s of every drafter consumes ``accum`` packets, so
step s covers packets [s*M*accum, (s+1)*M*accum). Every rank computes the same schedule, so no
receive ever needs an any-source match and a run resumes from a single number.

Seen from one link (target t -> drafter d), consecutive packets are ``lcm(N, M)`` apart
(``link_period``); with gcd(N, M) > 1 some pairs never exchange a packet (``linked_drafters``,
``linked_targets``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from dflash.config import TopologyConfig


@dataclass(frozen=True)
class Topology:
    num_targets: int
    num_drafters: int
    world_size: int
    grad_accum_steps: int = 1
    colocated: bool = False

    @classmethod
    def from_config(
        cls,
        cfg: TopologyConfig,
        world_size: int,
        grad_accum_steps: int = 1,
        local_world_size: int | None = None,
    ) -> Topology:
        """The topology of a launch of ``world_size`` ranks, ``local_world_size`` per node (torchrun's
        LOCAL_WORLD_SIZE): ``num_drafters`` None takes the rest of the world; ``drafter_nodes`` gives
        the last nodes to the drafters."""
        if cfg.drafter_nodes is not None:
            per_node = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            drafters = cfg.drafter_nodes * per_node
            return cls(world_size - drafters, drafters, world_size, grad_accum_steps, cfg.colocated)
        drafters = cfg.num_drafters if cfg.num_drafters is not None else world_size - cfg.num_targets
        return cls(cfg.num_targets, drafters, world_size, grad_accum_steps, cfg.colocated)

    def __post_init__(self) -> None:
        if self.colocated and self.num_targets != 0:
            raise ValueError(
                f"topology.colocated=true runs the target on every rank, so topology.num_targets must be 0 "
                f"(got {self.num_targets}); set topology.num_targets=0"
            )
        if not self.colocated and self.num_targets < 1:
            raise ValueError(
                f"topology.num_targets={self.num_targets}: need at least 1 target rank "
                f"(or topology=colocated: target and drafter on every rank)"
            )
        if self.num_drafters < 1:
            raise ValueError(f"topology.num_drafters={self.num_drafters}: need at least 1 drafter rank")
        if self.grad_accum_steps < 1:
            raise ValueError(f"optim.grad_accum_steps={self.grad_accum_steps}: must be >= 1")
        need = self.num_targets + self.num_drafters
        if self.world_size != need:
            raise ValueError(
                f"topology has {self.num_targets} targets + {self.num_drafters} drafters = {need} ranks but "
                f"WORLD_SIZE={self.world_size}; launch with torchrun --nproc_per_node {need} or set "
                f"topology.num_targets={self.world_size - self.num_drafters}"
            )

    @property
    def target_ranks(self) -> list[int]:
        return list(range(self.num_targets))

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.num_targets, self.world_size))

    @property
    def leader_rank(self) -> int:
        """The drafter that writes checkpoints and logs to W&B."""
        return self.num_targets

    def role_of(self, rank: int) -> str:
        """``target`` or ``drafter`` (a co-located rank is a drafter that makes its own packets)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return "target" if rank < self.num_targets else "drafter"

    def describe(self, rank: int) -> str:
        """'target 1 (rank 1)' or 'drafter 0 (rank 2)': how logs and errors name a peer."""
        role = self.role_of(rank)
        index = rank if role == "target" else rank - self.num_targets
        return f"{role} {index} (rank {rank})"

    def producer_of(self, g: int) -> int:
        """Rank that produces packet g: a target, or the consuming rank itself when co-located."""
        if self.colocated:
            return self.consumer_of(g)
        return g % self.num_targets

    def consumer_of(self, g: int) -> int:
        """Rank of the drafter that consumes packet g."""
        return self.num_targets + g % self.num_drafters

    @property
    def packets_per_step(self) -> int:
        return self.num_drafters * self.grad_accum_steps

    def packets_of_step(self, step: int, drafter_rank: int) -> list[int]:
        """Packets drafter ``drafter_rank`` trains on in 0-based optimizer step ``step``, in order."""
        d = drafter_rank - self.num_targets
        start = step * self.packets_per_step
        return [start + i * self.num_drafters + d for i in range(self.grad_accum_steps)]

    def packets_of_target(self, target_rank: int, start: int, stop: int) -> list[int]:
        """Packets in [start, stop) that target ``target_rank`` produces, in order."""
        first = start + (target_rank - start) % self.num_targets
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
    """Drafters this target ever sends to (all of them unless gcd(N, M) > 1)."""
    return [d for d in topology.drafter_ranks if first_on_link(topology, target_rank, d) is not None]


def linked_targets(topology: Topology, drafter_rank: int) -> list[int]:
    """Targets that ever send to this drafter."""
    return [t for t in topology.target_ranks if first_on_link(topology, t, drafter_rank) is not None]


def links(topology: Topology) -> list[tuple[int, int]]:
    """Every (target rank, drafter rank) pair that exchanges packets, by target then drafter."""
    return [(t, d) for t in topology.target_ranks for d in linked_drafters(topology, t)]
