"""TargetLink and DrafterLink: the only code that sends or receives packets.

Packets follow the Topology schedule (packet g: target g mod N -> drafter g mod M), so there is
never an any-source receive. Every wait has a timeout, and every backend failure (timeout, closed
connection) becomes a ``PeerError`` naming both sides and the operation; on gloo a timed-out pair
is closed for good, so a ``PeerError`` is fatal for the link. The wire format is
``dflash.distributed.protocol``. A link's packets travel on its ``LinkGroups.data`` group and the
drafter -> target ACK/STOP messages on its ``LinkGroups.control`` group (``DistContext.link_groups``:
two 2-rank groups per link, see ``dflash.distributed.process_group`` for why NCCL needs them);
``groups=None`` puts both on the default group (gloo tests only: on NCCL every op of a group shares
one stream). Host-to-device copies here are non-blocking (a blocking one synchronises the stream).

A drafter's receives overlap its compute: NCCL starts an op only after the work queued before it on
the stream it was issued from, and a host read waits for everything queued on its stream, so a
``DrafterLink`` on CUDA issues its receives, ACKs and host reads of headers and payload fields from
its own stream (``link_stream``), never from the compute stream. ``prefetch(g)`` posts packet g's
header receive and, once the header is in, its payload receive, without blocking: called while
packet g-1 is computed, the transfer of g runs beside it. ``recv(g)`` then makes the compute stream
wait for the payload (and records the buffers on it) before handing the packet over.

Usage (one ``TargetLink`` per drafter a target feeds, see ``linked_drafters``):

    # target                                        # drafter
    links = {d: TargetLink(topo, rank, d, spec,     link = DrafterLink(topo, rank, spec, timeout_s,
                           timeout_s, max_in_flight,                   groups=ctx.drafter_links())
                           groups=ctx.link_groups[  link.prefetch(first)
                                      (rank, d)])   for g in my packets:
             for d in linked_drafters(topo, rank)}      pkt = link.recv(g); link.ack(g)
    for g in topo.packets_of_target(rank, a, b):        link.prefetch(next g)
        link = links[topo.consumer_of(g)]               ... queue the compute of pkt ...
        link.send(make_packet(g))                       link.prefetch(next g)  # payload, if in
        if link.stopped: break                      link.first_step_done()  # after the first
    for link in links.values():                     link.stop_all()   # STOP, drain until END
        link.wait_for_stop(); link.send_end()

A drafter's ACKs say whether it has finished a step (``first_step_done``; ``TargetLink.peer_stepped``):
its first step includes loading and compiling, so a target keeps its long timeout until then.

Without ``start_index`` a link's first packet index is fixed by its first ``send`` (target) or
``prefetch``/``recv`` (drafter, per target), so a resumed run just starts at the packet that
``agree_on_start`` returns (``dflash.distributed.collectives``, as is ``warm_up_links``).
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dflash.distributed.protocol import (
    CONTROL_LEN,
    CTRL_ACK,
    CTRL_FLAG_STEPPED,
    CTRL_NAMES,
    CTRL_STOP,
    HEADER_LEN,
    KIND_END,
    Header,
    Packet,
    PacketSpec,
    ProtocolError,
    check_packet,
    data_header,
    decode_header,
    encode_control,
    encode_header,
    end_header,
    host_fields,
    packet_from_payload,
    payload_buffers,
    payload_tensors,
    validate_header,
    validate_payload,
)
from dflash.distributed.topology import Topology, first_on_link, link_period, linked_targets

log = logging.getLogger(__name__)


class PeerError(RuntimeError):
    """A dead or stuck peer: names our role and rank, the peer, the operation and the timeout."""


@dataclass(frozen=True)
class LinkGroups:
    """The process groups one (target, drafter) link travels on (None: the default group)."""

    data: Any = None
    """Target -> drafter packets (headers and payloads)."""
    control: Any = None
    """Drafter -> target ACK/STOP messages."""


# ----------------------------------------------------------------------------------------------
# Waiting with timeouts; backend failures -> PeerError


_WAITED_FOR = {
    "recv header": "packet header",
    "recv payload": "packet payload",
    "recv ACK": "ACK",
    "recv STOP": "STOP",
    "recv control": "control message",
    "recv warm-up": "warm-up message",
}


def short_error(err: BaseException) -> str:
    """The gist of a backend error: first line, without gloo's source location and advice."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)
    return first.split(". This is typically")[0].rstrip(".") or type(err).__name__


def is_collective_failure(err: BaseException) -> bool:
    """A failed or timed-out collective (gloo's transport errors, NCCL's ``DistBackendError``), as
    opposed to an error of the model itself."""
    text = str(err).lower()
    return isinstance(err, dist.DistError) or "gloo" in text or "nccl" in text or "timed out" in text


@contextmanager
def replica_peer_errors(me: str, replica: list[str]) -> Iterator[None]:
    """Inside the block (a forward of a target sharded over a tensor-parallel replica), a failed
    collective is a :class:`PeerError` naming ``me`` and the ranks of the replica, as any dead or
    stuck peer is named: a rank of a replica that dies makes the others' next all-reduce fail (gloo
    at once, "Connection reset by peer"; NCCL when its watchdog times the collective out). With two
    ranks the other one is named as the dead or stuck rank."""
    others = [r for r in replica if r != me]
    culprit = f"{others[0]} is" if len(others) == 1 else "a rank of this replica is"
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, PeerError) or not is_collective_failure(e):
            raise
        raise PeerError(
            f"{me}: the tensor-parallel all-reduce of the target forward among [{', '.join(replica)}] failed "
            f"({short_error(e)}); {culprit} dead or stuck"
        ) from e


def is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


class Endpoint:
    """Shared by both link ends: naming, timeouts, and turning backend failures into PeerError."""

    def __init__(self, topology: Topology, rank: int, timeout_s: float, device: torch.device) -> None:
        self.topology = topology
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device)
        self.me = topology.describe(rank)
        self._broken: BaseException | None = None

    def set_timeout(self, seconds: float) -> None:
        """Timeout of every later wait (e.g. init_timeout_s until the first step, then step_timeout_s)."""
        self.timeout_s = float(seconds)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise PeerError(
                f"{self.me}: link unusable after an earlier failure: {self._broken}"
            ) from self._broken

    def _fail(self, err: BaseException) -> BaseException:
        self._broken = err
        return err

    def _peer_error(
        self, peer: int, op: str, g: int | None, timeout: float, cause: BaseException | None
    ) -> PeerError:
        peer_name = self.topology.describe(peer)
        role = self.topology.role_of(peer)
        pkt = f" for packet {g}" if g is not None else ""
        if cause is None or is_timeout(cause):
            if op.startswith("send"):
                return PeerError(
                    f"{self.me}: {op} to {peer_name}{pkt} did not complete within {timeout:g}s ({op}); "
                    f"the {role} is dead or stuck"
                )
            what = _WAITED_FOR.get(op, op)
            return PeerError(
                f"{self.me}: no {what} from {peer_name}{pkt} within {timeout:g}s ({op}); the {role} is dead or stuck"
            )
        return PeerError(
            f"{self.me}: {op} with {peer_name}{pkt} failed ({short_error(cause)}; timeout {timeout:g}s); "
            f"the {role} died or its connection broke"
        )

    def _post(self, fn, tensor: Tensor, peer: int, group, op: str, g: int | None):
        try:
            work = fn(tensor, peer, group=group)
        except Exception as e:  # noqa: BLE001 - any backend failure means the peer is gone
            raise self._fail(self._peer_error(peer, op, g, self.timeout_s, e)) from e
        if work is None:
            raise RuntimeError(f"{self.me}: {op} to/from rank {peer}: this rank is not in the process group")
        return work

    def _wait(self, work, peer: int, op: str, g: int | None, timeout: float | None = None) -> None:
        timeout = self.timeout_s if timeout is None else float(timeout)
        try:
            ok = work.wait(timeout=timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001
            raise self._fail(self._peer_error(peer, op, g, timeout, e)) from e
        if ok is False:
            raise self._fail(self._peer_error(peer, op, g, timeout, None))

    def _done(self, work, peer: int, op: str, g: int | None) -> bool:
        """Non-blocking completion check that surfaces a failed work as PeerError."""
        try:
            done = work.is_completed()
        except Exception as e:  # noqa: BLE001
            raise self._fail(self._peer_error(peer, op, g, self.timeout_s, e)) from e
        if done:
            self._wait(work, peer, op, g, timeout=max(self.timeout_s, 1.0))  # raises if it failed
        return done


# ----------------------------------------------------------------------------------------------
# Target end


@dataclass
class _Outgoing:
    g: int
    works: list
    tensors: list[Tensor]


class TargetLink(Endpoint):
    """A target's link to one drafter: sends packets in schedule order with ACK backpressure.

    ``send`` keeps at most ``max_in_flight`` packets un-ACKed: before posting a packet it reads
    control messages until the window has room (reading one is a device-to-host copy of 4 int64s,
    made right after the packet's own sync in ``PacketMaker.make``, when the stream is idle). A STOP sets ``stopped``; ``send`` then returns
    without sending, and the caller ends with ``send_end``. After its last packet a target calls
    ``wait_for_stop`` and then ``send_end``.
    """

    def __init__(
        self,
        topology: Topology,
        rank: int,
        drafter_rank: int,
        spec: PacketSpec,
        timeout_s: float,
        max_in_flight: int,
        *,
        start_index: int | None = None,
        groups: LinkGroups | None = None,
    ) -> None:
        super().__init__(topology, rank, timeout_s, spec.device)
        if topology.role_of(rank) != "target" or topology.role_of(drafter_rank) != "drafter":
            raise ValueError(
                f"TargetLink needs a target rank and a drafter rank, got {rank} -> {drafter_rank}"
            )
        if max_in_flight < 1:
            raise ValueError(f"topology.max_in_flight={max_in_flight}: must be >= 1")
        first = first_on_link(topology, rank, drafter_rank, start_index or 0)
        if first is None:
            raise ValueError(
                f"{topology.describe(rank)} never sends to {topology.describe(drafter_rank)} "
                f"(gcd({topology.num_targets}, {topology.num_drafters}) > 1); use linked_drafters()"
            )
        self.peer = drafter_rank
        self.peer_name = topology.describe(drafter_rank)
        self.spec = spec
        self.max_in_flight = int(max_in_flight)
        groups = groups or LinkGroups()
        self.data_group = groups.data
        self.control_group = groups.control
        self.next_index = first
        self._start_known = start_index is not None
        self.stopped = False
        self.ended = False
        self.peer_stepped = False
        """The drafter has finished a step (its ACKs say so): loading and compiling are over."""
        self.num_sent = 0
        self.num_acked = 0
        self.max_unacked_seen = 0
        self._period = link_period(topology)
        self._outgoing: deque[_Outgoing] = deque()
        self._ctrl_buf: Tensor | None = None
        self._ctrl_work = None

    @property
    def num_unacked(self) -> int:
        return self.num_sent - self.num_acked

    def _on_link(self, g: int) -> bool:
        return (
            g >= 0 and self.topology.producer_of(g) == self.rank and self.topology.consumer_of(g) == self.peer
        )

    # -- control channel
    def _post_control(self) -> None:
        if self._ctrl_work is None and not self.stopped:
            self._ctrl_buf = torch.zeros(CONTROL_LEN, dtype=torch.int64, device=self.device)
            self._ctrl_work = self._post(
                dist.irecv, self._ctrl_buf, self.peer, self.control_group, "recv control", None
            )

    def _handle_control(self) -> None:
        assert self._ctrl_buf is not None, "no control receive posted"
        msg = [int(x) for x in self._ctrl_buf.tolist()]
        self._ctrl_work, self._ctrl_buf = None, None
        kind, g, flags = msg[0], msg[1], msg[2]
        src = f"control message from {self.peer_name}"
        if kind not in CTRL_NAMES or flags & ~CTRL_FLAG_STEPPED or msg[3] != 0:
            raise self._fail(
                ProtocolError(
                    f"{src}: field kind expected ACK(1) or STOP(2), flags 0 or {CTRL_FLAG_STEPPED} and a zero "
                    f"spare, got {msg}"
                )
            )
        self.peer_stepped = self.peer_stepped or bool(flags & CTRL_FLAG_STEPPED)
        if kind == CTRL_STOP:
            self.stopped = True
            log.info(
                "%s: STOP from %s after %d packets (%d acked)",
                self.me,
                self.peer_name,
                self.num_sent,
                self.num_acked,
            )
            return
        if not self._outgoing:
            raise self._fail(
                ProtocolError(f"{src}: field g expected no ACK (nothing in flight), got ACK for {g}")
            )
        oldest = self._outgoing[0]
        if g != oldest.g:
            raise self._fail(
                ProtocolError(f"{src}: field g expected {oldest.g} (oldest un-ACKed packet), got {g}")
            )
        self._outgoing.popleft()
        for w in oldest.works:  # the drafter consumed it, so these are complete: free the tensors
            self._wait(w, self.peer, "send packet", oldest.g)
        self.num_acked += 1
        self._post_control()

    def _poll_control(self) -> None:
        while self._ctrl_work is not None and self._done(self._ctrl_work, self.peer, "recv control", None):
            self._handle_control()

    def _next_control(self, op: str, timeout: float | None = None) -> None:
        self._post_control()
        self._wait(self._ctrl_work, self.peer, op, None, timeout)
        self._handle_control()

    # -- data channel
    def send(self, packet: Packet) -> None:
        """Send packet ``packet.index`` (must be this link's next index) unless the drafter said STOP."""
        self._check_usable()
        if self.ended:
            raise RuntimeError(f"{self.me}: send after send_end")
        if not self._start_known and self.num_sent == 0 and self._on_link(packet.index):
            self.next_index = packet.index  # the first packet fixes the start (resume point)
        if packet.index != self.next_index:
            raise ValueError(
                f"{self.me}: packet {packet.index} sent out of schedule order; the next packet of the link to "
                f"{self.peer_name} is {self.next_index}"
            )
        check_packet(packet, self.spec)
        self._poll_control()
        while not self.stopped and self.num_unacked >= self.max_in_flight:
            self._next_control("recv ACK")
        if self.stopped:
            return
        header = encode_header(data_header(packet, self.spec)).to(self.device, non_blocking=True)
        tensors = [header, *(payload_tensors(packet, self.device) if packet.num_tokens else [])]
        works = [
            self._post(dist.isend, t, self.peer, self.data_group, "send packet", packet.index)
            for t in tensors
        ]
        self._outgoing.append(_Outgoing(packet.index, works, tensors))
        self.num_sent += 1
        self.max_unacked_seen = max(self.max_unacked_seen, self.num_unacked)
        self.next_index += self._period
        # Post the first control receive right away (on NCCL this also creates the control pair).
        self._post_control()

    def wait_for_stop(self, timeout_s: float | None = None) -> None:
        """After the last packet: read control messages (counting ACKs) until STOP."""
        self._check_usable()
        while not self.stopped:
            self._next_control("recv STOP", timeout_s)

    def send_end(self) -> None:
        """Send the END header, then wait until every send of this link has completed."""
        self._check_usable()
        if self.ended:
            return
        if not self.stopped:
            log.warning(
                "%s: END to %s before its STOP: the drafter will report a protocol error if it expects packet %d",
                self.me,
                self.peer_name,
                self.next_index,
            )
        header = encode_header(end_header(self.next_index, self.spec)).to(self.device, non_blocking=True)
        work = self._post(dist.isend, header, self.peer, self.data_group, "send END", self.next_index)
        self._outgoing.append(_Outgoing(self.next_index, [work], [header]))
        while self._outgoing:
            out = self._outgoing.popleft()
            for w in out.works:
                self._wait(w, self.peer, "send packet" if len(out.works) > 1 else "send END", out.g)
        self.ended = True


# ----------------------------------------------------------------------------------------------
# Drafter end


@dataclass
class _HeaderRecv:
    g: int
    work: object
    buf: Tensor


@dataclass
class _Staged:
    """A packet whose header is in and validated and whose payload receive is posted."""

    header: Header
    bufs: list[Tensor]
    works: list


class DrafterLink(Endpoint):
    """A drafter's links to all the targets that feed it (the schedule says who sends packet g)."""

    def __init__(
        self,
        topology: Topology,
        rank: int,
        spec: PacketSpec,
        timeout_s: float,
        *,
        start_index: int | None = None,
        groups: Mapping[int, LinkGroups] | None = None,
    ) -> None:
        super().__init__(topology, rank, timeout_s, spec.device)
        if topology.role_of(rank) != "drafter":
            raise ValueError(f"DrafterLink needs a drafter rank, got {topology.describe(rank)}")
        self.spec = spec
        self._period = link_period(topology)
        self.targets = linked_targets(topology, rank)
        missing = [t for t in self.targets if groups is not None and t not in groups]
        if missing:
            raise ValueError(f"{self.me}: no process groups for the links from ranks {missing}")
        self._groups = {t: (groups[t] if groups is not None else LinkGroups()) for t in self.targets}
        self._stepped = False
        # Next packet expected from each target; None until the first prefetch/recv fixes it (resume).
        self._next: dict[int, int | None] = {
            t: None if start_index is None else first_on_link(topology, t, rank, start_index)
            for t in self.targets
        }
        self._posted: dict[int, _HeaderRecv | None] = {t: None for t in self.targets}
        self._staged: dict[int, _Staged | None] = {t: None for t in self.targets}
        self._deferred: dict[int, list[int]] = {t: [] for t in self.targets}
        self._acks: deque[tuple[int, int, object, Tensor]] = deque()
        self._ended: set[int] = set()
        self.stopped = False
        self.last_wait_s = 0.0
        self.total_wait_s = 0.0
        self.num_received = 0
        self.link_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        """The stream this link issues its work from on CUDA (None on the CPU): see the module docstring."""

    def _on_link_stream(self) -> Any:
        return torch.cuda.stream(self.link_stream) if self.link_stream is not None else nullcontext()

    def _producer(self, g: int) -> int:
        if self.topology.consumer_of(g) != self.rank:
            raise ValueError(
                f"{self.me}: packet {g} belongs to {self.topology.describe(self.topology.consumer_of(g))}"
            )
        return self.topology.producer_of(g)

    def _post_header(self, t: int, g: int) -> _HeaderRecv:
        if self._next[t] is None:
            self._next[t] = g
        if g != self._next[t]:
            raise ValueError(
                f"{self.me}: packets of {self.topology.describe(t)} must be received in schedule order: "
                f"next is {self._next[t]}, asked for {g}"
            )
        buf = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        rec = _HeaderRecv(g, self._post(dist.irecv, buf, t, self._groups[t].data, "recv header", g), buf)
        self._posted[t] = rec
        return rec

    def prefetch(self, g: int) -> None:
        """Post what can be posted of packet g's receive without waiting: its header receive
        (deferred until the same target's earlier payload is posted) and, once that header is in,
        its payload receive. Call it again once the current packet's compute is queued."""
        self._check_usable()
        if self.stopped:
            return
        t = self._producer(g)
        with self._on_link_stream():
            staged, rec = self._staged[t], self._posted[t]
            if (staged is not None and staged.header.g == g) or g in self._deferred[t]:
                return
            if rec is None and staged is None and (self._next[t] is None or g == self._next[t]):
                rec = self._post_header(t, g)
            elif rec is None or rec.g != g:
                self._deferred[t] = sorted({*self._deferred[t], g})
                return
            if staged is None and self._done(rec.work, t, "recv header", g):
                self._stage(t, g)

    def _take_header(self, t: int, g: int) -> tuple[Header, Tensor]:
        rec = self._posted[t]
        if rec is None:
            if self._deferred[t] and self._deferred[t][0] == g:
                self._deferred[t].pop(0)
            rec = self._post_header(t, g)
        elif rec.g != g:
            raise ValueError(
                f"{self.me}: header of packet {rec.g} is pending from {self.topology.describe(t)}, asked for {g}"
            )
        self._wait(rec.work, t, "recv header", g)
        self._posted[t] = None
        return decode_header(rec.buf.cpu()), rec.buf

    def _first_header(self, t: int) -> Header:
        """The next header of a target whose start is unknown (drain only): any index of this link."""
        buf = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        self._wait(
            self._post(dist.irecv, buf, t, self._groups[t].data, "recv header", None), t, "recv header", None
        )
        h = decode_header(buf.cpu())
        on_link = (
            h.g >= 0 and self.topology.producer_of(h.g) == t and self.topology.consumer_of(h.g) == self.rank
        )
        if not on_link:
            raise self._fail(
                ProtocolError(
                    f"packet header from {self.topology.describe(t)}: field g expected a packet of its link to "
                    f"{self.me}, got {h.g}"
                )
            )
        return h

    def _post_payload(self, t: int, h: Header) -> _Staged:
        """Post the receive of h's payload, then the header receive deferred behind it."""
        bufs = payload_buffers(h, self.device)
        # An empty packet (every sample dropped by the target) has no payload on the wire.
        works = [
            self._post(dist.irecv, b, t, self._groups[t].data, "recv payload", h.g)
            for b in bufs
            if h.total_tokens
        ]
        self._next[t] = h.g + self._period
        ahead = self._deferred[t]
        if ahead and ahead[0] == self._next[t]:
            self._post_header(t, ahead.pop(0))
        return _Staged(h, bufs, works)

    def _stage(self, t: int, g: int) -> _Staged:
        """(On the link stream.) Packet g's header taken and validated, its payload receive posted."""
        h, _ = self._take_header(t, g)
        try:
            validate_header(h, expect_g=g, spec=self.spec, sender=self.topology.describe(t))
        except ProtocolError as e:
            raise self._fail(e) from None
        staged = self._staged[t] = self._post_payload(t, h)
        return staged

    def _wait_payload(self, t: int, staged: _Staged) -> None:
        for w in staged.works:
            self._wait(w, t, "recv payload", staged.header.g)

    def recv(self, g: int) -> Packet:
        """Packet g from its target: header (validated), then payload (validated), ready for the
        compute stream."""
        self._check_usable()
        if self.stopped:
            raise RuntimeError(f"{self.me}: recv({g}) after stop_all")
        t = self._producer(g)
        sender = self.topology.describe(t)
        t0 = time.perf_counter()
        with self._on_link_stream():
            staged = self._staged[t]
            if staged is None:
                staged = self._stage(t, g)
            elif staged.header.g != g:
                raise ValueError(
                    f"{self.me}: packet {staged.header.g} is being received from {sender}, asked for {g}"
                )
            self._staged[t] = None
            self._wait_payload(t, staged)
            packet = packet_from_payload(staged.header, staged.bufs)
            host = host_fields(packet)  # the one read of the payload on the host
            try:
                validate_payload(staged.header, host.seq_lens, host.sample_ids, host.loss_mask, sender=sender)
            except ProtocolError as e:
                raise self._fail(e) from None
        if self.link_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.link_stream)
            for b in staged.bufs:
                b.record_stream(compute)
        self.last_wait_s = time.perf_counter() - t0
        self.total_wait_s += self.last_wait_s
        self.num_received += 1
        self._reap_acks()
        return packet

    def _send_control(self, kind: int, g: int, t: int) -> None:
        flags = CTRL_FLAG_STEPPED if self._stepped else 0
        op = "send ACK" if kind == CTRL_ACK else "send STOP"
        with self._on_link_stream():
            msg = encode_control(kind, g, flags).to(self.device, non_blocking=True)
            self._acks.append((t, g, self._post(dist.isend, msg, t, self._groups[t].control, op, g), msg))

    def _reap_acks(self) -> None:
        while self._acks and self._done(self._acks[0][2], self._acks[0][0], "send control", self._acks[0][1]):
            self._acks.popleft()

    def first_step_done(self) -> None:
        """This drafter finished its first step: later control messages say so, and their targets
        lower their timeouts (``TargetLink.peer_stepped``)."""
        self._stepped = True

    def ack(self, g: int) -> None:
        """Tell packet g's target that g is consumed (non-blocking; completion checked later)."""
        self._check_usable()
        self._send_control(CTRL_ACK, g, self._producer(g))
        self._reap_acks()

    def _drain(self, t: int) -> int:
        """(On the link stream, after STOP.) Receive target t's packets until its END; returns how many."""
        sender = self.topology.describe(t)
        discarded = 0
        while t not in self._ended:
            self._deferred[t] = []
            nxt = self._next[t]
            if nxt is None:  # nothing asked of this target yet: take its first header as is
                h = self._first_header(t)
                g = h.g
            else:
                g = nxt
                h, _ = self._take_header(t, g)
            try:
                validate_header(h, expect_g=g, spec=self.spec, sender=sender, allow_end=True)
            except ProtocolError as e:
                raise self._fail(e) from None
            if h.kind == KIND_END:
                self._ended.add(t)
                break
            self._wait_payload(t, self._post_payload(t, h))
            discarded += 1
        return discarded

    def stop_all(self) -> int:
        """STOP every target, then drain each one's in-flight packets until its END; returns packets discarded."""
        self._check_usable()
        self.stopped = True
        for t in self.targets:
            if t not in self._ended:
                nxt = self._next[t]
                self._send_control(CTRL_STOP, -1 if nxt is None else nxt, t)
        with self._on_link_stream():
            discarded = 0
            for t in self.targets:
                staged, self._staged[t] = self._staged[t], None
                if staged is not None:
                    self._wait_payload(t, staged)
                    discarded += 1
                discarded += self._drain(t)
        while self._acks:
            t, g, work, _ = self._acks.popleft()
            self._wait(work, t, "send control", g)
        if discarded:
            log.info("%s: discarded %d in-flight packets after STOP", self.me, discarded)
        return discarded
