"""Process-group setup: device and backend choice, the drafter-only group, one pair of groups per link, timeouts.

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR/PORT for ``env://``). The world
is N targets + M drafters (``dflash.distributed.topology``). Besides the default group (the
collectives of every rank: ``agree_on_start``, the run-directory check) every rank creates, in one
global order (``new_group`` is collective over the world):
- the drafter-only group (the drafters' gradient all-reduce and step statistics);
- for every linked (target, drafter) pair two 2-rank groups, ``LinkGroups.data`` (target -> drafter
  packets) and ``LinkGroups.control`` (drafter -> target ACK/STOP); only a replica's sender has links;
- with ``topology.target_tp`` = k > 1, one group per target replica (its k ranks,
  ``new_replica_groups``): the tensor-parallel collectives of the sharded target's forward and the
  per-packet agreement of the replica (``dflash.distributed.collectives.replica_next_packet``).

Why one group per pair and direction (torch 2.13, ``ProcessGroupNCCL::pointToPoint`` in
torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp): with eager initialisation (``device_id`` given to
``init_process_group``, which every later ``new_group`` inherits) an unbatched send/recv reuses the
group's one communicator and its one NCCL stream (key = the device), so every point-to-point op of
a group, whatever its peer, runs in the order it was issued and a receive nobody matches yet blocks
every later op of the group on that rank (torch warns: "unbatched P2P ops are treated as independent
collective ops, and are thus serialized with all other ops on this ProcessGroup"; PRs #154132,
#156748). Without eager init torch makes a 2-rank communicator per (group, pair) lazily instead,
whose creation blocks until both ends join. A 2-rank group per link and direction gives the same
layout explicitly under either mode: a link's pending control receive or un-received packet never
queues in front of another link's traffic, and the eager world and drafter communicators stay fast
for the collectives. ``tests/nccl_sim.py`` models exactly these rules.

Timeouts: the links and collectives wait with explicit timeouts (``topology.init_timeout_s`` until
the first step, then ``topology.step_timeout_s``; a target waits twice that for a drafter, a rank of
a replica ``replica_wait_s`` for its sender) and name the peer in a ``PeerError``. Every group is
given ``backend_timeout_s`` of that, strictly above it: NCCL's watchdog (``WorkNCCL::checkTimeout``)
and a blocking ``Work.wait(timeout)`` both count from the op's creation, and a watchdog that fires
first tears the process down (the default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``) before the
``PeerError`` is logged. ``set_timeout`` changes both with torch 2.13's
``torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)``, the default timeout of later
work of a group's gloo/NCCL backend. Measured on gloo (torch 2.13 CPU): it bounds later collectives
(a barrier nobody joins fails after the new 2 s instead of 30 s), but NOT blocking point-to-point
receives, whose timeout stays the one the group was created with (``Backend.set_timeout`` behaves
the same): the links never rely on it.

Shutdown: ``destroy(ctx, failed=True)`` (an error path) aborts every communicator
(``_abort_process_group``: ``ncclCommAbort``, which never waits) instead of ``destroy_process_group``,
whose NCCL finalize waits for pending work: a prefetched header or a control receive that will never
be matched would block it until the watchdog. On gloo both return at once.

Restarts (``torchrun --max-restarts=K``): torch 2.13's torchrun hands every attempt the same
agent-hosted TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``) and ``env://`` adds no per-attempt
prefix, so a restarted rank can read a dead rank's address of the previous attempt and fail with
"Gloo connectFullMesh failed ... Connection refused" (pytorch/pytorch#135712). On one host every
rank shares one agent and one ``TORCHELASTIC_RESTART_COUNT``, so ``init_distributed`` prefixes the
store with it; across hosts the counts can differ, so launch multi-host restarts with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per attempt).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dflash.config import TopologyConfig
from dflash.config.resolve import resolve_device
from dflash.distributed.links import LinkGroups
from dflash.distributed.topology import Topology, links

log = logging.getLogger(__name__)

BACKEND_TIMEOUT_MARGIN_S = 60.0
"""The least time by which every group's timeout exceeds the waits of the links and collectives."""


def backend_timeout_s(wait_timeout_s: float) -> float:
    """The timeout of every process group while the links and collectives wait at most ``wait_timeout_s``.

    Twice that plus ``BACKEND_TIMEOUT_MARGIN_S``: NCCL's watchdog and a blocking ``Work.wait`` count
    from the op's creation, but an op can stay un-waited for about one step before the wait that
    names its peer starts (a drafter's ACK to a target whose next packet is N packets later), and
    the steps themselves are bounded by the peers' waits. Always > ``wait_timeout_s`` + the margin.
    """
    return 2.0 * float(wait_timeout_s) + BACKEND_TIMEOUT_MARGIN_S


def replica_wait_s(topology_cfg: TopologyConfig) -> float:
    """How long a rank of a tensor-parallel replica waits for its sender between two packets.

    Between two packets the sender may wait for a drafter's ACK (``max_in_flight`` backpressure) up
    to ``init_timeout_s`` until that drafter's first step, then twice ``step_timeout_s``; the others
    wait ``step_timeout_s`` longer, so that a stuck drafter is named by the sender waiting on it,
    not by the replica as a stuck sender."""
    t = topology_cfg
    return max(float(t.init_timeout_s), 2.0 * float(t.step_timeout_s)) + float(t.step_timeout_s)


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    drafter_group: Any
    """The drafter-only group on drafter ranks; GroupMember.NON_GROUP_MEMBER on targets."""
    link_groups: dict[tuple[int, int], LinkGroups] = field(default_factory=dict)
    """(target rank, drafter rank) -> the two 2-rank groups of that link, for the links of this rank."""
    tp_group: Any = None
    """The group of this target rank's tensor-parallel replica (``topology.target_tp`` > 1); None
    on drafters and with one rank per target."""
    tp_wait_s: float = 0.0
    """How long a rank of a replica waits for its sender (``replica_wait_s``); the replica group's
    timeout is ``backend_timeout_s`` of it."""
    timeout_s: float = 0.0
    """What the links and collectives wait for at most now; every group's timeout is
    ``backend_timeout_s`` of it."""
    topology: Topology | None = None

    @property
    def role(self) -> str:
        return self.topology.role_of(self.rank) if self.topology else "?"

    @property
    def name(self) -> str:
        return self.topology.describe(self.rank) if self.topology else f"rank {self.rank}"

    def drafter_links(self) -> dict[int, LinkGroups]:
        """This drafter's links: target rank -> the groups of the link from it."""
        return {t: g for (t, d), g in self.link_groups.items() if d == self.rank}


def resolve_backend(topology_cfg: TopologyConfig, device: torch.device) -> str:
    """auto: nccl on cuda, gloo on cpu."""
    backend = str(topology_cfg.backend)
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            "topology.backend=nccl needs CUDA devices; set topology.backend=gloo (or auto) for CPU"
        )
    if backend == "gloo" and device.type == "cuda":
        raise ValueError(
            "topology.backend=gloo with topology.device=cuda: gloo point-to-point needs CPU tensors; "
            "set topology.backend=nccl (or auto)"
        )
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"topology.backend={backend!r}: use auto, nccl or gloo")
    return backend


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(
            f"environment variable {name} is not set: launch with torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK)"
        )
    return int(value)


def attempt_store(world_size: int, timeout_s: float) -> dist.Store | None:
    """The torchrun agent's store, prefixed with this restart attempt, for a single-host launch that
    shares the agent's store (see the module docstring); None: let ``env://`` build the store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) != world_size:
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            log.warning(
                "multi-host torchrun with --max-restarts and the shared agent store: a restart can fail to "
                "connect (pytorch/pytorch#135712); launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
            )
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"dflash/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(topology_cfg: TopologyConfig, *, init_method: str | None = None) -> DistContext:
    """Initialise the default process group from the torchrun environment, plus the drafter group,
    the groups of every link and of every tensor-parallel replica (see the module docstring)."""
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    topology = Topology.from_config(topology_cfg, world_size)
    device = resolve_device(topology_cfg.device, local_rank)
    backend = resolve_backend(topology_cfg, device)
    timeout_s = float(topology_cfg.init_timeout_s)
    timeout = timedelta(seconds=backend_timeout_s(timeout_s))
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device  # eager NCCL init bound to this rank's GPU
    store = None if init_method else attempt_store(world_size, timeout_s)
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method or "env://"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    drafter_group = dist.new_group(topology.drafter_ranks, timeout=timeout)  # collective: every rank calls it
    link_groups = {}
    for t, d in links(topology):
        data = dist.new_group([t, d], timeout=timeout)
        control = dist.new_group([t, d], timeout=timeout)
        if rank in (t, d):
            link_groups[(t, d)] = LinkGroups(data, control)
    tp_group, tp_wait_s = None, replica_wait_s(topology_cfg)
    if topology.target_tp > 1:
        tp_timeout = timedelta(seconds=backend_timeout_s(tp_wait_s))
        tp_group = new_replica_groups(topology.num_targets, topology.target_tp, timeout=tp_timeout)
    ctx = DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=backend,
        drafter_group=drafter_group,
        link_groups=link_groups,
        tp_group=tp_group,
        tp_wait_s=tp_wait_s,
        timeout_s=timeout_s,
        topology=topology,
    )
    log.info(
        "%s: %s on %s, world %d, %d links, waits %gs (groups %gs)",
        ctx.name,
        backend,
        device,
        world_size,
        len(link_groups),
        timeout_s,
        timeout.total_seconds(),
    )
    return ctx


def replica_ranks(num_replicas: int, tp_size: int, first_rank: int = 0) -> list[list[int]]:
    """The ranks of each tensor-parallel target replica: ``k`` consecutive ranks from ``first_rank``
    (``[[0, 1], [2, 3]]`` for 2 replicas of 2), so that with ``k`` dividing the GPUs of a node a
    replica never spans two nodes."""
    return [
        list(range(first_rank + r * tp_size, first_rank + (r + 1) * tp_size)) for r in range(num_replicas)
    ]


def new_replica_groups(
    num_replicas: int, tp_size: int, first_rank: int = 0, timeout: timedelta | None = None
) -> Any:
    """Create one process group per target replica (a collective: every rank of the world calls it,
    replicas in order) and return this rank's, or None on a rank outside every replica.
    ``timeout``: the groups' backend timeout (None: the default group's)."""
    mine = None
    rank = dist.get_rank()
    for ranks in replica_ranks(num_replicas, tp_size, first_rank):
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def _member(group) -> bool:
    return group is not None and group != dist.GroupMember.NON_GROUP_MEMBER


def set_timeout(ctx: DistContext, seconds: float, link: tuple[int, int] | None = None) -> None:
    """The links and collectives of this rank now wait at most ``seconds``: every group of the rank
    (only the two groups of ``link`` when given) gets ``backend_timeout_s(seconds)`` with torch
    2.13's ``_set_pg_timeout``. That bounds collectives and, on NCCL, the watchdog of later work; on
    gloo it does not shorten blocking point-to-point receives (see the module docstring). Links of
    ``dflash.distributed.links`` take their own ``set_timeout``. A replica's group keeps the
    timeout of ``replica_wait_s`` unless ``seconds`` is longer."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = timedelta(seconds=backend_timeout_s(seconds))
    if link is not None:
        groups = [ctx.link_groups[link].data, ctx.link_groups[link].control]
    else:
        pairs = [g for lg in ctx.link_groups.values() for g in (lg.data, lg.control)]
        groups = [None, ctx.drafter_group, *pairs]
        ctx.timeout_s = float(seconds)
        if _member(ctx.tp_group):
            wait = max(float(seconds), ctx.tp_wait_s)
            _set_pg_timeout(timedelta(seconds=backend_timeout_s(wait)), ctx.tp_group)
    for group in groups:
        if group is None or _member(group):
            _set_pg_timeout(timeout, group)


def destroy(ctx: DistContext | None = None, *, failed: bool = False) -> None:
    """Tear down every process group (safe to call twice or when init never ran). ``failed``: an
    error path, where an op may never be matched: abort the communicators instead of waiting for them."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if failed:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    else:
        dist.destroy_process_group()
