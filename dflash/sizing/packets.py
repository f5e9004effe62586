"""The packets a plan models, from the data's sample lengths.

A run's packets differ: with padded rows (``target.pack=false``) the data plan buckets samples by
length, so a packet of short samples holds several times the samples, and the anchors, of a packet of
long ones; packed rows of real lengths differ less. The planner therefore models three packets
(:class:`Packets`):

- ``target``: the packet of the most target work (memory of a target rank, its rehearsal, the
  target's FLOPs): ``n = token_budget // L`` samples of the mean length ``L`` (packed rows without a
  prepared dataset), ``n`` samples at evenly spaced quantiles of the prepared lengths (packed rows,
  :func:`packed_lengths`), or the data plan's packet of the most ``rows x longest`` tokens (padded
  rows: the data plan laid out over the lengths);
- ``drafter``: the packet of the most trained anchors (a drafter rank's memory and its rehearsal):
  the data plan's packet with the most anchors after ``drafter.max_anchors_per_packet``, then the most
  tokens; the target packet when the lengths are all equal;
- ``mean``: the epoch's packets on average (the drafter's FLOPs, the bytes on the wire, the
  throughput and the training signal; :class:`PacketMix`).

Per sample of length ``L``: the supervised span is the last ``s = supervised_fraction * L`` tokens
(prompt first), giving ``s - 1`` eligible anchors, ``min(num_anchors, s - 1)`` of them (the
recipe's anchors of that sample); a packet keeps at most ``max_anchors_per_packet`` (drawn uniformly
among its samples' anchors, as :func:`dflash.drafter.blocks.sample_anchors` does); a block's slots
fall inside the span with probability ``1 - B / (2 s)``; a position of the span is read by some
slot's verifier row unless none of the ``B - 1`` anchors before it is drawn (``1 - (1 - f)^(B - 1)``
for a share ``f`` of its positions drawn); an anchor sees ``L - s/2`` context tokens on average. A flex
run pads the drafter's context to the token budget and its blocks to ``max_anchors_per_packet`` (the
static shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash.config import Config
from dflash.config.resolve import drafter_attention
from dflash.data.plan import BUCKET_WINDOW_PACKETS, DataPlan
from dflash.sizing.costs import PacketShape

DEFAULT_LENGTH_SIGMA = 1.0
"""Without the prepared dataset's lengths, padded rows are planned on lognormal sample lengths of
this sigma around the mean (a chat set's spread: a tenth to three times the mean), capped at
``data.max_length``."""


MAX_PLANNED_LENGTHS = 100_000
"""Sample lengths the planner lays out packets from (a larger cache is strided down to this)."""


@dataclass(frozen=True)
class DataStats:
    """What the packets are made of: the mean sample length, the supervised share and the prepared
    dataset's sample lengths when they come from its cache."""

    mean_sample_tokens: float
    supervised_fraction: float
    source: str
    lengths: tuple[int, ...] | None = None
    """At most :data:`MAX_PLANNED_LENGTHS`, evenly strided."""
    num_samples: int | None = None
    """The prepared dataset's samples (None without a cache)."""


def plan_device(cfg: Config) -> str:
    """The device the run is planned for: cpu when the topology says so, else cuda."""
    return "cpu" if cfg.topology.device == "cpu" else "cuda"


@dataclass(frozen=True)
class PacketMix:
    """One epoch's packets on average (the data plan's; one packet of equal samples when no lengths
    are known), with the anchors they offer and keep."""

    num_packets: int
    samples: float
    """Samples per packet."""
    tokens: float
    """Real tokens per packet."""
    offered: float
    """Anchors per packet at ``drafter.num_anchors`` per sample, before ``max_anchors_per_packet``."""
    trained: float
    """Anchors per packet after ``max_anchors_per_packet``."""
    slots: float
    """Supervised block slots per packet (the loss rows): the training signal."""
    largest_offer: int
    """The most anchors one packet offers: a cap at or above it never cuts."""
    offer_quantiles: dict[float, int]
    """Anchors a packet offers at these quantiles of the epoch's packets (0.5, 0.75, 0.9, 1.0)."""
    trained_by_packet: tuple[int, ...]
    """Anchors each packet of the epoch trains (after the cap)."""

    @property
    def offered_per_sample(self) -> float:
        """The recipe's anchors per sample on this data (``drafter.num_anchors``, fewer where a
        sample has fewer eligible positions)."""
        return self.offered / self.samples

    @property
    def trained_per_sample(self) -> float:
        return self.trained / self.samples

    @property
    def kept(self) -> float:
        """The share of the offered anchors the cap keeps (1: the recipe's, every one)."""
        return self.trained / self.offered if self.offered else 1.0


@dataclass(frozen=True)
class Packets:
    """The packets a plan models (module docstring)."""

    target: PacketShape
    drafter: PacketShape
    mean: PacketShape
    mix: PacketMix
    lengths: str
    """Where the sample lengths come from (the prepared dataset's, the lognormal default spread, or
    samples of the mean length)."""


def packed_lengths(lengths: tuple[int, ...], budget: int, max_length: int) -> tuple[int, ...]:
    """The sample lengths of a typical packed packet drawn from a dataset's ``lengths``: as many
    samples as the budget holds at their mean, taken at evenly spaced quantiles of the lengths
    (each cut to ``max_length`` and the budget), then the middle ones dropped while the packet is
    over ``budget``. Sorted; deterministic."""
    xs = sorted(min(max(1, int(x)), max_length, budget) for x in lengths)
    n = max(1, int(budget // (sum(xs) / len(xs))))
    picked = [xs[min(len(xs) - 1, int((i + 0.5) * len(xs) / n))] for i in range(n)]
    while sum(picked) > budget and len(picked) > 1:
        picked.pop(len(picked) // 2)
    return tuple(picked)


def planned_lengths(cfg: Config, stats: DataStats) -> tuple[torch.Tensor | None, str]:
    """The sample lengths one epoch's packets are laid out from (each cut to ``data.max_length`` and the
    budget) and where they come from: the prepared dataset's, else for padded rows
    :data:`DEFAULT_LENGTH_SIGMA` lognormal lengths around the mean (64 packets' worth, seed 0), else
    None (packed rows of samples of the mean length)."""
    budget = cfg.data.token_budget
    cap = min(cfg.data.max_length, budget)
    if stats.lengths is not None:
        return torch.tensor(stats.lengths, dtype=torch.int64).clamp(
            1, cap
        ), f"sample lengths of the {stats.source}"
    if cfg.target.pack:
        return None, "samples of the mean length"
    mean = max(2.0, stats.mean_sample_tokens)
    n = BUCKET_WINDOW_PACKETS * max(1, math.ceil(budget / mean))
    mu = math.log(mean) - DEFAULT_LENGTH_SIGMA**2 / 2
    noise = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lengths = (noise * DEFAULT_LENGTH_SIGMA + mu).exp().round().clamp(1, cap).to(torch.int64)
    return lengths, f"lognormal lengths, sigma {DEFAULT_LENGTH_SIGMA:g}, mean {mean:.0f}"


@dataclass(frozen=True)
class _SampleAnchors:
    """Per sample (float64 [n] tensors): the supervised span, the anchors it offers, the supervised
    slots per anchor and the mean context an anchor sees."""

    span: torch.Tensor
    offered: torch.Tensor
    slots_per_anchor: torch.Tensor
    context: torch.Tensor

    @classmethod
    def of(cls, lengths: torch.Tensor, cfg: Config, supervised_fraction: float) -> _SampleAnchors:
        d = cfg.drafter
        x = lengths.double()
        span = supervised_fraction * x
        offered = (span.floor() - 1).clamp(min=0).clamp(max=d.num_anchors)
        inside = torch.where(span > 0, (1 - d.block_size / (2 * span.clamp(min=1e-9))).clamp(min=0), 0.0)
        return cls(span, offered, (d.block_size - 1) * inside, x - span / 2)

    def positions(self, thinned: torch.Tensor, block_size: int) -> torch.Tensor:
        """Distinct verifier positions per sample when a share ``thinned`` of its anchors is kept."""
        drawn = torch.where(self.span > 1, self.offered / (self.span - 1).clamp(min=1e-9), 0.0)
        return self.span * (1 - (1 - (drawn * thinned).clamp(max=1.0)) ** (block_size - 1))


def _shape(
    cfg: Config,
    stats: DataStats,
    docs: torch.Tensor,
    *,
    computed: int,
    row: int,
    equal: bool,
    cap: int | None,
) -> PacketShape:
    """The :class:`PacketShape` of one packet of samples of ``docs`` lengths (``equal``: samples of the
    mean length, no ``doc_lengths``), ``computed`` target tokens in rows of ``row``."""
    d = cfg.drafter
    per = _SampleAnchors.of(docs, cfg, stats.supervised_fraction)
    offered = float(per.offered.sum())
    planned = int(offered)
    thinned = 1.0
    if cap is not None and planned > cap:
        thinned, planned = cap / planned, cap
    rows = float((per.offered * per.slots_per_anchor).sum()) * thinned
    positions = float(per.positions(torch.tensor(thinned), d.block_size).sum())
    static = static_shape(cfg)
    tokens = round(float(docs.sum()))  # samples of a fractional mean length: their rounded total
    return PacketShape(
        tokens=tokens,
        num_seqs=int(docs.numel()),
        num_anchors=planned,
        loss_rows=round(rows),
        verifier_rows=round(min(positions, rows)),
        target_tokens=computed,
        target_row_tokens=row,
        drafter_context_tokens=cfg.data.token_budget if static else None,
        drafter_blocks=d.max_anchors_per_packet if static else None,
        anchor_context=(
            float((per.offered * per.context).sum()) / offered
            if offered
            else float(docs[0]) * (1 - stats.supervised_fraction / 2)
        ),
        doc_lengths=None if equal else tuple(int(x) for x in docs.tolist()),
    )


def static_shape(cfg: Config) -> bool:
    """The drafter runs a static shape (flex): context padded to the budget, blocks to the cap."""
    d = cfg.drafter
    return drafter_attention(d.attention, plan_device(cfg)) == "flex" and d.max_anchors_per_packet is not None


QUANTILES = (0.5, 0.75, 0.9, 1.0)


def plan_packets(cfg: Config, stats: DataStats) -> Packets:
    """The three packets of ``cfg`` over ``stats`` (module docstring)."""
    budget, cap = cfg.data.token_budget, cfg.drafter.max_anchors_per_packet
    lengths, source = planned_lengths(cfg, stats)
    if lengths is None:  # packed samples of the mean length: every packet alike
        length = max(2.0, min(stats.mean_sample_tokens, float(cfg.data.max_length)))
        n = max(1, int(budget // length))
        docs = torch.full((n,), length, dtype=torch.float64)
        total = round(n * length)
        one = _shape(cfg, stats, docs, computed=total, row=total, equal=True, cap=cap)
        offered = float(_SampleAnchors.of(docs, cfg, stats.supervised_fraction).offered.sum())
        mix = PacketMix(
            num_packets=1,
            samples=float(n),
            tokens=float(total),
            offered=offered,
            trained=float(one.num_anchors),
            slots=float(one.loss_rows or 0),
            largest_offer=int(offered),
            offer_quantiles={q: int(offered) for q in QUANTILES},
            trained_by_packet=(one.num_anchors,),
        )
        return Packets(one, one, one, mix, source)
    padded = not cfg.target.pack
    plan = DataPlan.build(lengths, budget, cfg.data.seed, 1, padded_rows=padded)
    real, computed = plan.packet_tokens(lengths)
    sizes = (plan.bounds[1:] - plan.bounds[:-1]).tolist()
    ordered = lengths[plan.order]
    per = _SampleAnchors.of(ordered, cfg, stats.supervised_fraction)
    packet_of = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))

    def per_packet(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, packet_of, values)

    offers = per_packet(per.offered)
    kept = offers.clamp(max=cap) if cap is not None else offers
    thinned = torch.where(offers > 0, kept / offers.clamp(min=1e-9), 1.0)
    slots = per_packet(per.offered * per.slots_per_anchor) * thinned
    positions = per_packet(per.positions(thinned[packet_of], cfg.drafter.block_size))
    context = per_packet(per.offered * per.context) * thinned

    if padded:
        worst = int(torch.argmax(computed * (budget + 1) + real))
        target = _shape(
            cfg,
            stats,
            lengths[plan.packet(worst)],
            computed=int(computed[worst]),
            row=int(lengths[plan.packet(worst)].max()),
            equal=False,
            cap=cap,
        )
    else:
        docs = torch.tensor(packed_lengths(tuple(lengths.tolist()), budget, cfg.data.max_length))
        total = int(docs.sum())
        target = _shape(cfg, stats, docs, computed=total, row=total, equal=False, cap=cap)
    most = int(torch.argmax(kept * (budget + 1) + real.double()))  # most trained anchors, then tokens
    docs = lengths[plan.packet(most)]
    row = int(docs.max()) if padded else int(docs.sum())
    drafter = _shape(cfg, stats, docs, computed=int(computed[most]), row=row, equal=False, cap=cap)
    trained, n_samples = float(kept.mean()), float(sum(sizes)) / len(sizes)
    mean = PacketShape(
        tokens=max(1, round(float(real.double().mean()))),
        num_seqs=max(1, round(n_samples)),
        num_anchors=round(trained),
        loss_rows=round(float(slots.mean())),
        verifier_rows=round(min(float(positions.mean()), float(slots.mean()))),
        target_tokens=round(float(computed.double().mean())),
        target_row_tokens=target.target_row_tokens,
        drafter_context_tokens=target.drafter_context_tokens,
        drafter_blocks=target.drafter_blocks,
        anchor_context=float(context.sum() / kept.sum()) if float(kept.sum()) else target.anchor_context,
    )
    mix = PacketMix(
        num_packets=len(sizes),
        samples=n_samples,
        tokens=float(real.double().mean()),
        offered=float(offers.mean()),
        trained=trained,
        slots=float(slots.mean()),
        largest_offer=int(offers.max()),
        offer_quantiles={q: int(math.ceil(float(offers.quantile(q)))) for q in QUANTILES},
        trained_by_packet=tuple(int(x) for x in kept.floor().tolist()),
    )
    return Packets(target, drafter, mean, mix, source)


def computed_blocks(mix: PacketMix, cap: int | None, chunks: int, skip_empty: bool) -> float:
    """Blocks the drafter computes per packet over the epoch (padding included): the cap's under a
    static shape (``cap`` not None) whose every chunk runs; with ``skip_empty`` each packet's anchors
    rounded up to whole chunks of ``ceil(cap / chunks)`` blocks (at least one chunk); without a static
    shape the anchors themselves."""
    if cap is None:
        return mix.trained
    if not skip_empty or chunks <= 1:
        return float(cap)
    size = -(-cap // chunks)
    rounded = [max(1, -(-n // size)) * size for n in mix.trained_by_packet]
    return sum(rounded) / len(rounded)
