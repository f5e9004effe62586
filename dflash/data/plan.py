"""The data plan: which samples go into packet g, computed identically on every rank.

Per epoch e the samples are shuffled with ``torch.randperm`` seeded by ``seed * 1000003 + e``
and packed greedily in that order: a sample joins the current packet while the packet's total
stays <= token_budget, else it opens a new packet. Packets never span epochs, and packet numbers
run on across epochs (epoch 1's first packet follows epoch 0's last). Only the sample lengths,
the budget, the seed, the epoch count and the row layout are inputs, so every target and drafter
rank derives the same plan and the same number of packets without communicating.

Padded rows (``target.pack=false``: one sample per row, every row as long as the packet's longest)
cost the target ``rows x longest`` tokens, not the real ones. Packing shuffled samples by their real
total would make that several times the budget (lengths of a chat set spread over a decade), so such
a plan is length-bucketed instead: the shuffled epoch is cut into windows of about
:data:`BUCKET_WINDOW_PACKETS` budgets of tokens, each window sorted longest first and packed while
``rows x longest <= token_budget``, and the window's packets shuffled (the same seeded generator, so
still deterministic and resumable).

Storage is two flat tensors (``order`` and ``bounds``) rather than one tensor per packet:
a million samples over several epochs would otherwise be hundreds of thousands of small tensors
on every rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

SEED_STRIDE = 1000003
BUCKET_WINDOW_PACKETS = 64
"""Padded rows: a length bucket is cut from about this many packets' worth of shuffled samples."""


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * SEED_STRIDE + epoch)


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """[n] int64: the sample order of one epoch."""
    return torch.randperm(n, generator=_epoch_generator(seed, epoch))


def greedy_pack(lengths: list[int], token_budget: int) -> list[int]:
    """Packet boundaries of in-order greedy packing: ``[0, b1, ..., len(lengths)]``.

    Packet k holds positions ``[bounds[k], bounds[k+1])``; each packet's total is <= token_budget
    (every length must be <= token_budget, checked by the caller). One pass over plain ints.
    """
    bounds = [0]
    cur = 0
    append = bounds.append
    for i, x in enumerate(lengths):
        if cur + x > token_budget:
            append(i)
            cur = 0
        cur += x
    if lengths:
        append(len(lengths))
    return bounds


def bucketed_pack(lengths: list[int], token_budget: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """Length-bucketed packing for padded rows (module docstring): ``(order, bounds)``, ``order`` a
    permutation of ``range(len(lengths))`` and packet k ``order[bounds[k]:bounds[k+1]]``, every
    packet's ``rows x longest <= token_budget`` (every length must be <= token_budget, checked by the
    caller). Ties keep their input order; ``gen`` shuffles each window's packets."""
    order: list[int] = []
    bounds = [0]
    window_tokens = BUCKET_WINDOW_PACKETS * token_budget
    start, n = 0, len(lengths)
    while start < n:
        end, total = start, 0
        while end < n and total < window_tokens:
            total += lengths[end]
            end += 1
        packets: list[list[int]] = []
        for i in sorted(range(start, end), key=lambda j: -lengths[j]):
            if not packets or (len(packets[-1]) + 1) * lengths[packets[-1][0]] > token_budget:
                packets.append([])
            packets[-1].append(i)  # longest first: a packet's first sample is its longest
        for k in torch.randperm(len(packets), generator=gen).tolist():
            order.extend(packets[k])
            bounds.append(len(order))
        start = end
    return order, bounds


@dataclass(frozen=True, eq=False)
class DataPlan:
    """Packet g is ``order[bounds[g]:bounds[g+1]]``: int64 indices into the TokenizedDataset."""

    order: torch.Tensor
    """[num_epochs * n] int64: sample indices in packing order, epoch after epoch."""
    bounds: torch.Tensor
    """[num_packets + 1] int64: packet boundaries in ``order``."""
    epoch_starts: torch.Tensor
    """[num_epochs + 1] int64: the first packet of each epoch (and num_packets at the end)."""
    token_budget: int
    seed: int
    num_epochs: int
    padded_rows: bool = False
    """Packets bound ``rows x longest`` (length-bucketed) rather than the real tokens."""

    @classmethod
    def build(
        cls,
        lengths: torch.Tensor,
        token_budget: int,
        seed: int,
        num_epochs: int,
        *,
        padded_rows: bool = False,
    ) -> DataPlan:
        """The plan for samples of ``lengths`` ([n] ints): deterministic in its inputs. ``padded_rows``:
        the target runs one sample per padded row (``not target.pack``), so packets are length-bucketed.

        Raises ValueError when a sample is longer than token_budget (it could never be packed),
        on an empty dataset, or on a non-positive budget or epoch count.
        """
        if token_budget < 1:
            raise ValueError(f"data.token_budget={token_budget}: must be >= 1")
        if num_epochs < 1:
            raise ValueError(f"data.num_epochs={num_epochs}: must be >= 1")
        lengths = torch.as_tensor(lengths).to(torch.int64).flatten().cpu()
        n = lengths.numel()
        if n == 0:
            raise ValueError(
                "the tokenized dataset is empty: nothing to plan (check data.path and the skip counts)"
            )
        if int(lengths.min()) < 1:
            raise ValueError(
                f"sample {int(lengths.argmin())} has length {int(lengths.min())}: lengths must be >= 1"
            )
        longest = int(lengths.max())
        if longest > token_budget:
            raise ValueError(
                f"data.token_budget={token_budget} is smaller than sample {int(lengths.argmax())} "
                f"({longest} tokens): set data.token_budget >= data.max_length (or >= {longest}), "
                f"or lower data.max_length"
            )
        orders, bounds, epoch_starts = [], [torch.zeros(1, dtype=torch.int64)], [0]
        for epoch in range(num_epochs):
            gen = _epoch_generator(seed, epoch)
            perm = torch.randperm(n, generator=gen)
            if padded_rows:
                within, packet_bounds = bucketed_pack(lengths[perm].tolist(), token_budget, gen)
                perm = perm[torch.tensor(within, dtype=torch.int64)]
            else:
                packet_bounds = greedy_pack(lengths[perm].tolist(), token_budget)
            b = torch.tensor(packet_bounds[1:], dtype=torch.int64)
            orders.append(perm)
            bounds.append(b + epoch * n)
            epoch_starts.append(epoch_starts[-1] + b.numel())
        return cls(
            order=torch.cat(orders),
            bounds=torch.cat(bounds),
            epoch_starts=torch.tensor(epoch_starts, dtype=torch.int64),
            token_budget=int(token_budget),
            seed=int(seed),
            num_epochs=int(num_epochs),
            padded_rows=bool(padded_rows),
        )

    @property
    def num_packets(self) -> int:
        return self.bounds.numel() - 1

    def packet(self, g: int) -> torch.Tensor:
        """int64 sample indices of packet g, in packing order (a view of ``order``)."""
        if not 0 <= g < self.num_packets:
            raise IndexError(f"packet {g} outside the plan's {self.num_packets} packets")
        return self.order[int(self.bounds[g]) : int(self.bounds[g + 1])]

    @property
    def packets(self) -> list[torch.Tensor]:
        """Every packet (views of ``order``); built on each access, prefer :meth:`packet`."""
        return list(torch.split(self.order, (self.bounds[1:] - self.bounds[:-1]).tolist()))

    def epoch_of(self, g: int) -> int:
        """The epoch packet g belongs to."""
        if not 0 <= g < self.num_packets:
            raise IndexError(f"packet {g} outside the plan's {self.num_packets} packets")
        return int(torch.searchsorted(self.epoch_starts, g, right=True)) - 1

    def num_steps(self, packets_per_step: int, max_steps: int | None) -> int:
        """Optimizer steps of ``packets_per_step`` packets a run takes: every full step of the plan
        (a partial last step is dropped), at most ``max_steps``. ValueError when not even one fits."""
        available = self.num_packets // packets_per_step
        if available < 1:
            raise ValueError(
                f"the data plan has {self.num_packets} packets, fewer than one step needs ({packets_per_step}); "
                f"lower data.token_budget or optim.grad_accum_steps, or add data"
            )
        return min(max_steps or available, available)

    def packet_tokens(self, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(real, computed)``, each [num_packets] int64, for samples of ``lengths`` (the plan's): the
        packets' real tokens, and the tokens the target computes (the same, or ``rows x longest``
        with padded rows)."""
        lengths = torch.as_tensor(lengths).to(torch.int64).flatten()[self.order]
        pieces = lengths.split((self.bounds[1:] - self.bounds[:-1]).tolist())
        real = torch.stack([p.sum() for p in pieces])
        if not self.padded_rows:
            return real, real
        return real, torch.stack([p.max() * p.numel() for p in pieces])

    def fingerprint(self) -> str:
        """sha256 of the settings and the full packet layout (to detect a changed plan on resume)."""
        layout = ":padded" if self.padded_rows else ""
        h = hashlib.sha256(f"{self.token_budget}:{self.seed}:{self.num_epochs}{layout}".encode())
        h.update(self.order.numpy().tobytes())
        h.update(self.bounds.numpy().tobytes())
        return h.hexdigest()
