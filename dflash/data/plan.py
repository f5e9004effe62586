"""The data plan: which samples go into packet g, computed identically on every rank.

Per epoch e the samples are shuffled with ``torch.randperm`` seeded by ``seed * 1000003 + e``
and packed greedily in that order: a sample joins the current packet while the packet's total
stays <= token_budget, else it opens a new packet. Packets never span epochs, and packet numbers
run on across epochs (epoch 1's first packet follows epoch 0's last). Only the sample lengths,
the budget, the seed and the epoch count are inputs, so every target and drafter rank derives
the same plan and the same number of packets without communicating.

Storage is two flat tensors (``order`` and ``bounds``) rather than one tensor per packet:
a million samples over several epochs would otherwise be hundreds of thousands of small tensors
on every rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

SEED_STRIDE = 1000003


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """[n] int64: the sample order of one epoch."""
    gen = torch.Generator().manual_seed(seed * SEED_STRIDE + epoch)
    return torch.randperm(n, generator=gen)


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

    @classmethod
    def build(cls, lengths: torch.Tensor, token_budget: int, seed: int, num_epochs: int) -> DataPlan:
        """The plan for samples of ``lengths`` ([n] ints): deterministic in its four inputs.

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
            perm = epoch_permutation(n, seed, epoch)
            b = torch.tensor(greedy_pack(lengths[perm].tolist(), token_budget)[1:], dtype=torch.int64)
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

    def fingerprint(self) -> str:
        """sha256 of the settings and the full packet layout (to detect a changed plan on resume)."""
        h = hashlib.sha256(f"{self.token_budget}:{self.seed}:{self.num_epochs}".encode())
        h.update(self.order.numpy().tobytes())
        h.update(self.bounds.numpy().tobytes())
        return h.hexdigest()
