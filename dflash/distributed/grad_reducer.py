"""GradReducer: sums the drafters' gradients over the drafter group while backward still runs.

Parameters are grouped into buckets of about ``bucket_bytes`` in reverse registration order (the
order backward produces their gradients: the last layers first). During the last micro-batch of an
optimizer step (``arm()``), a hook fires when a parameter's gradient is final; once every gradient
of a bucket (and of every bucket before it) is final, the bucket is flattened and its all-reduce
is launched asynchronously, so communication overlaps the rest of backward. ``finish()`` launches
what is left (a rank whose last packet was empty runs no backward at all), waits with a timeout,
and writes the sums back. Buckets are always launched in index order, so every rank issues the
same collectives in the same order, whatever its own backward did.

The result is the plain sum of every drafter's gradient (the caller divides by the global weight
sum, as with one drafter); with two drafters it is bitwise equal to one flat all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dflash.distributed.links import PeerError, short_error
from dflash.distributed.process_group import DistContext

DEFAULT_BUCKET_BYTES = 25 << 20


class GradReducer:
    """Overlapped SUM all-reduce of ``params``' gradients among the drafters (see the module doc)."""

    def __init__(
        self, params: list[nn.Parameter], ctx: DistContext, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ):
        self.ctx = ctx
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        size = bucket_bytes
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if size + nbytes > bucket_bytes and self.buckets and self.buckets[-1]:
                self.buckets.append([])
                size = 0
            if not self.buckets:
                self.buckets.append([])
            self.buckets[-1].append(p)
            size += nbytes
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._armed = False
        self._held = False
        self._missing: list[int] = []
        self._next = 0
        self._inflight: list[tuple[int, Tensor, dist.Work]] = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        """The next backward is the last of the step: reduce each bucket as soon as it is final."""
        self._armed = True
        self._missing = [len(b) for b in self.buckets]
        self._next = 0
        self._inflight = []

    @contextmanager
    def held(self) -> Iterator[None]:
        """A backward inside is not the step's last one even when armed (a chunk of a packet's
        blocks): its gradients are not final, so no bucket is counted or launched."""
        self._held = True
        try:
            yield
        finally:
            self._held = False

    def _on_grad(self, p: Tensor) -> None:
        if not self._armed or self._held:
            return
        self._missing[self._bucket_of[id(p)]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[b]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.ctx.drafter_group, async_op=True)
        self._inflight.append((b, flat, work))

    def finish(self, timeout_s: float) -> None:
        """Launch the buckets backward did not finish, wait for all, write the sums into ``.grad``."""
        if not self._armed:
            self.arm()
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self._armed = False
        topo = self.ctx.topology
        assert topo is not None
        for b, flat, work in self._inflight:
            try:
                ok = work.wait(timeout=timedelta(seconds=timeout_s))
            except Exception as e:  # noqa: BLE001 - any backend failure: a drafter died or hung
                raise PeerError(self._failure(f"failed ({short_error(e)})", timeout_s)) from e
            if ok is False:
                raise PeerError(self._failure("timed out", timeout_s))
            offset = 0
            for p in self.buckets[b]:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[offset : offset + n].view_as(p))
                offset += n
        self._inflight = []

    def _failure(self, what: str, timeout_s: float) -> str:
        topo = self.ctx.topology
        assert topo is not None
        names = ", ".join(topo.describe(r) for r in topo.drafter_ranks)
        return (
            f"{topo.describe(self.ctx.rank)}: gradient all_reduce among [{names}] {what} (timeout {timeout_s:g}s); "
            f"a drafter is dead or stuck"
        )
