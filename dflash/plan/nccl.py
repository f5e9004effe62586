"""NCCL's own GPU memory per rank, estimated: part of what ``plan.reserved_gib`` must cover beside
the CUDA context and allocator slack (the rehearsal measures tensors only).

NCCL allocates per channel and per connection, not per byte moved, and every communicator its own
(NVIDIA/nccl#986: memory is linear in the channels, which follow the link's bandwidth; a ring holds
two connections whatever the scale). A collective connection holds the FIFOs of its three protocols
(about 10 MiB per channel: ``NCCL_DEBUG_SUBSYS=ALLOC`` in NVIDIA/nccl#1685), a send/receive connection
a 2 MiB chunk buffer per channel (#1685, where 8 H100 used 32 channels per pair of GPUs for an
all-to-all). Channels per link here: :data:`CHANNELS`, the typical counts ``NCCL_DEBUG=INFO`` prints
as ``Channel xx/yy`` (fewer on PCIe: NCCL opens as many as the bandwidth needs).

What each rank opens (:mod:`dflash.distributed`): a target sends packets to the drafters it feeds
and receives their acknowledgements (two send/receive connections per drafter), and joins its
tensor-parallel group's collectives; a drafter the mirror image toward the targets, the drafters'
gradient all-reduce and the world's collectives (barriers, the stop); a co-located rank the world's
collectives only. These are estimates: ``make gpu-check`` reports what a GPU host really reserves.
"""

from __future__ import annotations

from dflash.plan.links import Link

MIB = 2**20
COLLECTIVE_BYTES_PER_CHANNEL = 10 * MIB
"""A collective connection's FIFOs (Simple ``NCCL_BUFFSIZE`` 4 MiB, LL128, LL) per channel."""
P2P_BYTES_PER_CHANNEL = 2 * MIB
"""A send/receive connection's chunk buffer per channel."""
RING_CONNECTIONS = 2
"""Connections a rank holds in a ring collective (its two neighbours; trees add at most one)."""
CHANNELS = {"NVLink": 32, "PCIe P2P": 4, "PCIe via host memory": 2, "network": 8}
"""Typical NCCL channels per connection by link kind (:class:`dflash.plan.links.Link`)."""


def nccl_bytes(link: Link, *, collectives: int, p2p_peers: int) -> int:
    """Bytes of NCCL buffers on a rank in ``collectives`` collective communicators (of more than one
    rank) that exchanges point-to-point messages with ``p2p_peers`` ranks, both ways."""
    ch = CHANNELS[link.kind]
    ring = collectives * RING_CONNECTIONS * ch * COLLECTIVE_BYTES_PER_CHANNEL
    return ring + p2p_peers * 2 * ch * P2P_BYTES_PER_CHANNEL


def nccl_gib_per_role(
    link: Link, *, num_targets: int, num_drafters: int, target_tp: int, colocated: bool
) -> dict[str, float]:
    """Estimated GiB of NCCL buffers on a ``target`` and a ``drafter`` rank of an ``N:M`` split (each
    target replica of ``target_tp`` GPUs sends from one rank; the bound: every target feeds every
    drafter), or on a ``colocated`` rank (``num_targets`` ranks, the world's collectives only)."""
    if colocated:
        return {"colocated": nccl_bytes(link, collectives=int(num_targets > 1), p2p_peers=0) / 2**30}
    world = num_targets * target_tp + num_drafters
    world_collective = int(world > 1)
    target = nccl_bytes(link, collectives=world_collective + int(target_tp > 1), p2p_peers=num_drafters)
    drafter = nccl_bytes(link, collectives=world_collective + int(num_drafters > 1), p2p_peers=num_targets)
    return {"target": target / 2**30, "drafter": drafter / 2**30}
