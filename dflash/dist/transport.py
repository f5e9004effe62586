"""The packet wire protocol: the only module that sends or receives tensors.

Data channel, target -> drafter (default process group), per packet g, in this order:

    header        int64 [HEADER_LEN]          (fields below)
    input_ids     int64 [T]
    loss_mask     uint8 [T]
    seq_lens      int64 [S]
    sample_ids    int64 [S]
    aux_hidden    dtype [T, n_tap*H]
    final_hidden  dtype [T, H]                (post final norm)

An END header (kind END, no payload) closes a link after the drafter asked it to STOP. A packet
whose samples the target all dropped (non-finite hidden states) is a DATA header with T = S = 0
and num_skipped_nonfinite > 0, and no payload.

Header fields (int64, index: name):
     0 version                 PROTOCOL_VERSION
     1 kind                    DATA=1, END=2
     2 g                       global packet index (END: the next index the link would have carried)
     3 num_seqs                S   (END: 0)
     4 total_tokens            T   (END: 0)
     5 n_tap                   number of tapped layers
     6 hidden_size             H
     7 dtype                   DTYPE_CODES[aux/final dtype]
     8 flags                   bits 0..15 (FLAG_STOP_REQUESTED = 1: the target got SIGTERM/SIGINT
                               and asks the drafters to stop with a checkpoint); higher bits 0
     9 forward_us              target forward time, microseconds
    10 peak_mem_bytes          target peak memory
    11 num_skipped_nonfinite   samples the target dropped for non-finite hidden states
    12..15                     spare, 0

Control channel, drafter -> target (a separate process group, so that on NCCL a pending control
receive never sits on the same stream in front of a data send): int64 [4] = [kind, g, 0, 0], kind
ACK=1 (packet g consumed) or STOP=2 (stop producing, send END).

The receiver checks every header field before it posts the payload receives: gloo silently
reinterprets a wrong dtype and aborts the whole process when a buffer is too small, and NCCL
needs exact sizes. Packets follow the Topology schedule (packet g: target g mod N -> drafter
g mod M), so there is never an any-source receive. Every wait has a timeout, and every backend
failure (timeout, closed connection) becomes a ``PeerError`` naming both sides and the operation;
on gloo a timed-out pair is closed for good, so a ``PeerError`` is fatal for the link.

Usage (one ``TargetLink`` per drafter a target feeds, see ``linked_drafters``):

    # target                                        # drafter
    links = {d: TargetLink(topo, rank, d, spec,     link = DrafterLink(topo, rank, spec, timeout_s)
                           timeout_s, max_in_flight) link.prefetch(first)
             for d in linked_drafters(topo, rank)}  for g in my packets:
    for g in topo.packets_of_target(rank, a, b):        pkt = link.recv(g); link.prefetch(next g)
        link = links[topo.consumer_of(g)]               ... train step ...; link.ack(g)
        link.send(make_packet(g))                   link.stop_all()   # STOP, drain until END
        if link.stopped: break
    for link in links.values():
        link.wait_for_stop(); link.send_end()

Without ``start_index`` a link's first packet index is fixed by its first ``send`` (target) or
``prefetch``/``recv`` (drafter, per target), so a resumed run just starts at the packet that
``agree_on_start`` returns. Call ``warm_up_links`` on every rank right after ``init_distributed``
(before loading models): it checks every link and, on NCCL, creates the per-pair communicators up
front. ``agree_on_start`` (world) and ``all_reduce_sum`` (drafters) are the run's collectives.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from dflash.dist.topology import Topology

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
HEADER_LEN = 16
CONTROL_LEN = 4

KIND_DATA = 1
KIND_END = 2
CTRL_ACK = 1
CTRL_STOP = 2

HEADER_FIELDS = (
    "version",
    "kind",
    "g",
    "num_seqs",
    "total_tokens",
    "n_tap",
    "hidden_size",
    "dtype",
    "flags",
    "forward_us",
    "peak_mem_bytes",
    "num_skipped_nonfinite",
)
NUM_SPARE = HEADER_LEN - len(HEADER_FIELDS)
FLAGS_MASK = 0xFFFF
"""Bits a sender may set in ``flags``; the rest are reserved and must be 0."""
FLAG_STOP_REQUESTED = 1 << 0
"""The target got SIGTERM/SIGINT and asks the drafters to stop (with a checkpoint) at the next step."""

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_KIND_NAMES = {KIND_DATA: "DATA", KIND_END: "END"}
_CTRL_NAMES = {CTRL_ACK: "ACK", CTRL_STOP: "STOP"}


class ProtocolError(ValueError):
    """A header or payload that does not match what the receiver expects (names field, values, sender)."""


class PeerError(RuntimeError):
    """A dead or stuck peer: names our role and rank, the peer, the operation and the timeout."""


# ----------------------------------------------------------------------------------------------
# Packets and headers (pure tensor code, no process group)


@dataclass
class Packet:
    index: int
    input_ids: Tensor  # [T] int64
    loss_mask: Tensor  # [T] uint8
    seq_lens: Tensor  # [S] int64
    sample_ids: Tensor  # [S] int64
    aux_hidden: Tensor  # [T, n_tap*H]
    final_hidden: Tensor  # [T, H]
    forward_s: float = 0.0
    peak_mem_bytes: int = 0
    flags: int = 0
    num_skipped_nonfinite: int = 0

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass(frozen=True)
class PacketSpec:
    """What both ends of a link agree on, from the config: checked on every packet."""

    num_taps: int
    hidden_size: int
    dtype: torch.dtype
    max_tokens: int
    device: torch.device

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"packet dtype {self.dtype} not supported; use one of {list(DTYPE_CODES)}")
        if self.num_taps < 1 or self.hidden_size < 1 or self.max_tokens < 1:
            raise ValueError(f"invalid PacketSpec {self}")


@dataclass(frozen=True)
class Header:
    version: int
    kind: int
    g: int
    num_seqs: int
    total_tokens: int
    n_tap: int
    hidden_size: int
    dtype: int
    flags: int
    forward_us: int
    peak_mem_bytes: int
    num_skipped_nonfinite: int
    spare: tuple[int, ...] = (0,) * NUM_SPARE

    @property
    def torch_dtype(self) -> torch.dtype:
        return CODE_DTYPES[self.dtype]


def encode_header(header: Header) -> Tensor:
    """Header -> int64 [HEADER_LEN] (CPU)."""
    values = [int(getattr(header, name)) for name in HEADER_FIELDS] + [int(x) for x in header.spare]
    if len(values) != HEADER_LEN:
        raise ValueError(f"header has {len(values)} fields, expected {HEADER_LEN}")
    return torch.tensor(values, dtype=torch.int64)


def decode_header(t: Tensor | list[int]) -> Header:
    """int64 [HEADER_LEN] -> Header (no validation)."""
    values = [int(x) for x in (t.tolist() if isinstance(t, Tensor) else t)]
    if len(values) != HEADER_LEN:
        raise ProtocolError(f"packet header has {len(values)} fields, expected {HEADER_LEN}")
    named = dict(zip(HEADER_FIELDS, values[: len(HEADER_FIELDS)], strict=True))
    return Header(**named, spare=tuple(values[len(HEADER_FIELDS) :]))


def data_header(packet: Packet, spec: PacketSpec) -> Header:
    return Header(
        version=PROTOCOL_VERSION,
        kind=KIND_DATA,
        g=int(packet.index),
        num_seqs=packet.num_seqs,
        total_tokens=packet.num_tokens,
        n_tap=spec.num_taps,
        hidden_size=spec.hidden_size,
        dtype=DTYPE_CODES[spec.dtype],
        flags=int(packet.flags),
        forward_us=max(0, int(round(packet.forward_s * 1e6))),
        peak_mem_bytes=int(packet.peak_mem_bytes),
        num_skipped_nonfinite=int(packet.num_skipped_nonfinite),
    )


def end_header(g: int, spec: PacketSpec) -> Header:
    return Header(
        version=PROTOCOL_VERSION,
        kind=KIND_END,
        g=int(g),
        num_seqs=0,
        total_tokens=0,
        n_tap=spec.num_taps,
        hidden_size=spec.hidden_size,
        dtype=DTYPE_CODES[spec.dtype],
        flags=0,
        forward_us=0,
        peak_mem_bytes=0,
        num_skipped_nonfinite=0,
    )


def _fmt_kind(k: int) -> str:
    return f"{_KIND_NAMES[k]}({k})" if k in _KIND_NAMES else str(k)


def validate_header(
    header: Header | Tensor, *, expect_g: int, spec: PacketSpec, sender: str = "peer", allow_end: bool = False
) -> Header:
    """Check every field against the receiver's expectations; ``ProtocolError`` names the first bad one."""
    h = decode_header(header) if isinstance(header, Tensor) else header

    def fail(field: str, expected, got) -> ProtocolError:
        return ProtocolError(
            f"packet header from {sender}: field {field} expected {expected}, got {got} (expected packet {expect_g})"
        )

    if h.version != PROTOCOL_VERSION:
        raise fail("version", PROTOCOL_VERSION, h.version)
    kinds = (KIND_DATA, KIND_END) if allow_end else (KIND_DATA,)
    if h.kind not in kinds:
        raise fail("kind", " or ".join(_fmt_kind(k) for k in kinds), _fmt_kind(h.kind))
    if h.g != expect_g:
        raise fail("g", expect_g, h.g)
    if h.n_tap != spec.num_taps:
        raise fail("n_tap", spec.num_taps, h.n_tap)
    if h.hidden_size != spec.hidden_size:
        raise fail("hidden_size", spec.hidden_size, h.hidden_size)
    code = DTYPE_CODES[spec.dtype]
    if h.dtype != code:
        got = f"{h.dtype} ({CODE_DTYPES[h.dtype]})" if h.dtype in CODE_DTYPES else h.dtype
        raise fail("dtype", f"{code} ({spec.dtype})", got)
    if h.kind == KIND_END:
        if h.total_tokens != 0:
            raise fail("total_tokens", "0 for END", h.total_tokens)
        if h.num_seqs != 0:
            raise fail("num_seqs", "0 for END", h.num_seqs)
    elif h.total_tokens == 0 and h.num_skipped_nonfinite > 0:  # every sample dropped: an empty packet
        if h.num_seqs != 0:
            raise fail("num_seqs", "0 (empty packet)", h.num_seqs)
    else:
        if not 0 < h.total_tokens <= spec.max_tokens:
            raise fail(
                "total_tokens",
                f"1..{spec.max_tokens} (0 only with num_skipped_nonfinite > 0)",
                h.total_tokens,
            )
        if not 0 < h.num_seqs <= h.total_tokens:
            raise fail("num_seqs", f"1..{h.total_tokens} (total_tokens)", h.num_seqs)
    if h.flags < 0 or h.flags & ~FLAGS_MASK:
        raise fail("flags", f"bits within {FLAGS_MASK:#x}", h.flags)
    for name in ("forward_us", "peak_mem_bytes"):
        if getattr(h, name) < 0:
            raise fail(name, ">= 0", getattr(h, name))
    if not 0 <= h.num_skipped_nonfinite:
        raise fail("num_skipped_nonfinite", ">= 0", h.num_skipped_nonfinite)
    for i, v in enumerate(h.spare):
        if v != 0:
            raise fail(f"spare{len(HEADER_FIELDS) + i}", 0, v)
    return h


def payload_buffers(h: Header, device: torch.device) -> list[Tensor]:
    """Empty receive buffers for the payload of DATA header ``h``, in wire order."""
    t, s, dt = h.total_tokens, h.num_seqs, h.torch_dtype
    return [
        torch.empty(t, dtype=torch.int64, device=device),
        torch.empty(t, dtype=torch.uint8, device=device),
        torch.empty(s, dtype=torch.int64, device=device),
        torch.empty(s, dtype=torch.int64, device=device),
        torch.empty(t, h.n_tap * h.hidden_size, dtype=dt, device=device),
        torch.empty(t, h.hidden_size, dtype=dt, device=device),
    ]


def validate_payload(
    h: Header, seq_lens: Tensor, sample_ids: Tensor, loss_mask: Tensor, *, sender: str = "peer"
) -> None:
    """Payload consistency: sum(seq_lens) == total_tokens, lengths > 0, ids >= 0, mask in {0, 1}."""
    where = f"packet {h.g} payload from {sender}"
    total = int(seq_lens.sum().item())
    if total != h.total_tokens:
        raise ProtocolError(
            f"{where}: field sum(seq_lens) expected {h.total_tokens} (total_tokens), got {total}"
        )
    if h.num_seqs and int(seq_lens.min().item()) < 1:
        raise ProtocolError(f"{where}: field seq_lens expected all >= 1, got {seq_lens.tolist()}")
    if h.num_seqs and int(sample_ids.min().item()) < 0:
        raise ProtocolError(
            f"{where}: field sample_ids expected all >= 0, got min {int(sample_ids.min().item())}"
        )
    if h.total_tokens and int(loss_mask.max().item()) > 1:
        raise ProtocolError(
            f"{where}: field loss_mask expected values in {{0, 1}}, got max {int(loss_mask.max().item())}"
        )


def check_packet(packet: Packet, spec: PacketSpec) -> None:
    """Sender-side shape/dtype checks (a bug on the target, reported before anything is sent)."""
    t, s = packet.num_tokens, packet.num_seqs
    problems = []
    if packet.input_ids.dtype != torch.int64 or packet.input_ids.dim() != 1:
        problems.append(
            f"input_ids must be int64 [T], got {packet.input_ids.dtype} {tuple(packet.input_ids.shape)}"
        )
    if packet.loss_mask.dtype != torch.uint8 or tuple(packet.loss_mask.shape) != (t,):
        problems.append(
            f"loss_mask must be uint8 [{t}], got {packet.loss_mask.dtype} {tuple(packet.loss_mask.shape)}"
        )
    for name in ("seq_lens", "sample_ids"):
        x = getattr(packet, name)
        if x.dtype != torch.int64 or tuple(x.shape) != (s,):
            problems.append(f"{name} must be int64 [{s}], got {x.dtype} {tuple(x.shape)}")
    n_aux = spec.num_taps * spec.hidden_size
    for name, width in (("aux_hidden", n_aux), ("final_hidden", spec.hidden_size)):
        x = getattr(packet, name)
        if x.dtype != spec.dtype or tuple(x.shape) != (t, width):
            problems.append(f"{name} must be {spec.dtype} [{t}, {width}], got {x.dtype} {tuple(x.shape)}")
    if t == 0 and s == 0 and packet.num_skipped_nonfinite > 0:
        pass  # every sample was dropped: a valid empty packet (header only)
    elif not 0 < t <= spec.max_tokens:
        problems.append(f"total tokens {t} outside 1..{spec.max_tokens} (0 only when samples were skipped)")
    elif not 0 < s <= t:
        problems.append(f"num_seqs {s} outside 1..{t}")
    elif not problems and int(packet.seq_lens.sum().item()) != t:
        problems.append(f"sum(seq_lens)={int(packet.seq_lens.sum().item())} != {t} tokens")
    if packet.num_skipped_nonfinite < 0:
        problems.append(f"num_skipped_nonfinite {packet.num_skipped_nonfinite} < 0")
    if packet.flags < 0 or packet.flags & ~FLAGS_MASK:
        problems.append(f"flags {packet.flags} outside {FLAGS_MASK:#x}")
    if problems:
        raise ValueError(f"packet {packet.index} is malformed: " + "; ".join(problems))


def payload_tensors(packet: Packet, device: torch.device) -> list[Tensor]:
    """The payload in wire order, contiguous and on ``device``."""
    xs = (
        packet.input_ids,
        packet.loss_mask,
        packet.seq_lens,
        packet.sample_ids,
        packet.aux_hidden,
        packet.final_hidden,
    )
    return [x.to(device, non_blocking=False).contiguous() for x in xs]


def encode_control(kind: int, g: int) -> Tensor:
    return torch.tensor([kind, g, 0, 0], dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# The schedule seen from one link (target t -> drafter d)


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
    return [t for t in topology.target_ranks if first_on_link(topology, t, drafter_rank) is not None]


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


def _short(err: BaseException) -> str:
    """The gist of a backend error: first line, without gloo's source location and advice."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)
    return first.split(". This is typically")[0].rstrip(".") or type(err).__name__


def _is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


class _Endpoint:
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
        if cause is None or _is_timeout(cause):
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
            f"{self.me}: {op} with {peer_name}{pkt} failed ({_short(cause)}; timeout {timeout:g}s); "
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


class TargetLink(_Endpoint):
    """A target's link to one drafter: sends packets in schedule order with ACK backpressure.

    ``send`` keeps at most ``max_in_flight`` packets un-ACKed: before posting a packet it reads
    control messages until the window has room. A STOP sets ``stopped``; ``send`` then returns
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
        data_group=None,
        control_group=None,
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
        self.data_group = data_group
        self.control_group = control_group if control_group is not None else _default_control_group()
        self.next_index = first
        self._start_known = start_index is not None
        self.stopped = False
        self.ended = False
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
        msg = [int(x) for x in self._ctrl_buf.tolist()]
        self._ctrl_work, self._ctrl_buf = None, None
        kind, g = msg[0], msg[1]
        src = f"control message from {self.peer_name}"
        if kind not in _CTRL_NAMES or msg[2:] != [0, 0]:
            raise self._fail(
                ProtocolError(f"{src}: field kind expected ACK(1) or STOP(2) with zero spare, got {msg}")
            )
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
        header = encode_header(data_header(packet, self.spec)).to(self.device)
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
        header = encode_header(end_header(self.next_index, self.spec)).to(self.device)
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


class DrafterLink(_Endpoint):
    """A drafter's links to all the targets that feed it (the schedule says who sends packet g)."""

    def __init__(
        self,
        topology: Topology,
        rank: int,
        spec: PacketSpec,
        timeout_s: float,
        *,
        start_index: int | None = None,
        data_group=None,
        control_group=None,
    ) -> None:
        super().__init__(topology, rank, timeout_s, spec.device)
        if topology.role_of(rank) != "drafter":
            raise ValueError(f"DrafterLink needs a drafter rank, got {topology.describe(rank)}")
        self.spec = spec
        self.data_group = data_group
        self.control_group = control_group if control_group is not None else _default_control_group()
        self._period = link_period(topology)
        self.targets = linked_targets(topology, rank)
        # Next packet expected from each target; None until the first prefetch/recv fixes it (resume).
        self._next: dict[int, int | None] = {
            t: None if start_index is None else first_on_link(topology, t, rank, start_index)
            for t in self.targets
        }
        self._posted: dict[int, _HeaderRecv | None] = {t: None for t in self.targets}
        self._deferred: dict[int, list[int]] = {t: [] for t in self.targets}
        self._acks: deque[tuple[int, int, object, Tensor]] = deque()
        self._ended: set[int] = set()
        self.stopped = False
        self.last_wait_s = 0.0
        self.total_wait_s = 0.0
        self.num_received = 0

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
        rec = _HeaderRecv(g, self._post(dist.irecv, buf, t, self.data_group, "recv header", g), buf)
        self._posted[t] = rec
        return rec

    def prefetch(self, g: int) -> None:
        """Post the receive of packet g's header early (deferred until the same target's earlier payload is posted)."""
        self._check_usable()
        t = self._producer(g)
        rec = self._posted[t]
        if (rec is not None and rec.g == g) or g in self._deferred[t]:
            return
        if rec is None and not self._deferred[t] and (self._next[t] is None or g == self._next[t]):
            self._post_header(t, g)
        else:
            self._deferred[t] = sorted({*self._deferred[t], g})

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
            self._post(dist.irecv, buf, t, self.data_group, "recv header", None), t, "recv header", None
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

    def _recv_payload(self, t: int, h: Header) -> list[Tensor]:
        bufs = payload_buffers(h, self.device)
        # An empty packet (every sample dropped by the target) has no payload on the wire.
        works = [
            self._post(dist.irecv, b, t, self.data_group, "recv payload", h.g) for b in bufs if h.total_tokens
        ]
        self._next[t] = h.g + self._period
        ahead = self._deferred[t]
        if ahead and ahead[0] == self._next[t]:
            self._post_header(t, ahead.pop(0))
        for w in works:
            self._wait(w, t, "recv payload", h.g)
        return bufs

    def recv(self, g: int) -> Packet:
        """Packet g from its target: header (validated), then payload (validated)."""
        self._check_usable()
        if self.stopped:
            raise RuntimeError(f"{self.me}: recv({g}) after stop_all")
        t = self._producer(g)
        sender = self.topology.describe(t)
        t0 = time.perf_counter()
        h, _ = self._take_header(t, g)
        try:
            validate_header(h, expect_g=g, spec=self.spec, sender=sender)
        except ProtocolError as e:
            raise self._fail(e) from None
        input_ids, loss_mask, seq_lens, sample_ids, aux, final = self._recv_payload(t, h)
        try:
            validate_payload(h, seq_lens, sample_ids, loss_mask, sender=sender)
        except ProtocolError as e:
            raise self._fail(e) from None
        self.last_wait_s = time.perf_counter() - t0
        self.total_wait_s += self.last_wait_s
        self.num_received += 1
        self._reap_acks()
        return Packet(
            index=h.g,
            input_ids=input_ids,
            loss_mask=loss_mask,
            seq_lens=seq_lens,
            sample_ids=sample_ids,
            aux_hidden=aux,
            final_hidden=final,
            forward_s=h.forward_us / 1e6,
            peak_mem_bytes=h.peak_mem_bytes,
            flags=h.flags,
            num_skipped_nonfinite=h.num_skipped_nonfinite,
        )

    def _send_control(self, kind: int, g: int, t: int) -> None:
        msg = encode_control(kind, g).to(self.device)
        op = "send ACK" if kind == CTRL_ACK else "send STOP"
        self._acks.append((t, g, self._post(dist.isend, msg, t, self.control_group, op, g), msg))

    def _reap_acks(self) -> None:
        while self._acks and self._done(self._acks[0][2], self._acks[0][0], "send control", self._acks[0][1]):
            self._acks.popleft()

    def ack(self, g: int) -> None:
        """Tell packet g's target that g is consumed (non-blocking; completion checked later)."""
        self._check_usable()
        self._send_control(CTRL_ACK, g, self._producer(g))
        self._reap_acks()

    def stop_all(self) -> int:
        """STOP every target, then drain each one's in-flight packets until its END; returns packets discarded."""
        self._check_usable()
        self.stopped = True
        for t in self.targets:
            if t not in self._ended:
                self._send_control(CTRL_STOP, -1 if self._next[t] is None else self._next[t], t)
        discarded = 0
        for t in self.targets:
            sender = self.topology.describe(t)
            while t not in self._ended:
                self._deferred[t] = []
                if self._next[t] is None:  # nothing asked of this target yet: take its first header as is
                    h = self._first_header(t)
                    g = h.g
                else:
                    g = self._next[t]
                    h, _ = self._take_header(t, g)
                try:
                    validate_header(h, expect_g=g, spec=self.spec, sender=sender, allow_end=True)
                except ProtocolError as e:
                    raise self._fail(e) from None
                if h.kind == KIND_END:
                    self._ended.add(t)
                    break
                self._recv_payload(t, h)
                discarded += 1
        while self._acks:
            t, g, work, _ = self._acks.popleft()
            self._wait(work, t, "send control", g)
        if discarded:
            log.info("%s: discarded %d in-flight packets after STOP", self.me, discarded)
        return discarded


# ----------------------------------------------------------------------------------------------
# The few collectives of the run (also tensors on the wire, so they live here)


def _collective_wait(ctx, work, what: str, ranks: list[int], timeout_s: float | None) -> None:
    timeout = float(timeout_s if timeout_s is not None else (ctx.timeout_s or 1800.0))
    topo = ctx.topology
    names = ", ".join(topo.describe(r) for r in ranks) if topo else str(ranks)
    me = topo.describe(ctx.rank) if topo else f"rank {ctx.rank}"
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001
        kind = "timed out" if _is_timeout(e) else f"failed ({_short(e)})"
        raise PeerError(
            f"{me}: {what} among [{names}] {kind} (timeout {timeout:g}s); a peer is dead or stuck"
        ) from e
    if ok is False:
        raise PeerError(f"{me}: {what} among [{names}] timed out after {timeout:g}s; a peer is dead or stuck")


def agree_on_start(
    ctx, topology: Topology, next_packet: int, num_steps: int, timeout_s: float | None = None
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


def all_reduce_sum(ctx, tensor: Tensor, timeout_s: float | None = None) -> Tensor:
    """In-place SUM all-reduce over the drafter-only group (a no-op with one drafter); returns ``tensor``."""
    topo = ctx.topology
    ranks = topo.drafter_ranks if topo else []
    if len(ranks) <= 1:
        return tensor
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=ctx.drafter_group, async_op=True)
    _collective_wait(ctx, work, "all_reduce", ranks, timeout_s)
    return tensor


# ----------------------------------------------------------------------------------------------
# Start-up check of every link (and, on NCCL, creation of every pair communicator)


def warm_up_links(
    topology: Topology,
    rank: int,
    device: torch.device,
    timeout_s: float,
    *,
    data_group=None,
    control_group=None,
) -> None:
    """Exchange one small tensor on every (target, drafter) link, data and control direction.

    Every rank walks the links in one global order, so this cannot deadlock. On NCCL it creates
    the two-rank communicators of every link up front (their creation blocks until both ends
    join), so the first real packet or ACK never stalls on it. Peers that do not answer within
    ``timeout_s`` raise PeerError.
    """
    control_group = control_group if control_group is not None else _default_control_group()
    ep = _Endpoint(topology, rank, timeout_s, device)
    role = topology.role_of(rank)
    for t in topology.target_ranks:
        for d in topology.drafter_ranks:
            if rank not in (t, d) or first_on_link(topology, t, d) is None:
                continue
            buf = torch.full((1,), rank, dtype=torch.int64, device=device)
            if role == "target":
                ep._wait(
                    ep._post(dist.isend, buf, d, data_group, "send warm-up", None), d, "send warm-up", None
                )
                ep._wait(
                    ep._post(dist.irecv, buf, d, control_group, "recv warm-up", None), d, "recv warm-up", None
                )
                if int(buf.item()) != d:
                    raise ProtocolError(
                        f"{ep.me}: warm-up from {topology.describe(d)}: expected {d}, got {int(buf.item())}"
                    )
            else:
                ep._wait(
                    ep._post(dist.irecv, buf, t, data_group, "recv warm-up", None), t, "recv warm-up", None
                )
                if int(buf.item()) != t:
                    raise ProtocolError(
                        f"{ep.me}: warm-up from {topology.describe(t)}: expected {t}, got {int(buf.item())}"
                    )
                buf.fill_(rank)
                ep._wait(
                    ep._post(dist.isend, buf, t, control_group, "send warm-up", None), t, "send warm-up", None
                )


def _default_control_group():
    from dflash.dist import init as dist_init

    return dist_init.current_control_group()
