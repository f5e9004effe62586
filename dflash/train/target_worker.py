"""TargetWorker: data plan -> headless target forward -> packet -> send to the drafter.

Target replica r produces the packets g with g mod N == r, from the resume point the drafter leader
broadcasts, in order, never more than ``topology.max_in_flight`` ahead of the drafter's ACKs.
Samples whose hidden states are not finite are dropped from the packet and counted in its header;
the drafter never sees them.

A tensor-parallel replica (``topology.target_tp`` = k > 1) is k ranks holding one sharded target:
all of them run every forward of the replica (the forward is collective), in lockstep: before each
one they agree on the packet (``replica_next_packet``: the sender's next packet or -1 for the end,
and whether any of them got a stop signal). Only the sender (the replica's first rank) builds the
packet (gather, non-finite check, stats) and has links (sends, ACKs, backpressure); the others run
the forward and discard it. A rank of the replica that dies makes the others' next collective fail:
a ``PeerError`` naming the replica's ranks.
"""

from __future__ import annotations

import contextlib
import logging
import signal

from dflash.config import STOP_SIGNALS, Config
from dflash.config.resolve import torch_dtype
from dflash.distributed.collectives import agree_on_start, replica_next_packet
from dflash.distributed.links import TargetLink, replica_peer_errors
from dflash.distributed.process_group import DistContext, set_timeout
from dflash.distributed.protocol import FLAG_STOP_REQUESTED, Packet
from dflash.distributed.topology import linked_drafters
from dflash.targets.loader import load_target
from dflash.train import faults
from dflash.train.packets import PacketMaker
from dflash.train.setup import RunSetup

log = logging.getLogger(__name__)


class TargetWorker:
    """The target role (ranks 0..N*k-1): frozen model (or its shard), forward passes, packets."""

    def __init__(self, cfg: Config, setup: RunSetup, ctx: DistContext) -> None:
        self.cfg, self.setup, self.ctx = cfg, setup, ctx
        self.faults = faults.injected()
        self.topology = setup.topology
        self.device = ctx.device
        self.dtype = torch_dtype(cfg.target.dtype, self.device)
        self.name = self.topology.describe(ctx.rank)
        self.replica = self.topology.replica_ranks(ctx.rank)
        self.is_sender = ctx.rank == self.replica[0]
        self.stop_requested = False
        self._previous_handlers = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        model = load_target(cfg.target, self.device, self.dtype, tp_group=ctx.tp_group)
        self.packets = PacketMaker(cfg, setup, model, self.device)
        spec = setup.packet_spec(self.dtype, self.device)
        self.links = {
            d: TargetLink(
                self.topology,
                ctx.rank,
                d,
                spec,
                cfg.topology.init_timeout_s,
                cfg.topology.max_in_flight,
                groups=ctx.link_groups[(ctx.rank, d)],
            )
            for d in linked_drafters(self.topology, ctx.rank)
        }

    def _on_signal(self, signum: int, frame: object) -> None:
        log.warning(
            "%s: got %s; asking the drafters to stop at the next step",
            self.name,
            signal.Signals(signum).name,
        )
        self.stop_requested = True

    def close(self, exit_code: int = 0) -> None:
        for s, h in self._previous_handlers.items():
            signal.signal(s, h)

    def run(self) -> int:
        """Produce this replica's packets until the last one or the drafters' STOP; returns 0."""
        start, num_steps = agree_on_start(self.ctx, self.topology, 0, self.setup.num_steps)
        end = num_steps * self.topology.packets_per_step
        done = 0
        for planned in [*self.topology.packets_of_target(self.ctx.rank, start, end), -1]:
            g, stop = self._next_packet(planned)
            if g < 0:
                break
            faults.at_step(self.faults, self.ctx.rank, g // self.topology.packets_per_step + 1)
            packet = None
            with self._replica_errors():  # the sender makes the packet, the others only forward
                if self.is_sender:
                    packet = self.packets.make(g, FLAG_STOP_REQUESTED if stop else 0)
                else:
                    self.packets.forward_only(g)
            if packet is not None:
                self._send(packet)
            done += 1
        for link in self.links.values():
            link.wait_for_stop()
            link.send_end()
        log.info("%s done: %d packets %s", self.name, done, "sent" if self.is_sender else "forwarded")
        return 0

    def _next_packet(self, planned: int) -> tuple[int, bool]:
        """``(g, stop)``: the packet this rank makes next (-1: none; a STOP from any drafter ends
        the replica) and whether a stop was asked for. One rank per target: its own plan; a
        tensor-parallel replica: what its sender says (``replica_next_packet``), checked against
        this rank's own plan."""
        stopped = any(link.stopped for link in self.links.values())
        g = -1 if stopped else planned
        if self.ctx.tp_group is None:
            return g, self.stop_requested
        g, stop = replica_next_packet(self.ctx, g, self.stop_requested, self.ctx.tp_wait_s)
        if g not in (-1, planned):
            raise RuntimeError(
                f"{self.name}: the replica's sender makes packet {g} next, this rank's data plan says "
                f"{planned}: every rank must use the same data, seed and config"
            )
        return g, stop

    def _replica_errors(self) -> contextlib.AbstractContextManager[None]:
        """A failed collective inside a sharded forward names the replica (a dead or stuck rank)."""
        if self.ctx.tp_group is None:
            return contextlib.nullcontext()
        return replica_peer_errors(self.name, [self.topology.describe(r) for r in self.replica])

    def _send(self, packet: Packet) -> None:
        """Send ``packet`` to its drafter; after that drafter's first step, wait for it only
        ``2 x step_timeout_s``."""
        # A drafter may itself wait up to step_timeout_s for another target's packet: wait twice that for
        # it, so that a stuck target is reported by the drafter waiting on it, not by a peer as a stuck drafter.
        drafter_timeout = 2 * self.cfg.topology.step_timeout_s
        d = self.topology.consumer_of(packet.index)
        link = self.links[d]
        link.send(packet)
        if link.peer_stepped and link.timeout_s != drafter_timeout:
            # The drafter finished a step (an ACK on receipt comes before it; its first step loads
            # and compiles): init_timeout_s is over for this link.
            link.set_timeout(drafter_timeout)
            set_timeout(self.ctx, drafter_timeout, link=(self.ctx.rank, d))
            log.info(
                "%s finished a step: %s waits at most %gs for it from now",
                link.peer_name,
                self.name,
                drafter_timeout,
            )
