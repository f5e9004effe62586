"""Topology modes: how the ranks of a launch split into targets and drafters (``topology.mode``).

One record per mode; everything else derives from it:

- ``layout``: the target replicas, drafters and ranks per replica of a launch of W ranks
  (``dflash.distributed.topology.Topology`` is built from it, and the rank roles, links and packet
  schedule follow from the topology);
- ``problems``: the config rules of the mode, each naming the override that fixes it;
- ``self_produced``: every drafter makes its own packets with a target of its own (no target ranks,
  no links): the drafter's packet source is a local one, not the links from the targets
  (``dflash.train.trainer``), the drafter holds the target (embedding and lm_head, periodic eval)
  and the planner prices the rank as target + drafter in sequence (``dflash.plan.throughput``).

A new mode is a record here (and a ``conf/topology/<name>.yaml`` that selects it); see
docs/extending.md. Pure Python: no torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from dflash.config.schema import TopologyConfig


@dataclass(frozen=True)
class Layout:
    """The ranks of a launch: ``num_targets`` replicas of ``target_tp`` ranks, then ``num_drafters``."""

    num_targets: int
    num_drafters: int
    target_tp: int

    @property
    def world_size(self) -> int:
        return self.num_targets * self.target_tp + self.num_drafters


@dataclass(frozen=True)
class TopologyMode:
    name: str
    summary: str
    self_produced: bool
    """Each drafter produces its own packets (and holds the target); no target ranks."""
    layout: Callable[[TopologyConfig, int, int], Layout]
    """(topology config, WORLD_SIZE, LOCAL_WORLD_SIZE) -> the launch's layout."""
    problems: Callable[[TopologyConfig, int, int], list[str]]
    """(topology config, WORLD_SIZE, LOCAL_WORLD_SIZE) -> what is wrong, one message per problem."""


def _split_layout(t: TopologyConfig, world: int, per_node: int) -> Layout:
    k = max(t.target_tp, 1)
    if t.drafter_nodes is not None:
        drafters = t.drafter_nodes * per_node
        return Layout((world - drafters) // k, drafters, k)
    drafters = t.num_drafters if t.num_drafters is not None else world - t.num_targets * k
    return Layout(t.num_targets, drafters, k)


def _split_problems(t: TopologyConfig, world: int, per_node: int) -> list[str]:
    if t.drafter_nodes is not None:
        nodes = world // max(per_node, 1)
        problems = []
        if t.num_drafters is not None:
            problems.append(
                f"topology.drafter_nodes={t.drafter_nodes} sets the number of drafters: set topology.num_drafters=null"
            )
        if not (1 <= t.drafter_nodes < nodes and world % per_node == 0):
            problems.append(
                f"topology.drafter_nodes={t.drafter_nodes} needs at least one node of targets before it, but the "
                f"launch has {nodes} node(s) of LOCAL_WORLD_SIZE={per_node} (WORLD_SIZE={world}); set "
                f"topology.drafter_nodes between 1 and {max(nodes - 1, 1)} on a multi-node launch, or "
                f"topology.drafter_nodes=null"
            )
        return problems
    if t.num_targets < 1:
        return [
            f"topology.num_targets={t.num_targets}: need at least 1 target; set topology.num_targets=1 or more, "
            f"or topology=colocated (target and drafter on every rank)"
        ]
    k = max(t.target_tp, 1)
    target_ranks = t.num_targets * k
    drafters = _split_layout(t, world, per_node).num_drafters
    problems = []
    if t.num_drafters is not None and drafters < 1:
        problems.append(f"topology.num_drafters={t.num_drafters}: need at least 1 drafter")
    ranks = target_ranks + drafters
    if world != ranks or drafters < 1:
        fix = f"launch with torchrun --nproc_per_node {max(ranks, target_ranks + 1)}"
        fit = (world - (t.num_drafters or 1)) // k
        if world > 1 and fit >= 1:
            fix += f", or set topology.num_targets={fit} for this launch"
        targets = f"topology.num_targets={t.num_targets}" + (f" x topology.target_tp={k}" if k > 1 else "")
        problems.append(
            f"{targets} + topology.num_drafters={t.num_drafters} = {ranks} ranks but "
            f"the launch has WORLD_SIZE={world}; {fix}, or topology=colocated (any world size)"
        )
    return problems


def _colocated_layout(t: TopologyConfig, world: int, per_node: int) -> Layout:
    return Layout(0, world, 1)


def _colocated_problems(t: TopologyConfig, world: int, per_node: int) -> list[str]:
    problems = []
    if t.num_targets != 0:
        problems.append(
            f"topology.mode=colocated runs the target on every rank: set topology.num_targets=0 (got {t.num_targets})"
        )
    if t.num_drafters is not None and t.num_drafters != world:
        problems.append(
            f"topology.mode=colocated makes every rank a drafter: set topology.num_drafters=null "
            f"(got {t.num_drafters}, WORLD_SIZE={world})"
        )
    if t.drafter_nodes is not None:
        problems.append(
            f"topology.mode=colocated with topology.drafter_nodes={t.drafter_nodes}: every rank is a drafter; "
            "set topology.drafter_nodes=null"
        )
    if t.target_tp != 1:
        problems.append(
            f"topology.mode=colocated with topology.target_tp={t.target_tp}: a co-located rank runs the whole "
            "target for its own packets; set topology.target_tp=1, or topology.mode=split for replicas of k GPUs"
        )
    return problems


SPLIT = TopologyMode(
    name="split",
    summary="N target replicas send packets to M drafters (ranks 0..N*k-1 targets, then the drafters)",
    self_produced=False,
    layout=_split_layout,
    problems=_split_problems,
)
COLOCATED = TopologyMode(
    name="colocated",
    summary="every rank holds the target and a drafter replica and makes its own packets (no send/recv)",
    self_produced=True,
    layout=_colocated_layout,
    problems=_colocated_problems,
)
MODES: dict[str, TopologyMode] = {m.name: m for m in (SPLIT, COLOCATED)}
"""Every topology mode, by ``topology.mode``."""


def mode_of(t: TopologyConfig) -> TopologyMode:
    """The mode ``t`` names (``ValueError`` listing the modes for an unknown name)."""
    mode = MODES.get(str(t.mode))
    if mode is None:
        raise ValueError(f"topology.mode={t.mode}: not a mode; choose one of {sorted(MODES)}")
    return mode


def local_world_size(world_size: int) -> int:
    """Ranks per node of this launch (torchrun's LOCAL_WORLD_SIZE; the whole world when unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def layout_of(t: TopologyConfig, world_size: int, per_node: int | None = None) -> Layout:
    """The layout of a launch of ``world_size`` ranks (``per_node`` default: LOCAL_WORLD_SIZE)."""
    return mode_of(t).layout(t, world_size, per_node or local_world_size(world_size))


PLANNED_WORLD_LIMIT = 65536
"""The largest launch :func:`planned_world_size` looks at."""


def planned_world_size(t: TopologyConfig) -> int:
    """The world size a tool outside torchrun (``dflash.data.prepare``) plans for: the smallest
    one-node launch the mode's rules accept (``split``: the targets' ranks + the drafters, one
    drafter when ``num_drafters`` is open; ``colocated``: ``num_drafters`` or one rank); 1 when none
    does (an unknown mode, contradictory fields), so that the checks report the problems."""
    mode = MODES.get(str(t.mode))
    if mode is None:
        return 1
    return next((w for w in range(1, PLANNED_WORLD_LIMIT + 1) if not mode.problems(t, w, w)), 1)


def topology_problems(t: TopologyConfig, world_size: int, per_node: int | None = None) -> list[str]:
    """What is wrong with the topology for a launch of ``world_size`` ranks: an unknown mode, the
    mode's own rules, and the rules every mode shares (replicas inside a node, queue and timeouts)."""
    if str(t.mode) not in MODES:
        return [f"topology.mode={t.mode}: not a mode; choose one of {sorted(MODES)}"]
    per_node = per_node or local_world_size(world_size)
    problems = mode_of(t).problems(t, world_size, per_node)
    k = t.target_tp
    if k < 1:
        problems.append(f"topology.target_tp={k}: must be >= 1 (1 = one GPU per target)")
    elif k > 1 and per_node % k and world_size > per_node:
        problems.append(
            f"topology.target_tp={k} must divide the ranks of a node (LOCAL_WORLD_SIZE={per_node}): "
            f"a replica never spans nodes; use a divisor of {per_node}"
        )
    if t.max_in_flight < 1:
        problems.append(f"topology.max_in_flight={t.max_in_flight}: must be >= 1")
    if not (t.init_timeout_s > 0 and t.step_timeout_s > 0 and t.first_contact_timeout_s > 0):
        problems.append(
            "topology.init_timeout_s, topology.step_timeout_s and topology.first_contact_timeout_s must be > 0"
        )
    return problems
