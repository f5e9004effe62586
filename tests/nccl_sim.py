"""A strict model of NCCL's point-to-point ordering that drives the real links and loops on CPU.

One thread per rank runs the real code (``init_distributed``, ``warm_up_links``, ``TargetWorker``,
``DrafterTrainer``, the links); ``NcclSim.patch`` replaces, for the duration of a test, the
``torch.distributed`` module those files use, the ``torch.cuda`` calls they make and the
``_set_pg_timeout``/``_abort_process_group`` helpers, and every rank thread runs under ``CudaAsCpu``,
so its device is ``cuda:<local rank>`` (every CUDA branch of the code runs) while its tensors live
on the CPU.

The model (torch 2.13's ``ProcessGroupNCCL``, torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp):

- A communicator is one ordered queue per rank: NCCL runs a communicator's ops on one stream, in
  the order the rank issued them (``ncclStreams_.at(key)`` in ``pointToPoint``).
- Which communicator an op uses (``pointToPoint``): with eager init (``device_id`` given to
  ``init_process_group``; ``_new_group_with_tag`` passes the default group's ``bound_device_id``
  to every later ``new_group``, which then splits its communicator eagerly) an unbatched send or
  receive uses the group's one communicator whatever the peer (``key = getKeyFromDevice``;
  torch warns "unbatched P2P ops are treated as independent collective ops, and are thus serialized
  with all other ops on this ProcessGroup", PRs #154132 and #156748, issue #152220). Without eager
  init it uses a 2-rank communicator per (group, pair) (``key = getKeySendRecv(rank, peer)``),
  created on first use. Collectives use the group's communicator in both modes.
  ``batch_isend_irecv`` (ops inside ``ncclGroupStart``, ``ncclActiveGroupCounter_ > 0``) uses the
  group's communicator too and starts its ops together; it is not modelled (no code uses it).
- A send completes only when the matching receive (same communicator, this rank as its source,
  same size and dtype) is at the head of the peer's queue while the send is at the head of its own;
  a collective completes when it is at the head of every member's queue. Ops complete whether or
  not anybody waits, as on a GPU; what completes lets the next op of its queue start.
- Streams: every rank has a default stream; ``torch.cuda.Stream``/``torch.cuda.stream`` make and
  select others (per thread). ``Work.wait()`` makes the current stream wait for the op
  (``WorkNCCL::synchronizeStream``; with a timeout the host then also blocks until it completes).
  An op starts only after the work queued on the stream it was issued from (NCCL's stream waits
  for the current stream): its ``ready_at``. Compute runs on the calling thread, so it is finished
  when Python goes on, except what a test queues with ``compute(seconds)``: it occupies the current
  stream until ``busy_until`` while the host goes on, as CUDA kernels do.
- Host reads wait for their stream: ``Tensor.cpu()``/``.to(cpu)`` (a device-to-host copy on the
  current stream), ``current_stream().synchronize()`` and CUDA events wait for what the stream was
  made to wait for and for its queued compute; ``torch.cuda.synchronize()`` for every pending op and
  stream of the rank. ``timeline`` records, per rank and in host order, each queued compute (a
  number), each payload receive with the last compute queued ahead of it on its stream, and each
  host wait with the last compute it waits for: the drafter's overlap of receive and compute, by
  events, not by wall-clock times (which load on the machine moves).
- ``Work.wait(timeout)`` blocks until the op completes and raises once ``timeout`` has passed since
  the op was created (``WorkNCCL::checkTimeout`` counts from ``workStartTime_``); every such wait
  is checked against the op's group timeout (the watchdog's, from the op's creation too): a wait
  that the watchdog would end first is recorded in ``watchdog_races``.

When every live rank waits and no op can complete, the simulator stops every rank and raises
``SimDeadlock`` naming each rank, what it waits for, the queue heads in the way and a cycle of
ranks. ``new_group``/``init_process_group`` are host barriers over the world (every rank must
create every group, in one order).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as real_dist
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _on_cpu(v: Any) -> Any:
    if isinstance(v, torch.device) and v.type == "cuda":
        return _CPU
    if isinstance(v, str) and v.startswith("cuda"):
        return _CPU
    return v


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """``Tensor.cpu()`` or ``Tensor.to(cpu)``: a device-to-host copy on the current stream."""
    if func is torch.Tensor.cpu:
        return True
    if func is not torch.Tensor.to:
        return False
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and str(target).startswith("cpu")


class CudaAsCpu(TorchFunctionMode):
    """Every ``device=cuda...`` argument of a torch call becomes the CPU (thread-local, like every
    torch function mode): code that holds ``torch.device("cuda", r)`` runs its CUDA branches on CPU
    tensors. With ``sim``, a device-to-host copy waits for the current stream (``NcclSim.host_read``)."""

    def __init__(self, sim: NcclSim | None = None) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.device:  # the device itself stays cuda: the code under test branches on it
            return func(*args, **(kwargs or {}))
        if self.sim is not None and _to_host(func, args, kwargs or {}):
            self.sim.host_read()
        kwargs = {k: _on_cpu(v) for k, v in (kwargs or {}).items()}
        return func(*(_on_cpu(a) for a in args), **kwargs)


class SimStop(BaseException):
    """Raised in a rank thread that the simulator stopped (a deadlock or another rank's failure).
    A BaseException, so that the code under test (which turns backend Exceptions into PeerErrors)
    does not swallow it."""


class SimDeadlock(AssertionError):
    """Every live rank waits and no operation can complete."""


@dataclass(eq=False)
class SimGroup:
    """A process group: its name, global ranks and, per member, the timeout later work gets."""

    name: str
    ranks: tuple[int, ...]
    timeout_s: dict[int, float]
    coll_seq: dict[int, int] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"{self.name}{list(self.ranks)}"


NON_MEMBER = object()


@dataclass(eq=False)
class _Collective:
    group: SimGroup
    kind: str
    members: dict[int, Op] = field(default_factory=dict)


@dataclass(eq=False)
class Op:
    rank: int
    kind: str
    """send, recv, collective or barrier"""
    comm: tuple
    peer: int | None
    tensor: Any
    label: str
    watchdog_s: float
    created: float
    coll: _Collective | None = None
    payload: Any = None
    done: bool = False
    ready_at: float = 0.0
    """``time.monotonic()`` after which the op can start (the compute queued before it on its stream)."""

    def __str__(self) -> str:
        if self.kind in ("send", "recv"):
            arrow = "->" if self.kind == "send" else "<-"
            t = self.tensor
            return f"{self.label} {arrow} rank {self.peer} [{tuple(t.shape)} {str(t.dtype)[6:]}] on {_comm(self.comm)}"
        return f"{self.label} on {_comm(self.comm)}"


def _comm(comm: tuple) -> str:
    return comm[0] if len(comm) == 1 else f"{comm[0]}(pair {comm[1]}-{comm[2]})"


class SimWork:
    """The ``Work`` of one op (NCCL semantics, see the module docstring)."""

    def __init__(self, sim: NcclSim, op: Op) -> None:
        self.sim, self.op = sim, op

    def is_completed(self) -> bool:
        self.sim._check_stopped()
        return self.op.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        sim, op = self.sim, self.op
        with sim.cv:  # NCCL: the current stream waits for the op
            sim.current_stream().deps.append(op)
        if timeout is None:  # and the host goes on
            return True
        seconds = timeout.total_seconds()
        with sim.cv:
            if seconds + sim.min_margin_s > op.watchdog_s:
                sim.watchdog_races.append(
                    f"rank {op.rank}: waits {seconds:g}s for {op}, whose group times out after {op.watchdog_s:g}s"
                )
        if not sim._block(op.rank, f"Work.wait({op})", [op], op.created + seconds):
            raise RuntimeError(f"[Rank {op.rank}] Work {op} timed out in blocking wait after {seconds:g}s")
        return True


class SimEvent:
    """A CUDA event: recorded on a stream, it completes with what the stream was made to wait for
    and its queued compute; its time is when that compute ends (the host time of ``record`` at the earliest)."""

    def __init__(self, sim: NcclSim, enable_timing: bool = False, **_: Any) -> None:
        self.sim = sim
        self.t: float | None = None
        self.deps: list[Op] = []
        self.last_compute = 0

    def record(self, stream: Any = None) -> None:
        s = stream if isinstance(stream, SimStream) else self.sim.current_stream()
        with self.sim.cv:
            self.deps = list(s.deps)
            self.last_compute = s.last_compute
        self.t = max(time.monotonic(), s.busy_until)

    def synchronize(self) -> None:
        assert self.t is not None, "synchronize of an event that was never recorded"
        self.sim._host_waits(self.sim._rank(), "CUDA event synchronize", self.last_compute)
        self.sim._block(self.sim._rank(), "CUDA event synchronize", self.deps, None)
        self.sim._sleep_until(self.t)

    def query(self) -> bool:
        return all(op.done for op in self.deps) and (self.t or 0.0) <= time.monotonic()

    def elapsed_time(self, end: SimEvent) -> float:
        assert self.t is not None and end.t is not None, "elapsed_time of an event that was never recorded"
        return (end.t - self.t) * 1000.0


class SimStream:
    """A CUDA stream of one rank: the ops it was made to wait for and when its queued compute ends."""

    def __init__(self, sim: NcclSim, rank: int) -> None:
        self.sim, self.rank = sim, rank
        self.deps: list[Op] = []
        self.busy_until = 0.0
        self.last_compute = 0
        """The number of the last compute queued on this stream or on one it was made to wait for."""

    def synchronize(self) -> None:
        self.sim._sync_stream(self, "stream.synchronize()")

    def wait_stream(self, other: SimStream) -> None:
        with self.sim.cv:
            self.deps.extend(other.deps)
            self.busy_until = max(self.busy_until, other.busy_until)
            self.last_compute = max(self.last_compute, other.last_compute)


@dataclass
class _Wait:
    what: str
    ops: list[Op]


class NcclSim:
    """The simulated NCCL world of ``world_size`` ranks (one thread each); see the module docstring.

    ``min_margin_s``: how much longer than a wait a group's timeout must be (else ``watchdog_races``).
    ``blocked_s``: per rank, seconds spent waiting inside ``region`` (see ``in_region``).
    """

    def __init__(self, world_size: int, *, min_margin_s: float = 0.0) -> None:
        self.world_size = world_size
        self.min_margin_s = min_margin_s
        self.cv = threading.Condition()
        self.local = threading.local()
        self.queues: dict[tuple[int, tuple], deque[Op]] = {}
        self.default_streams: dict[int, SimStream] = {}
        self.timeline: dict[int, list[tuple[str, str, int]]] = {}
        """Per rank, in host order: ("compute", "", its number) for each ``compute`` (numbered from 1
        over the whole simulation), ("payload", op label, the last compute queued ahead of it on its
        stream) for each payload receive, ("host_wait", what, the last compute it waits for) for each
        host wait on a stream, an event or the device."""
        self.computes = 0
        self.groups: list[SimGroup] = []
        self.world: SimGroup | None = None
        self.eager: bool | None = None
        self.backend: str | None = None
        self.live: set[int] = set()
        self.blocked: dict[int, _Wait] = {}
        self.failure: BaseException | None = None
        self.failed_rank: int | None = None
        self.deadlock: str | None = None
        self.watchdog_races: list[str] = []
        self.p2p_groups: set[SimGroup] = set()
        """Every group a send or receive used."""
        self.aborted: set[int] = set()
        self.destroyed: set[int] = set()
        self.region_blocked: dict[int, list[tuple[str, float]]] = {}
        self._barriers: dict[str, _Collective] = {}
        self._barrier_seq: dict[int, int] = {}

    # ------------------------------------------------------------------ ranks and threads
    def _rank(self) -> int:
        rank = getattr(self.local, "rank", None)
        if rank is None:
            raise RuntimeError("a simulated torch.distributed call outside a rank thread of NcclSim")
        return rank

    def run(self, fn: Callable[[int], Any], deadline_s: float = 120.0) -> dict[int, Any]:
        """Run ``fn(rank)`` on one thread per rank under ``CudaAsCpu``; returns each rank's result.
        Raises ``SimDeadlock`` on a deadlock and re-raises the first rank failure otherwise."""
        results: dict[int, Any] = {}

        def main(rank: int) -> None:
            self.local.rank = rank
            try:
                with CudaAsCpu(self):
                    results[rank] = fn(rank)
            except SimStop:
                pass
            except BaseException as e:  # noqa: BLE001 - reported by run()
                self._stop(rank, e)
            finally:
                with self.cv:
                    self.live.discard(rank)
                    self._check_deadlock()
                    self.cv.notify_all()

        self.live = set(range(self.world_size))
        threads = [
            threading.Thread(target=main, args=(r,), daemon=True, name=f"rank{r}")
            for r in range(self.world_size)
        ]
        for t in threads:
            t.start()
        end = time.monotonic() + deadline_s
        for t in threads:
            t.join(max(end - time.monotonic(), 0.1))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            self._stop(None, SimDeadlock(f"ranks still running after {deadline_s:g}s: {alive}"))
            for t in threads:
                t.join(5.0)
        if self.deadlock is not None:
            raise SimDeadlock(self.deadlock)
        if self.failure is not None:
            raise self.failure
        return results

    def _stop(self, rank: int | None, err: BaseException) -> None:
        with self.cv:
            if self.failure is None:
                self.failure, self.failed_rank = err, rank
            self.cv.notify_all()

    def _check_stopped(self) -> None:
        if self.failure is not None:
            raise SimStop(f"stopped: {self.failure!r}")

    @contextmanager
    def in_region(self, name: str) -> Iterator[None]:
        """Charge the time this rank spends waiting inside the block to ``name`` (``region_blocked``)."""
        self.local.region, prev = name, getattr(self.local, "region", None)
        try:
            yield
        finally:
            self.local.region = prev

    # ------------------------------------------------------------------ streams and compute
    def default_stream(self, rank: int | None = None) -> SimStream:
        rank = self._rank() if rank is None else rank
        with self.cv:
            return self.default_streams.setdefault(rank, SimStream(self, rank))

    def current_stream(self, device: Any = None) -> SimStream:
        return getattr(self.local, "stream", None) or self.default_stream()

    @contextmanager
    def use_stream(self, stream: SimStream | None) -> Iterator[None]:
        """``torch.cuda.stream(stream)`` (None: the current one)."""
        prev = getattr(self.local, "stream", None)
        self.local.stream = stream or prev
        try:
            yield
        finally:
            self.local.stream = prev

    def compute(self, seconds: float) -> None:
        """Queue ``seconds`` of compute on the current stream; the host goes on (after what the
        stream waits for is done: the model does not date the completion of an op in advance)."""
        s = self.current_stream()
        self._block(self._rank(), "compute waits for its stream", list(s.deps), None)
        with self.cv:
            s.busy_until = max(time.monotonic(), s.busy_until) + seconds
            self.computes += 1
            s.last_compute = self.computes
            self.timeline.setdefault(s.rank, []).append(("compute", "", self.computes))

    def _host_waits(self, rank: int, what: str, last_compute: int) -> None:
        with self.cv:
            self.timeline.setdefault(rank, []).append(("host_wait", what, last_compute))

    def host_read(self) -> None:
        """A device-to-host copy on the current stream: the host waits for the stream."""
        if getattr(self.local, "rank", None) is not None:
            self._sync_stream(self.current_stream(), "device-to-host copy (Tensor.cpu)")

    def _sync_stream(self, s: SimStream, what: str) -> None:
        with self.cv:
            deps = list(s.deps)
        self._host_waits(s.rank, what, s.last_compute)
        self._block(s.rank, f"{what} on its stream", deps, None)
        self._sleep_until(s.busy_until)

    def _sleep_until(self, t: float) -> None:
        while (left := t - time.monotonic()) > 0:
            self._check_stopped()
            time.sleep(min(left, 0.01))

    # ------------------------------------------------------------------ blocking and deadlocks
    def _block(self, rank: int, what: str, ops: list[Op], deadline: float | None) -> bool:
        """Wait until every op of ``ops`` is done (True) or ``deadline`` (time.monotonic; False)."""
        t0 = time.perf_counter()
        with self.cv:
            self._check_stopped()
            if all(op.done for op in ops):
                return True
            self.blocked[rank] = _Wait(what, ops)
            try:
                while True:
                    self._check_stopped()
                    if all(op.done for op in ops):
                        return True
                    if deadline is not None and time.monotonic() >= deadline:
                        return False
                    self._progress()
                    self._check_deadlock()
                    self._check_stopped()
                    self.cv.wait(0.05 if not self._gated() else 0.002)
            finally:
                self.blocked.pop(rank, None)
                region = getattr(self.local, "region", None)
                if region is not None:
                    self.region_blocked.setdefault(rank, []).append(
                        (f"{region}: {what}", time.perf_counter() - t0)
                    )

    def _check_deadlock(self) -> None:
        """(Under the lock.) Every live rank waits on ops that cannot complete: stop the world."""
        if self.failure is not None or not self.live or not self.live <= self.blocked.keys():
            return
        if self._gated():  # an op waits for the compute queued before it: not stuck yet
            return
        self._progress()  # every head is ready now: what can complete does
        if any(all(op.done for op in self.blocked[r].ops) for r in self.live):
            return
        self.deadlock = self._report()
        self.failure = SimDeadlock(self.deadlock)
        self.cv.notify_all()

    def _report(self) -> str:
        lines = ["deadlock: every live rank waits and no operation can complete"]
        edges: dict[int, list[int]] = {}
        for r in sorted(self.blocked):
            w = self.blocked[r]
            lines.append(f"  rank {r} waits in {w.what}")
            for op in [o for o in w.ops if not o.done][:3]:
                q = self.queues.get((r, op.comm), deque())
                head = q[0] if q else None
                pos = list(q).index(op) if op in q else -1
                lines.append(f"    for {op} (position {pos} of its queue; head: {head})")
                if head is not None:
                    for peer in self._blockers(head):
                        ph = self.queues.get((peer, head.comm))
                        lines.append(
                            f"      rank {peer}'s head on {_comm(head.comm)}: {ph[0] if ph else 'nothing'}"
                        )
                        edges.setdefault(r, []).append(peer)
        cycle = _find_cycle(edges)
        if cycle:
            lines.append("  cycle: " + " -> ".join(f"rank {r}" for r in cycle))
        return "\n".join(lines)

    def _blockers(self, head: Op) -> list[int]:
        if head.peer is not None:
            return [head.peer]
        assert head.coll is not None
        return [
            m
            for m in head.coll.group.ranks
            if (q := self.queues.get((m, head.comm))) is None or not q or q[0].coll is not head.coll
        ]

    # ------------------------------------------------------------------ queues and matching
    def _enqueue(self, op: Op) -> None:
        with self.cv:
            self._check_stopped()
            self.queues.setdefault((op.rank, op.comm), deque()).append(op)
            self._progress()

    def _progress(self) -> None:
        """(Under the lock.) Complete every op whose partners are at their queue heads, repeatedly."""
        changed = True
        any_change = False
        now = time.monotonic()
        while changed:
            changed = False
            for (rank, comm), q in list(self.queues.items()):
                if not q or q[0].ready_at > now:
                    continue
                op = q[0]
                if op.kind == "send" and op.peer is not None:
                    pq = self.queues.get((op.peer, comm))
                    if pq and pq[0].kind == "recv" and pq[0].peer == rank and pq[0].ready_at <= now:
                        self._transfer(op, pq[0])
                        q.popleft()
                        pq.popleft()
                        changed = True
                elif op.kind == "collective" and op.coll is not None:
                    c = op.coll
                    heads = [self.queues.get((m, comm), deque()) for m in c.group.ranks]
                    if len(c.members) == len(c.group.ranks) and all(
                        h and h[0].coll is c and h[0].ready_at <= now for h in heads
                    ):
                        _complete_collective(c)
                        for h in heads:
                            h.popleft()
                        changed = True
            any_change = any_change or changed
        if any_change:
            self.cv.notify_all()

    def _gated(self) -> bool:
        """(Under the lock.) Some queue head waits only for the compute queued before it."""
        now = time.monotonic()
        return any(q and q[0].ready_at > now for q in self.queues.values())

    def _transfer(self, send: Op, recv: Op) -> None:
        a, b = send.tensor, recv.tensor
        if a.dtype != b.dtype or a.numel() != b.numel():
            err = SimDeadlock(
                f"mismatched transfer (NCCL would hang or corrupt): rank {send.rank} {send} / rank {recv.rank} {recv}"
            )
            self.deadlock = str(err)
            self.failure = err
            return
        with torch.no_grad():
            b.view(-1).copy_(a.reshape(-1))
        send.done = recv.done = True

    def _comm_of(self, group: SimGroup, rank: int, peer: int | None) -> tuple:
        if peer is None or self.eager:
            return (group.name,)
        return (group.name, min(rank, peer), max(rank, peer))

    def _group(self, group: Any) -> SimGroup:
        if group is None:
            assert self.world is not None, "torch.distributed used before init_process_group"
            return self.world
        if group is NON_MEMBER:
            raise RuntimeError("an op on a group this rank is not a member of")
        return group

    @staticmethod
    def _label() -> str:
        """The link-level operation of the caller (``Endpoint._post``'s ``op`` and ``g``), for reports."""
        f: FrameType | None = sys._getframe(2)
        for _ in range(4):
            if f is None:
                break
            if isinstance(f.f_locals.get("op"), str):
                g = f.f_locals.get("g")
                return f.f_locals["op"] + (f" (packet {g})" if isinstance(g, int) else "")
            f = f.f_back
        return ""

    def _p2p(self, kind: str, tensor: torch.Tensor, peer: int, group: Any) -> SimWork:
        rank = self._rank()
        g = self._group(group)
        if rank not in g.ranks or peer not in g.ranks:
            raise RuntimeError(f"rank {rank}: {kind} with rank {peer} on {g}, which does not hold both")
        label = self._label()
        with self.cv:
            self.p2p_groups.add(g)
        op = Op(
            rank,
            kind,
            self._comm_of(g, rank, peer),
            peer,
            tensor,
            label or kind,
            g.timeout_s[rank],
            time.monotonic(),
            ready_at=self.current_stream().busy_until,
        )
        if kind == "recv" and label.startswith("recv payload"):
            with self.cv:
                last = self.current_stream().last_compute
                self.timeline.setdefault(rank, []).append(("payload", label, last))
        self._enqueue(op)
        return SimWork(self, op)

    def _collective(self, kind: str, group: Any, payload: Any, label: str) -> SimWork:
        rank = self._rank()
        g = self._group(group)
        seq = g.coll_seq.get(rank, 0)
        g.coll_seq[rank] = seq + 1
        with self.cv:
            key = f"{g.name}#{seq}"
            c = self._barriers.setdefault(key, _Collective(g, kind))
            if c.kind != kind:
                err = SimDeadlock(
                    f"collective mismatch on {g}: rank {rank} calls {kind}, another rank {c.kind} (call {seq})"
                )
                self.deadlock, self.failure = str(err), err
                raise SimStop(str(err))
            op = Op(
                rank,
                "collective",
                (g.name,),
                None,
                None,
                label,
                g.timeout_s[rank],
                time.monotonic(),
                coll=c,
                payload=payload,
                ready_at=self.current_stream().busy_until,
            )
            c.members[rank] = op
        self._enqueue(op)
        return SimWork(self, op)

    def _host_barrier(self, what: str) -> None:
        """init_process_group / new_group: every rank of the world, in one order."""
        rank = self._rank()
        seq = self._barrier_seq.get(rank, 0)
        self._barrier_seq[rank] = seq + 1
        with self.cv:
            c = self._barriers.setdefault(
                f"host#{seq}", _Collective(SimGroup("host", tuple(range(self.world_size)), {}), what)
            )
            if c.kind != what:
                err = SimDeadlock(
                    f"ranks create groups in different orders: rank {rank} {what}, another {c.kind}"
                )
                self.deadlock, self.failure = str(err), err
                raise SimStop(str(err))
            op = Op(rank, "barrier", ("host",), None, None, what, float("inf"), time.monotonic(), coll=c)
            c.members[rank] = op
            if len(c.members) == self.world_size:
                for m in c.members.values():
                    m.done = True
                self.cv.notify_all()
        self._block(rank, what, [op], None)

    # ------------------------------------------------------------------ the torch.distributed facade
    def init_process_group(
        self, backend: str, *, rank: int, world_size: int, timeout: timedelta, **kw: Any
    ) -> None:
        assert rank == self._rank() and world_size == self.world_size, (rank, world_size)
        with self.cv:
            eager = kw.get("device_id") is not None
            if self.eager is None:
                self.eager, self.backend = eager, backend
            assert (self.eager, self.backend) == (eager, backend), (
                "ranks disagree on the backend or device_id"
            )
            if self.world is None:
                self.world = SimGroup("world", tuple(range(world_size)), {})
                self.groups.append(self.world)
            self.world.timeout_s[rank] = timeout.total_seconds()
        self._host_barrier("init_process_group")

    def new_group(self, ranks: list[int] | None = None, timeout: timedelta | None = None, **kw: Any) -> Any:
        rank = self._rank()
        members = tuple(sorted(ranks if ranks is not None else range(self.world_size)))
        self._host_barrier(f"new_group({list(members)})")
        with self.cv:
            seq = self._barrier_seq[rank]
            name = f"pg{seq - 1}"
            g = next((x for x in self.groups if x.name == name), None)
            if g is None:
                g = SimGroup(name, members, {})
                self.groups.append(g)
            if rank not in members:
                return NON_MEMBER
            g.timeout_s[rank] = timeout.total_seconds() if timeout is not None else 600.0
        return g

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> SimWork:
        return self._p2p("send", tensor, dst, group)

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> SimWork:
        return self._p2p("recv", tensor, src, group)

    def batch_isend_irecv(self, *_: Any, **__: Any) -> None:
        raise NotImplementedError("batch_isend_irecv is not modelled by NcclSim")

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: Any = real_dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> SimWork | None:
        work = self._collective("all_reduce", group, (tensor, op), f"all_reduce {tuple(tensor.shape)}")
        if async_op:
            return work
        _wait_now(work)
        return None

    def all_gather(
        self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> SimWork | None:
        work = self._collective(
            "all_gather", group, (tensor_list, tensor), f"all_gather {tuple(tensor.shape)}"
        )
        if async_op:
            return work
        _wait_now(work)
        return None

    def barrier(self, group: Any = None, **_: Any) -> None:
        _wait_now(self._collective("all_reduce", group, (torch.zeros(1), real_dist.ReduceOp.SUM), "barrier"))

    def is_initialized(self) -> bool:
        return self.world is not None and self._rank() not in self.destroyed

    def destroy_process_group(self, group: Any = None) -> None:
        self.destroyed.add(self._rank())

    def abort_process_group(self, group: Any = None) -> None:
        rank = self._rank()
        self.aborted.add(rank)
        self.destroyed.add(rank)

    def set_pg_timeout(self, timeout: timedelta, group: Any = None) -> None:
        g = self._group(group)
        with self.cv:
            g.timeout_s[self._rank()] = timeout.total_seconds()

    def dist_module(self) -> SimpleNamespace:
        return SimpleNamespace(
            init_process_group=self.init_process_group,
            new_group=self.new_group,
            isend=self.isend,
            irecv=self.irecv,
            batch_isend_irecv=self.batch_isend_irecv,
            all_reduce=self.all_reduce,
            all_gather=self.all_gather,
            barrier=self.barrier,
            is_available=lambda: True,
            is_initialized=self.is_initialized,
            destroy_process_group=self.destroy_process_group,
            get_rank=self._rank,
            get_world_size=lambda group=None: self.world_size,
            ReduceOp=real_dist.ReduceOp,
            GroupMember=SimpleNamespace(NON_GROUP_MEMBER=NON_MEMBER, WORLD=None),
            Work=SimWork,
            Store=real_dist.Store,
        )

    # ------------------------------------------------------------------ torch.cuda
    def device_synchronize(self, device: Any = None) -> None:
        rank = self._rank()
        with self.cv:
            pending = [op for (r, _), q in self.queues.items() if r == rank for op in q if not op.done]
            streams = [
                self.default_stream(rank),
                *([s] if (s := getattr(self.local, "stream", None)) else []),
            ]
        self._host_waits(rank, "torch.cuda.synchronize()", max(s.last_compute for s in streams))
        self._block(rank, "torch.cuda.synchronize() (every stream of the device)", pending, None)
        self._sleep_until(max(s.busy_until for s in streams))

    @contextmanager
    def patch(self, monkeypatch: pytest.MonkeyPatch, modules: list[Any]) -> Iterator[NcclSim]:
        """Substitute the simulated ``torch.distributed`` in ``modules`` (each imports it as ``dist``)
        and the simulated ``torch.cuda`` calls everywhere, for the duration of the block."""
        import torch.distributed.distributed_c10d as c10d

        fake = self.dist_module()
        for m in modules:
            monkeypatch.setattr(m, "dist", fake)
        monkeypatch.setattr(c10d, "_set_pg_timeout", self.set_pg_timeout)
        monkeypatch.setattr(c10d, "_abort_process_group", self.abort_process_group)
        monkeypatch.setattr(torch.cuda, "synchronize", self.device_synchronize)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, **_: SimStream(self, self._rank()))
        monkeypatch.setattr(torch.cuda, "stream", self.use_stream)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: SimEvent(self, **kw))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _SIM_GPU)
        yield self


_SIM_GPU = SimpleNamespace(name="simulated H100", total_memory=80 << 30, major=9, minor=0)
"""What ``torch.cuda.get_device_properties`` answers under the simulator (the planner's capacity)."""


def _wait_now(work: SimWork) -> None:
    """A blocking collective (``async_op=False``): the host waits, no timeout (the model's own)."""
    work.sim._block(work.op.rank, f"{work.op}", [work.op], None)


def _complete_collective(c: _Collective) -> None:
    ranks = c.group.ranks
    if c.kind == "all_reduce":
        tensors = [c.members[r].payload[0] for r in ranks]
        op = c.members[ranks[0]].payload[1]
        stacked = torch.stack([t.detach().reshape(-1).clone() for t in tensors])
        result = stacked.amax(0) if op == real_dist.ReduceOp.MAX else stacked.sum(0)
        for t in tensors:
            t.view(-1).copy_(result.to(t.dtype))
    elif c.kind == "all_gather":
        inputs = [c.members[r].payload[1].detach().clone() for r in ranks]
        for r in ranks:
            for out, x in zip(c.members[r].payload[0], inputs, strict=True):
                out.copy_(x)
    for r in ranks:
        c.members[r].done = True


def _find_cycle(edges: dict[int, list[int]]) -> list[int]:
    """A cycle of the wait-for graph ``edges`` (rank -> ranks it waits on), or []."""
    for start in sorted(edges):
        path, seen = [start], {start}
        node = start
        while edges.get(node):
            node = edges[node][0]
            if node in seen:
                return path[path.index(node) :] + [node]
            path.append(node)
            seen.add(node)
    return []
