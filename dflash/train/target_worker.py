"""TargetWorker: data plan -> headless target forward -> packet -> send to the drafter.

Target rank t produces the packets g with g mod N == t, from the resume point the drafter leader
broadcasts, in order, never more than ``topology.max_in_flight`` ahead of the drafter's ACKs.
Samples whose hidden states are not finite are dropped from the packet and counted in its header;
the drafter never sees them.
"""

from __future__ import annotations

import logging
import signal

from dflash.config import STOP_SIGNALS, Config
from dflash.config.resolve import torch_dtype
from dflash.distributed.collectives import agree_on_start
from dflash.distributed.links import TargetLink
from dflash.distributed.process_group import DistContext, set_timeout
from dflash.distributed.protocol import FLAG_STOP_REQUESTED
from dflash.distributed.topology import linked_drafters
from dflash.targets.loader import load_target
from dflash.train import faults
from dflash.train.packets import PacketMaker
from dflash.train.setup import RunSetup

log = logging.getLogger(__name__)


class TargetWorker:
    """The target role (ranks 0..N-1): frozen model, forward passes, packets."""

    def __init__(self, cfg: Config, setup: RunSetup, ctx: DistContext) -> None:
        self.cfg, self.setup, self.ctx = cfg, setup, ctx
        self.topology = setup.topology
        self.device = ctx.device
        self.dtype = torch_dtype(cfg.target.dtype, self.device)
        self.stop_requested = False
        self._previous_handlers = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        self.packets = PacketMaker(cfg, setup, load_target(cfg.target, self.device, self.dtype), self.device)
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
            "target rank %d: got %s; asking the drafters to stop at the next step",
            self.ctx.rank,
            signal.Signals(signum).name,
        )
        self.stop_requested = True

    def close(self, exit_code: int = 0) -> None:
        for s, h in self._previous_handlers.items():
            signal.signal(s, h)

    def run(self) -> int:
        """Produce this target's packets until the last one or the drafters' STOP; returns 0."""
        start, num_steps = agree_on_start(self.ctx, self.topology, 0, self.setup.num_steps)
        end = num_steps * self.topology.packets_per_step
        sent = 0
        # A drafter may itself wait up to step_timeout_s for another target's packet: wait twice that for
        # it, so that a stuck target is reported by the drafter waiting on it, not by a peer as a stuck drafter.
        drafter_timeout = 2 * self.cfg.topology.step_timeout_s
        for g in self.topology.packets_of_target(self.ctx.rank, start, end):
            if any(link.stopped for link in self.links.values()):
                break
            faults.at_step(self.cfg.fault, self.ctx.rank, g // self.topology.packets_per_step + 1)
            d = self.topology.consumer_of(g)
            link = self.links[d]
            link.send(self.packets.make(g, FLAG_STOP_REQUESTED if self.stop_requested else 0))
            if link.peer_stepped and link.timeout_s != drafter_timeout:
                # The drafter finished a step (an ACK on receipt comes before it; its first step loads
                # and compiles): init_timeout_s is over for this link.
                link.set_timeout(drafter_timeout)
                set_timeout(self.ctx, drafter_timeout, link=(self.ctx.rank, d))
                log.info(
                    "%s finished a step: %s waits at most %gs for it from now",
                    link.peer_name,
                    self.topology.describe(self.ctx.rank),
                    drafter_timeout,
                )
            sent += 1
        for link in self.links.values():
            link.wait_for_stop()
            link.send_end()
        log.info("target rank %d done: %d packets sent", self.ctx.rank, sent)
        return 0
