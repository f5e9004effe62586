"""The run's collectives: ``warm_up_links`` and ``agree_on_start`` (every rank); among the drafters
``all_reduce_sum`` / ``all_reduce_max`` (step statistics), ``gather_lists`` (the ledger) and
``broadcast_text`` (where a sharded checkpoint is written); among
the ranks of a tensor-parallel target replica ``replica_next_packet`` (the packet they make next).

``warm_up_links`` runs right after the process groups start (``dflash.train``), before any model
loads: it exchanges one message on every (target, drafter) link in both directions, on the link's
own groups, so a peer that cannot be reached is named at once. Every wait has an explicit timeout and a backend failure becomes a ``PeerError``
naming the ranks involved.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from dflash.distributed.links import Endpoint, LinkGroups, PeerError, is_timeout, short_error
from dflash.distributed.process_group import DistContext
from dflash.distributed.protocol import ProtocolError
from dflash.distributed.topology import Topology, links
from dflash.files import atomic_write


def _collective_wait(
    ctx: DistContext, work: dist.Work, what: str, ranks: list[int], timeout_s: float | None
) -> None:
    timeout = float(timeout_s if timeout_s is not None else (ctx.timeout_s or 1800.0))
    topo = ctx.topology
    names = ", ".join(topo.describe(r) for r in ranks) if topo else str(ranks)
    me = topo.describe(ctx.rank) if topo else f"rank {ctx.rank}"
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001
        kind = "timed out" if is_timeout(e) else f"failed ({short_error(e)})"
        raise PeerError(
            f"{me}: {what} among [{names}] {kind} (timeout {timeout:g}s); a peer is dead or stuck"
        ) from e
    if ok is False:
        raise PeerError(f"{me}: {what} among [{names}] timed out after {timeout:g}s; a peer is dead or stuck")


def agree_on_start(
    ctx: DistContext, topology: Topology, next_packet: int, num_steps: int, timeout_s: float | None = None
) -> tuple[int, int]:
    """Every rank (collective over the world): the drafter leader's resume point, checked plans.

    Returns ``(start_packet, num_steps)`` where ``start_packet`` is the leader's ``next_packet``.
    Every rank computes its data plan itself, so a rank whose ``num_steps`` differs from the
    leader's raises ``ValueError`` (same seed, dataset and config on every rank?).
    """
    mine = torch.tensor([int(next_packet), int(num_steps)], dtype=torch.int64, device=ctx.device)
    gathered = [torch.zeros_like(mine) for _ in range(topology.world_size)]
    work = dist.all_gather(gathered, mine, async_op=True)
    _collective_wait(ctx, work, "agree_on_start (all_gather)", list(range(topology.world_size)), timeout_s)
    rows = [[int(x) for x in t.tolist()] for t in gathered]
    start, steps = rows[topology.leader_rank]
    differ = [r for r, (_, n) in enumerate(rows) if n != steps]
    if differ:
        plans = ", ".join(f"{topology.describe(r)}: {rows[r][1]}" for r in [topology.leader_rank, *differ])
        raise ValueError(
            f"the ranks disagree on the number of steps of the data plan ({plans}); every rank must use the same "
            f"data, seed and config"
        )
    if start < 0:
        raise ValueError(f"{topology.describe(topology.leader_rank)} resumes at packet {start} < 0")
    return start, steps


def replica_next_packet(ctx: DistContext, g: int, stop_requested: bool, timeout_s: float) -> tuple[int, bool]:
    """Every rank of a tensor-parallel target replica, before each forward: ``(packet, stop)``, the
    packet the replica makes next (-1: it is done) and whether any rank of it asked to stop.

    The replica's sender passes its next packet as ``g`` (or -1); the others' ``g`` is ignored. One
    all-reduce (sum) of two int64 over ``ctx.tp_group``: the sender's ``g`` (the others add 0) and
    the number of ranks with ``stop_requested``, so that a stop signal to any rank of the replica
    reaches the drafters through the sender's next packet. A rank that waits longer than
    ``timeout_s`` (the sender is dead or stuck), or whose peer died, raises ``PeerError`` naming
    the replica's ranks.
    """
    topo = ctx.topology
    assert topo is not None and ctx.tp_group is not None, "replica_next_packet outside a TP replica"
    ranks = topo.replica_ranks(ctx.rank)
    mine = torch.tensor([g if ctx.rank == ranks[0] else 0, int(stop_requested)], dtype=torch.int64)
    mine = mine.to(ctx.device, non_blocking=True)
    work = dist.all_reduce(mine, op=dist.ReduceOp.SUM, group=ctx.tp_group, async_op=True)
    _collective_wait(ctx, work, "the replica's next packet (all_reduce)", ranks, timeout_s)
    nxt, stops = (int(x) for x in mine.tolist())  # one host sync per packet
    return nxt, stops > 0


def all_reduce_sum(ctx: DistContext, tensor: Tensor, timeout_s: float | None = None) -> Tensor:
    """In-place SUM all-reduce over the drafter-only group (a no-op with one drafter); returns ``tensor``."""
    return _drafter_all_reduce(ctx, tensor, dist.ReduceOp.SUM, "all_reduce", timeout_s)


def all_reduce_max(ctx: DistContext, tensor: Tensor, timeout_s: float | None = None) -> Tensor:
    """In-place MAX all-reduce over the drafter-only group (a no-op with one drafter); returns ``tensor``."""
    return _drafter_all_reduce(ctx, tensor, dist.ReduceOp.MAX, "all_reduce (max)", timeout_s)


def _drafter_all_reduce(
    ctx: DistContext, tensor: Tensor, op: dist.ReduceOp.RedOpType, what: str, timeout_s: float | None
) -> Tensor:
    ranks = ctx.topology.drafter_ranks if ctx.topology else []
    if len(ranks) <= 1:
        return tensor
    work = dist.all_reduce(tensor, op=op, group=ctx.drafter_group, async_op=True)
    _collective_wait(ctx, work, what, ranks, timeout_s)
    return tensor


def _drafter_all_gather(ctx: DistContext, tensor: Tensor, timeout_s: float | None) -> list[Tensor]:
    """Every drafter's ``tensor`` (same shape everywhere), in drafter order."""
    ranks = ctx.topology.drafter_ranks if ctx.topology else []
    rows = [torch.zeros_like(tensor) for _ in ranks]
    work = dist.all_gather(rows, tensor, group=ctx.drafter_group, async_op=True)
    _collective_wait(ctx, work, "all_gather", ranks, timeout_s)
    return rows


def gather_lists(ctx: DistContext, values: list[int], timeout_s: float | None = None) -> list[list[int]]:
    """Every drafter's list of ints, in drafter order, on every drafter (lists may differ in length).

    Two all-gathers over the drafter group (lengths, then the padded lists); one drafter: ``[values]``.
    """
    ranks = ctx.topology.drafter_ranks if ctx.topology else []
    if len(ranks) <= 1:
        return [list(values)]
    lens = _drafter_all_gather(
        ctx, torch.tensor([len(values)], dtype=torch.int64, device=ctx.device), timeout_s
    )
    mine = torch.zeros(max(int(x.item()) for x in lens), dtype=torch.int64, device=ctx.device)
    mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
    rows = _drafter_all_gather(ctx, mine, timeout_s)
    return [row[: int(k.item())].tolist() for row, k in zip(rows, lens, strict=True)]


def broadcast_text(ctx: DistContext, text: str | None, timeout_s: float | None = None) -> str:
    """The drafter leader's ``text`` on every drafter (the others pass None): two broadcasts over
    the drafter group (the length, then the UTF-8 bytes); one drafter: ``text``."""
    topo = ctx.topology
    assert topo is not None
    ranks = topo.drafter_ranks
    leader = ctx.rank == topo.leader_rank
    if leader and text is None:
        raise ValueError("broadcast_text: the drafter leader passes the text")
    if len(ranks) <= 1:
        return text or ""
    data = (text or "").encode() if leader else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=ctx.device)
    work = dist.broadcast(size, src=topo.leader_rank, group=ctx.drafter_group, async_op=True)
    _collective_wait(ctx, work, "broadcast (length)", ranks, timeout_s)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=ctx.device)
    if leader:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    work = dist.broadcast(buf, src=topo.leader_rank, group=ctx.drafter_group, async_op=True)
    _collective_wait(ctx, work, "broadcast", ranks, timeout_s)
    return bytes(buf.cpu().tolist()).decode()


def shared_run_dir_problems(ctx: DistContext, run_dir: Path, timeout_s: float | None = None) -> list[str]:
    """Every rank sees the leader's run directory (checkpoints, ledger and the lock live there, and a
    torchrun restart may move the leader to another node): the leader writes a random token into
    ``run_dir``, every rank reads it back. Returns the ranks (with their hosts) that do not see it
    (the same list on every rank; empty when the directory is shared)."""
    topo = ctx.topology
    assert topo is not None
    world = list(range(topo.world_size))
    marker = Path(run_dir) / ".dflash.shared-check"
    token = secrets.randbits(62)
    if ctx.rank == topo.leader_rank:
        atomic_write(marker, str(token))
    mine = torch.tensor([token if ctx.rank == topo.leader_rank else 0], dtype=torch.int64, device=ctx.device)
    tokens = [torch.zeros_like(mine) for _ in world]
    _collective_wait(
        ctx, dist.all_gather(tokens, mine, async_op=True), "all_gather (run dir check)", world, timeout_s
    )
    expected = int(tokens[topo.leader_rank].item())
    try:
        seen = marker.read_text().strip() == str(expected)
    except OSError:
        seen = False
    flags = [torch.zeros(1, dtype=torch.int64, device=ctx.device) for _ in world]
    ok = torch.tensor([int(seen)], dtype=torch.int64, device=ctx.device)
    _collective_wait(
        ctx, dist.all_gather(flags, ok, async_op=True), "all_gather (run dir check)", world, timeout_s
    )
    blind = [r for r, f in enumerate(flags) if int(f.item()) == 0]
    if not blind:
        return []
    hosts: list[object] = [None] * topo.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return [f"{topo.describe(r)} on host {hosts[r]}" for r in blind]


def check_replicas(
    ctx: DistContext, model: torch.nn.Module, step: int, timeout_s: float | None = None
) -> None:
    """Every drafter holds the same weights: compares a per-tensor float64 checksum of every
    parameter over the drafters (one all-gather of a few hundred numbers) and raises
    ``RuntimeError`` naming the step, the two drafters and the first tensor that differs."""
    topo = ctx.topology
    ranks = topo.drafter_ranks if topo else []
    if len(ranks) <= 1:
        return
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        mine = torch.stack([p.detach().double().sum() for p in model.parameters()]).to(ctx.device)
    rows = _drafter_all_gather(ctx, mine, timeout_s)
    for r, row in zip(ranks[1:], rows[1:], strict=True):
        differ = (row != rows[0]).nonzero()
        if differ.numel():
            assert topo is not None
            raise RuntimeError(
                f"drafter replicas diverged at step {step}: {topo.describe(r)} differs from "
                f"{topo.describe(ranks[0])} in {names[int(differ[0])]} (and {differ.numel() - 1} more tensors); "
                f"data-parallel drafters must apply the same update: a hardware fault or a bug, not a setting"
            )


def first_contact_hint(backend: str, timeout_s: float) -> str:
    """What usually keeps the first message on a link from arriving, and what to try."""
    lines = [
        f"The first message on this link did not arrive within topology.first_contact_timeout_s={timeout_s:g} s; "
        "no model was loading yet, so the peer is stuck or gone, not busy."
    ]
    if backend == "nccl":
        lines += [
            "On PCIe hosts NCCL's first peer-to-peer transfer often hangs when PCIe ACS or the IOMMU is on "
            "(RTX PRO 6000 / Blackwell workstations, many consumer boards): rerun with NCCL_P2P_DISABLE=1 "
            "(through host memory: slower, works), or disable ACS in the BIOS / boot with iommu=pt.",
            "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P shows where it stops; "
            "make gpu-check tests every link of the host.",
        ]
    lines.append(
        "Check that every rank started (torchrun's log) and that MASTER_ADDR/MASTER_PORT reach rank 0; "
        "a slower start: topology.first_contact_timeout_s=<seconds>."
    )
    return "\n".join(lines)


def warm_up_links(
    topology: Topology,
    rank: int,
    device: torch.device,
    timeout_s: float,
    *,
    groups: Mapping[tuple[int, int], LinkGroups] | None = None,
) -> None:
    """Exchange one small tensor on every (target, drafter) link, data and control direction, on
    the link's groups (``groups``: (target, drafter) -> ``LinkGroups``, e.g. ``DistContext.link_groups``;
    None: the default group).

    Every rank walks the links in one global order, so this cannot deadlock. Without eager NCCL
    init it also creates the links' communicators up front (their creation blocks until both ends
    join), so the first real packet or ACK never stalls on it. Peers that do not answer within
    ``timeout_s`` raise PeerError.
    """
    ep = Endpoint(topology, rank, timeout_s, device)
    role = topology.role_of(rank)
    for t, d in links(topology):
        if rank not in (t, d):
            continue
        lg = groups[(t, d)] if groups is not None else LinkGroups()
        buf = torch.full((1,), rank, dtype=torch.int64, device=device)
        if role == "target":
            ep._wait(ep._post(dist.isend, buf, d, lg.data, "send warm-up", None), d, "send warm-up", None)
            ep._wait(ep._post(dist.irecv, buf, d, lg.control, "recv warm-up", None), d, "recv warm-up", None)
            if int(buf.item()) != d:
                raise ProtocolError(
                    f"{ep.me}: warm-up from {topology.describe(d)}: expected {d}, got {int(buf.item())}"
                )
        else:
            ep._wait(ep._post(dist.irecv, buf, t, lg.data, "recv warm-up", None), t, "recv warm-up", None)
            if int(buf.item()) != t:
                raise ProtocolError(
                    f"{ep.me}: warm-up from {topology.describe(t)}: expected {t}, got {int(buf.item())}"
                )
            buf.fill_(rank)
            ep._wait(ep._post(dist.isend, buf, t, lg.control, "send warm-up", None), t, "send warm-up", None)
