"""Data plan: deterministic, within budget, every sample once per epoch, greedy, fast."""

from __future__ import annotations

import time

import pytest
import torch

from dflash.data.plan import DataPlan, epoch_permutation, greedy_pack


def random_lengths(n: int, hi: int = 300, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, hi + 1, (n,), generator=torch.Generator().manual_seed(seed))


def test_deterministic_from_inputs_alone():
    lengths = random_lengths(500)
    a = DataPlan.build(lengths, 1024, seed=7, num_epochs=3)
    b = DataPlan.build(lengths.clone().to(torch.int32), 1024, seed=7, num_epochs=3)
    assert a.num_packets == b.num_packets
    assert all(torch.equal(a.packet(g), b.packet(g)) for g in range(a.num_packets))
    assert a.fingerprint() == b.fingerprint()


def test_budget_respected_and_every_sample_once_per_epoch():
    lengths = random_lengths(777)
    budget, epochs = 900, 4
    plan = DataPlan.build(lengths, budget, seed=3, num_epochs=epochs)
    assert len(plan.packets) == plan.num_packets
    seen = [[] for _ in range(epochs)]
    for g in range(plan.num_packets):
        p = plan.packet(g)
        assert p.dtype == torch.int64 and p.numel() >= 1
        assert int(lengths[p].sum()) <= budget
        seen[plan.epoch_of(g)].append(p)
    for e in range(epochs):
        idx = torch.cat(seen[e])
        assert torch.equal(idx.sort().values, torch.arange(len(lengths)))  # each sample exactly once
        assert torch.equal(idx, epoch_permutation(len(lengths), 3, e))  # in the epoch's shuffled order
    # epochs differ in order; packets are contiguous in epoch and never span two
    assert not torch.equal(torch.cat(seen[0]), torch.cat(seen[1]))
    assert plan.epoch_starts.tolist()[0] == 0 and plan.epoch_starts.tolist()[-1] == plan.num_packets


def test_packing_is_greedy():
    lengths = random_lengths(400)
    plan = DataPlan.build(lengths, 1000, seed=1, num_epochs=1)
    for g in range(plan.num_packets - 1):
        # the next packet's first sample did not fit in this one
        assert int(lengths[plan.packet(g)].sum() + lengths[plan.packet(g + 1)[0]]) > 1000
    assert greedy_pack([3, 3, 3, 5, 1], 6) == [0, 2, 3, 5]
    assert greedy_pack([6, 6], 6) == [0, 1, 2]


def test_different_seeds_differ():
    lengths = random_lengths(300)
    a = DataPlan.build(lengths, 800, seed=1, num_epochs=1)
    b = DataPlan.build(lengths, 800, seed=2, num_epochs=1)
    assert not torch.equal(a.order, b.order) and a.fingerprint() != b.fingerprint()


def test_oversize_and_invalid_inputs_raise():
    lengths = torch.tensor([10, 2049, 5])
    with pytest.raises(ValueError, match=r"data\.token_budget=2048.*data\.max_length"):
        DataPlan.build(lengths, 2048, seed=0, num_epochs=1)
    with pytest.raises(ValueError, match="empty"):
        DataPlan.build(torch.zeros(0, dtype=torch.int64), 2048, seed=0, num_epochs=1)
    with pytest.raises(ValueError, match="data.num_epochs"):
        DataPlan.build(torch.tensor([3]), 2048, seed=0, num_epochs=0)
    with pytest.raises(IndexError):
        DataPlan.build(torch.tensor([3]), 8, seed=0, num_epochs=1).packet(1)


def test_million_samples_is_fast():
    lengths = random_lengths(1_000_000, hi=2048)
    t0 = time.perf_counter()
    plan = DataPlan.build(lengths, 16384, seed=42, num_epochs=1)
    elapsed = time.perf_counter() - t0
    assert plan.order.numel() == 1_000_000 and plan.num_packets > 60_000
    assert elapsed < 5.0, f"planning 1M samples took {elapsed:.2f}s"


def chat_lengths(n: int, cap: int, seed: int = 0) -> torch.Tensor:
    """Lengths spread like a chat set's (lognormal, mean ~1,000 tokens, sigma 1)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) + 6.4).exp().round().clamp(1, cap).to(torch.int64)


def test_padded_rows_are_bounded_by_rows_times_longest():
    """One sample per padded row costs the target rows x longest: the plan bounds that, not the real
    total, and still takes every sample once per epoch, deterministically. Packing by real tokens
    instead (what a packed row needs) would hand the target several budgets in one packet."""
    lengths, budget = chat_lengths(20_000, 4096), 65536
    plan = DataPlan.build(lengths, budget, seed=5, num_epochs=2, padded_rows=True)
    real, computed = plan.packet_tokens(lengths)
    assert int(computed.max()) <= budget
    for g in range(plan.num_packets):
        p = plan.packet(g)
        assert int(lengths[p].max()) * p.numel() == int(computed[g]) and int(lengths[p].sum()) == int(real[g])
    for e in range(2):
        idx = plan.order[e * len(lengths) : (e + 1) * len(lengths)]
        assert torch.equal(idx.sort().values, torch.arange(len(lengths)))
    assert float(real.sum()) / float(computed.sum()) > 0.9  # bucketed: little padding
    again = DataPlan.build(lengths, budget, seed=5, num_epochs=2, padded_rows=True)
    assert torch.equal(again.order, plan.order) and torch.equal(again.bounds, plan.bounds)
    packed = DataPlan.build(lengths, budget, seed=5, num_epochs=2)
    assert packed.fingerprint() != plan.fingerprint()
    naive_real, _ = packed.packet_tokens(lengths)
    naive = torch.stack(
        [lengths[packed.packet(g)].max() * packed.packet(g).numel() for g in range(packed.num_packets)]
    )
    assert float((naive / naive_real).median()) > 2.5  # what padded rows of this plan would cost
    assert int(naive_real.max()) <= budget


def test_padded_buckets_are_shuffled_not_sorted():
    """The packets of a bucket window come in a seeded random order (not longest first), and a
    different seed gives another plan."""
    lengths = chat_lengths(20_000, 4096)
    plan = DataPlan.build(lengths, 16384, seed=1, num_epochs=1, padded_rows=True)
    longest = torch.stack([lengths[plan.packet(g)].max() for g in range(plan.num_packets)])
    assert not bool((longest[1:] <= longest[:-1]).all())
    other = DataPlan.build(lengths, 16384, seed=2, num_epochs=1, padded_rows=True)
    assert not torch.equal(other.order, plan.order)
