"""Process-group setup: device and backend choice, the drafter-only and control groups, timeouts.

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR/PORT for ``env://``). The world
is N targets + M drafters (``dflash.distributed.topology``). Besides the default group (the data
channel of ``dflash.distributed.links``) every rank creates:
- the drafter-only group (DDP among drafters), ``new_group`` called on all ranks;
- the control group (all ranks): drafter -> target ACK/STOP messages travel on their own group so
  that, with NCCL, a pending control receive never queues in front of a data send on one stream.

Timeouts: the process group starts with ``topology.init_timeout_s`` (model loading is slow) and
``set_timeout`` lowers it to ``topology.step_timeout_s`` after the first step, with torch 2.13's
``torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)`` on every group of the rank
(it sets the default timeout of the group's gloo/NCCL backend). Measured on gloo (torch 2.13 CPU):
it bounds later collectives (a barrier nobody joins fails after the new 2 s instead of 30 s), but
NOT blocking point-to-point receives, whose timeout stays the one the group was created with
(``Backend.set_timeout`` behaves the same). On NCCL it sets the timeout the watchdog applies to
work enqueued afterwards (not verified here: no GPUs). The links therefore never rely on it: every
wait of ``dflash.distributed.links`` passes an explicit ``work.wait(timeout=...)``, and the links
have their own ``set_timeout``.

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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dflash.config import TopologyConfig
from dflash.config.resolve import resolve_device
from dflash.distributed.topology import Topology

log = logging.getLogger(__name__)


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    drafter_group: Any
    """The drafter-only group on drafter ranks; GroupMember.NON_GROUP_MEMBER on targets."""
    control_group: Any = None
    """All ranks; carries the links' drafter -> target control messages."""
    timeout_s: float = 0.0
    topology: Topology | None = None

    @property
    def role(self) -> str:
        return self.topology.role_of(self.rank) if self.topology else "?"

    @property
    def name(self) -> str:
        return self.topology.describe(self.rank) if self.topology else f"rank {self.rank}"


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
    """Initialise the default process group from the torchrun environment, plus the drafter and control groups."""
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    topology = Topology.from_config(topology_cfg, world_size)
    device = resolve_device(topology_cfg.device, local_rank)
    backend = resolve_backend(topology_cfg, device)
    timeout_s = float(topology_cfg.init_timeout_s)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device  # eager NCCL init bound to this rank's GPU
    store = None if init_method else attempt_store(world_size, timeout_s)
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method or "env://"
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **kwargs
    )
    drafter_group = dist.new_group(topology.drafter_ranks)  # collective: every rank calls it
    control_group = dist.new_group(list(range(world_size)))
    ctx = DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=backend,
        drafter_group=drafter_group,
        control_group=control_group,
        timeout_s=timeout_s,
        topology=topology,
    )
    log.info("%s: %s on %s, world %d, timeout %gs", ctx.name, backend, device, world_size, timeout_s)
    return ctx


def replica_ranks(num_replicas: int, tp_size: int, first_rank: int = 0) -> list[list[int]]:
    """The ranks of each tensor-parallel target replica: ``k`` consecutive ranks from ``first_rank``
    (``[[0, 1], [2, 3]]`` for 2 replicas of 2), so that with ``k`` dividing the GPUs of a node a
    replica never spans two nodes."""
    return [
        list(range(first_rank + r * tp_size, first_rank + (r + 1) * tp_size)) for r in range(num_replicas)
    ]


def new_replica_groups(num_replicas: int, tp_size: int, first_rank: int = 0) -> Any:
    """Create one process group per target replica (a collective: every rank of the world calls it,
    replicas in order) and return this rank's, or None on a rank outside every replica."""
    mine = None
    rank = dist.get_rank()
    for ranks in replica_ranks(num_replicas, tp_size, first_rank):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _member(group) -> bool:
    return group is not None and group != dist.GroupMember.NON_GROUP_MEMBER


def set_timeout(ctx: DistContext, seconds: float) -> None:
    """Set the default timeout of every process group of this rank (torch 2.13: ``_set_pg_timeout``).

    Bounds collectives (e.g. the drafters' DDP all-reduce) and, on NCCL, the watchdog; on gloo it
    does not shorten blocking point-to-point receives (see the module docstring). Links of
    ``dflash.distributed.links`` take their own ``set_timeout``.
    """
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = timedelta(seconds=float(seconds))
    for group in (None, ctx.control_group, ctx.drafter_group):
        if group is None or _member(group):
            _set_pg_timeout(timeout, group)
    ctx.timeout_s = float(seconds)


def destroy(ctx: DistContext | None = None) -> None:
    """Tear down every process group (safe to call twice or when init never ran)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
