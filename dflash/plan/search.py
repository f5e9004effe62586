"""The planner's objective and its search: the split, the packet size (``data.token_budget``), the
anchor cap (``drafter.max_anchors_per_packet``) and the drafter's sharding that train the most
supervised block slots per second while every role fits.

Why slots, not samples: a drafter learns from supervised block slots (anchors x trained slots),
and the anchors of one sample share its target forward, which is paid once however many of them
the drafter trains. Ranking splits by samples/s makes every cut of the recipe's anchors per sample
(``drafter.num_anchors``; the published tau was measured at 512) look faster, while it throws away
supervision the target already paid for. So a choice is scored by ``packets/s x supervised slots per
packet`` over one epoch of the data plan (:class:`dflash.sizing.packets.PacketMix`), samples/s beside
it. The block chunks and activation checkpointing follow each choice (``auto``: the fewest chunks that
fit, then checkpointing; :func:`dflash.sizing.fit.decide_levers`), so recompute costs what it costs.

Choices within :data:`SIGNAL_TIE` of the best signal are equal; among them the one that keeps the
recipe's anchors wins, then the one that changes the config least (so a re-plan of a shipped
experiment is stable), then more drafters. What the command line sets (``data.token_budget=...``,
``drafter.max_anchors_per_packet=...``, ``drafter.shard=...``) is held: the search varies only what
it does not set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from dflash.config import Config
from dflash.config.modes import mode_of
from dflash.plan.launch import SPLIT_FIELDS, override_key
from dflash.plan.planner import Plan, make_plan
from dflash.plan.throughput import Split
from dflash.sizing.inputs import PlanInputs, with_packets
from dflash.sizing.packets import static_shape

SIGNAL_TIE = 0.02
"""Choices whose training signal per second is within this share of the best are equally good (the
model's MFU figures are not finer than that; the fewest changes then keep a re-plan stable)."""
CUT_TOLERANCE = 0.005
"""A plan keeping fewer than this share below the recipe's anchors per sample counts as a cut."""
ANCHOR_STEP = 64
"""Anchor caps the search tries are multiples of this."""
BUDGET_FACTORS = (0.25, 0.5, 1.0, 2.0)
"""Packet sizes tried: these multiples of the configured ``data.token_budget`` (each at least
``data.max_length``: a packet holds the longest sample)."""
SMALLER_CAPS = 6
"""Below the anchors the packets offer, the search halves the cap this many times (memory-forced cuts)."""
SEARCHED = ("data.token_budget", "drafter.max_anchors_per_packet", "drafter.shard")
"""The config fields the search chooses (unless the command line sets them) beside the split."""
SHARDS = ("none", "optimizer", "full")


@dataclass(frozen=True)
class Choice:
    """One way to run the config: its packet size, anchor cap and sharding (``cfg``), their plan and
    the split it runs."""

    cfg: Config
    plan: Plan
    split: Split
    changes: tuple[str, ...]
    """The overrides that turn the configured config into ``cfg`` (``data.token_budget=16384``, ...)."""

    @property
    def fits(self) -> bool:
        return self.split.fits

    @property
    def signal_per_s(self) -> float:
        """Supervised block slots trained per second."""
        return self.split.packets_per_s * self.plan.slots_per_packet

    @property
    def anchors_per_s(self) -> float:
        return self.split.packets_per_s * self.plan.anchors_per_packet

    @property
    def samples_per_s(self) -> float:
        return self.split.packets_per_s * self.plan.samples_per_packet

    @property
    def anchors_per_sample(self) -> float:
        return self.plan.inputs.packets.mix.trained_per_sample

    @property
    def recipe_per_sample(self) -> float:
        """The anchors per sample ``drafter.num_anchors`` offers on this data (no cap)."""
        return self.plan.inputs.packets.mix.offered_per_sample

    @property
    def cut(self) -> bool:
        """The cap keeps fewer anchors than the recipe offers."""
        return self.plan.inputs.packets.mix.kept < 1 - CUT_TOLERANCE


@dataclass(frozen=True)
class Search:
    """Every choice the search scored, the best one, and the config as given."""

    choices: list[Choice]
    best: Choice
    """The best choice in the config's mode (disaggregated splits, or co-located; one GPU: co-located)."""
    other: Choice | None
    """The best choice in the other mode (None on one GPU)."""
    configured: Choice
    """The config as given, on its own split when it uses the whole world (else its best split)."""
    pinned: frozenset[str]
    """The searched fields the command line set (held)."""
    restore: Choice | None = None
    """The best choice that fits and keeps the recipe's anchors per sample, in the best's mode where
    one does, else in the other (None: none does), from a search without the held
    ``drafter.max_anchors_per_packet`` when that cap cuts them."""

    def best_on(self, label: str) -> Choice | None:
        """The best choice on the split ``label`` (``3:5``, ``2x2:4``, ``co-located x8``), if any."""
        on = [c for c in self.choices if c.split.label == label]
        return _best_of(on) if on else None


def pinned_fields(overrides: Sequence[str]) -> frozenset[str]:
    """The fields of :data:`SEARCHED` that ``overrides`` (the command line) set."""
    keys = {override_key(a) for a in overrides}
    return frozenset(k for k in SEARCHED if k in keys)


def budget_candidates(cfg: Config, pinned: Collection[str]) -> list[int]:
    """The configured ``data.token_budget`` and :data:`BUDGET_FACTORS` of it that hold the longest sample."""
    budget = cfg.data.token_budget
    if "data.token_budget" in pinned:
        return [budget]
    return sorted({b for f in BUDGET_FACTORS if (b := int(budget * f)) >= cfg.data.max_length} | {budget})


def _round_up(n: float) -> int:
    return max(ANCHOR_STEP, -(-int(n) // ANCHOR_STEP) * ANCHOR_STEP)


def cap_candidates(
    cfg: Config, inputs: PlanInputs, pinned: Collection[str], static: bool
) -> list[int | None]:
    """Anchor caps to try for ``cfg``'s packet size: the configured one; the anchors a packet offers at
    the quantiles of the epoch's packets (a static flex shape computes the cap's blocks in every
    packet, so a cap below the largest packet's offer trades its cut against less padding; without a
    static shape no cap at all, which cuts nothing); then halvings below them, for memory."""
    configured = cfg.drafter.max_anchors_per_packet
    if "drafter.max_anchors_per_packet" in pinned:
        return [configured]
    mix = inputs.packets.mix
    caps: set[int | None] = {configured}
    if static:
        caps |= {_round_up(n) for n in mix.offer_quantiles.values()}
    else:
        caps.add(None)
    low = min(mix.offer_quantiles.values())
    caps |= {_round_up(low / 2**k) for k in range(1, SMALLER_CAPS + 1)}
    return sorted(caps, key=lambda c: (c is None, c or 0))


def _with(cfg: Config, **fields: object) -> Config:
    """``cfg`` with ``data.token_budget``, ``drafter.max_anchors_per_packet`` or ``drafter.shard`` set."""
    data: dict[str, Any] = {}
    drafter: dict[str, Any] = {}
    for key, value in fields.items():
        (data if key == "token_budget" else drafter)[key] = value
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, **data),
        drafter=dataclasses.replace(cfg.drafter, **drafter),
    )


def _changes(base: Config, cfg: Config) -> tuple[str, ...]:
    out = []
    if cfg.data.token_budget != base.data.token_budget:
        out.append(f"data.token_budget={cfg.data.token_budget}")
    cap = cfg.drafter.max_anchors_per_packet
    if cap != base.drafter.max_anchors_per_packet:
        out.append(f"drafter.max_anchors_per_packet={'null' if cap is None else cap}")
    if cfg.drafter.shard != base.drafter.shard:
        out.append(f"drafter.shard={cfg.drafter.shard}")
    return tuple(out)


def with_split(cfg: Config, split: Split) -> Config:
    """``cfg`` whose topology runs ``split`` (as the launch line's overrides set it)."""
    colocated = split.mode == "colocated"
    topology = dataclasses.replace(
        cfg.topology,
        mode="colocated" if colocated else "split",
        num_targets=0 if colocated else split.num_targets,
        target_tp=1 if colocated else split.target_tp,
        num_drafters=None if colocated else split.num_drafters,
        drafter_nodes=None,
    )
    assert {f.name for f in dataclasses.fields(topology)} >= set(SPLIT_FIELDS)
    return dataclasses.replace(cfg, topology=topology)


def _splits(plan: Plan) -> list[Split]:
    return [*plan.splits, plan.colocated]


def _recomputes(plan: Plan, split: Split) -> bool:
    """The role of ``split`` that trains the drafter needs more than the plan's chunks to fit:
    activation checkpointing, or it does not fit at all."""
    levers = plan.colocated_levers if split.mode == "colocated" else plan.levers
    return not split.fits or levers.settings.checkpoint


def _choices(cfg: Config, inputs: PlanInputs, base: Config, shards: list[str]) -> list[Choice]:
    """Every split of ``cfg`` (one packet size and cap) with the first of ``shards``, and with each
    of the others where that one recomputes or does not fit (sharding saves memory, nothing else,
    and a sharded step runs every chunk: it cannot win where the first fits without recompute). A
    sharded drafter's state depends on the drafters it is split over, so each split of a sharded
    choice is planned with its own topology."""
    first = _with(cfg, shard=shards[0])
    plan = make_plan(first, inputs)
    out = [Choice(first, plan, s, _changes(base, first)) for s in _splits(plan)]
    needy = [s for s in _splits(plan) if _recomputes(plan, s)]
    for shard in shards[1:]:
        c = _with(cfg, shard=shard)
        for s in needy:
            own = make_plan(with_split(c, s), inputs)
            out.append(Choice(c, own, own.configured or s, _changes(base, c)))
    return out


def search(cfg: Config, inputs: PlanInputs, pinned: Collection[str] = ()) -> Search:
    """Score every packet size, anchor cap, sharding and split of ``cfg`` (module docstring)."""
    pinned = frozenset(pinned)
    static = static_shape(cfg)
    # unsharded first (the configured sharding when the command line sets it), then the others
    shards = [str(cfg.drafter.shard)] if "drafter.shard" in pinned else list(SHARDS)
    choices: list[Choice] = []
    for budget in budget_candidates(cfg, pinned):
        sized = _with(cfg, token_budget=budget)
        sized_inputs = with_packets(sized, inputs)
        for cap in cap_candidates(sized, sized_inputs, pinned, static):
            capped = _with(sized, max_anchors_per_packet=cap)
            choices += _choices(capped, with_packets(capped, sized_inputs), cfg, shards)
    configured_plan = make_plan(cfg, inputs)
    configured_split = (
        configured_plan.configured
        or _best_of([Choice(cfg, configured_plan, s, ()) for s in _splits(configured_plan)]).split
    )
    configured = Choice(cfg, configured_plan, configured_split, ())
    world = configured_plan.world_size
    mode = "colocated" if world == 1 or mode_of(cfg.topology).self_produced else "disaggregated"
    mine = [c for c in choices if c.split.mode == mode]
    others = [c for c in choices if c.split.mode != mode]
    best = _best_of(mine)
    keeping = [c for c in mine if c.fits and not c.cut] or [c for c in choices if c.fits and not c.cut]
    restore = _best_of(keeping) if keeping else None
    held_cap = "drafter.max_anchors_per_packet"
    if best.cut and restore is None and held_cap in pinned:
        restore = search(cfg, inputs, pinned - {held_cap}).restore
    return Search(choices, best, _best_of(others) if others else None, configured, pinned, restore)


def _best_of(choices: list[Choice]) -> Choice:
    """The best of ``choices`` (module docstring): among those that fit (all when none does), the most
    signal per second up to :data:`SIGNAL_TIE`; then no cut, fewest changes, more anchors kept, more drafters, smaller
    tensor-parallel replicas, more signal."""
    fitting = [c for c in choices if c.fits] or choices
    top = max(c.signal_per_s for c in fitting)
    near = [c for c in fitting if c.signal_per_s >= top * (1 - SIGNAL_TIE)]
    return max(
        near,
        key=lambda c: (
            not c.cut,
            -len(c.changes),
            round(c.plan.inputs.packets.mix.kept, 3),
            c.split.num_drafters,
            -c.split.target_tp,
            c.signal_per_s,
        ),
    )
