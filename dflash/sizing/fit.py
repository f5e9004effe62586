"""What fits a GPU: the planner's memory levers of a config, ``drafter.activation_checkpointing=auto``
decided before start-up, and the largest anchors per packet that fit.

Every answer comes from the memory model (:mod:`dflash.sizing.memory`) on the config's typical packet
(:mod:`dflash.sizing.packets`), against a capacity in GiB: a GPU's memory minus
``plan.reserved_gib`` (what tensors cannot use: the CUDA context, NCCL buffers, allocator slack).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.config import Config, GpuSpec
from dflash.config.modes import layout_of, mode_of
from dflash.sizing.inputs import PlanInputs, with_packets
from dflash.sizing.memory import GIB, DrafterSettings, eval_decode_bytes, eval_memory, memory_per_role
from dflash.sizing.packets import computed_blocks

DRAFTER_ROLES = ("drafter", "colocated")


def num_drafters(cfg: Config, world_size: int) -> int:
    """Drafter ranks of ``cfg`` on ``world_size`` GPUs of one host (the mode's layout; every rank
    when co-located)."""
    layout = layout_of(cfg.topology, world_size, world_size)
    return max(1, min(layout.num_drafters, world_size))


def drafter_role(cfg: Config) -> str:
    """The role whose memory the drafter's levers decide: ``colocated`` (a drafter that makes its
    own packets holds the target too) or ``drafter``."""
    return "colocated" if mode_of(cfg.topology).self_produced else "drafter"


def need_gib(cfg: Config, inputs: PlanInputs, role: str, settings: DrafterSettings) -> float:
    """GiB per GPU of ``role`` with ``settings`` on the config's typical packet (the memory model)."""
    return sum(role_memory(cfg, inputs, settings)[role].values())


def role_memory(cfg: Config, inputs: PlanInputs, settings: DrafterSettings) -> dict[str, dict[str, float]]:
    """GiB by item of every role with ``settings`` on the config's typical packet (the memory model;
    the optimizer's state is ``optim.name``'s; with ``eval.every > 0`` the periodic eval's items,
    :func:`dflash.sizing.memory.eval_memory`)."""
    settings = dataclasses.replace(settings, optimizer=str(cfg.optim.name))
    memory = memory_per_role(
        inputs.target.meta,
        inputs.arch,
        inputs.packets.target,
        target_attention=inputs.target_attention,
        max_in_flight=cfg.topology.max_in_flight,
        loss_chunk_rows=inputs.loss_chunk_rows,
        verifier_logits=inputs.verifier_logits,
        dtypes=inputs.dtypes,
        settings=settings,
        drafter_packet=inputs.packets.drafter,
    )
    if cfg.eval.every > 0:
        tokens = cfg.data.max_length + cfg.eval.max_new_tokens + inputs.arch.block_size
        decode = eval_decode_bytes(inputs.target.meta, tokens, inputs.dtypes.target_bytes)
        memory["drafter"] = eval_memory(memory["drafter"], memory["target"]["weights"], decode)
        memory["colocated"] = eval_memory(memory["colocated"], 0.0, decode)  # verifies with its own target
    return memory


@dataclass(frozen=True)
class CheckpointDecision:
    """``drafter.activation_checkpointing`` resolved for one GPU, with why (one log line)."""

    checkpoint: bool
    without_gib: float
    """The role's estimated GiB per GPU without checkpointing."""
    with_gib: float
    capacity_gib: float
    setting: str

    @property
    def reason(self) -> str:
        gib = f"{self.without_gib:.1f} GiB without, {self.with_gib:.1f} GiB with, {self.capacity_gib:.1f} GiB available"
        if self.setting != "auto":
            return f"drafter.activation_checkpointing={self.setting} ({gib})"
        verdict = (
            "on: the drafter does not fit without it"
            if self.checkpoint
            else "off: the drafter fits without it"
        )
        return f"drafter.activation_checkpointing=auto: {verdict} ({gib})"


MAX_AUTO_CHUNKS = 64
"""The most chunks ``drafter.block_chunks=null`` (auto) tries."""


@dataclass(frozen=True)
class ChunkDecision:
    """``drafter.block_chunks`` resolved for one GPU, with why (one log line)."""

    chunks: int
    need_gib: float
    """The role's estimated GiB per GPU with these chunks and no checkpointing."""
    capacity_gib: float
    setting: int | None
    fitting: int = 0
    """The fewest chunks that fit (auto); :attr:`chunks` is more when padding asked for them."""
    padding: float = 0.0
    """The share of the blocks computed per packet that are a static shape's padding."""

    @property
    def reason(self) -> str:
        gib = (
            f"{self.need_gib:.1f} GiB without activation checkpointing, {self.capacity_gib:.1f} GiB available"
        )
        if self.setting is not None:
            return f"drafter.block_chunks={self.setting} ({gib})"
        if self.need_gib > self.capacity_gib:
            return f"drafter.block_chunks=null (auto): 1, no count up to {MAX_AUTO_CHUNKS} fits without checkpointing ({gib} at 1)"
        if self.chunks > self.fitting:
            return (
                f"drafter.block_chunks=null (auto): {self.chunks}; {self.fitting} fit without checkpointing, "
                f"more leave less padding ({self.padding:.0%} of the blocks computed: a chunk without an anchor "
                f"is skipped) ({gib})"
            )
        return f"drafter.block_chunks=null (auto): {self.chunks}, the fewest that fit without checkpointing ({gib})"


PADDING_SHARE = 0.1
"""Auto block chunks of a replicated drafter under a static shape: more than the fewest that fit
until at most this share of the blocks it computes per packet is padding (its chunks without an
anchor are skipped: :attr:`dflash.drafter.step.StepPlan.skip_empty_chunks`)."""


def padding_share(inputs: PlanInputs, cap: int | None, chunks: int, skip_empty: bool) -> float:
    """The share of the drafter's computed blocks per packet that are padding (0 without a static shape)."""
    if cap is None or inputs.packets.mean.drafter_blocks is None:
        return 0.0
    mix = inputs.packets.mix
    computed = computed_blocks(mix, cap, chunks, skip_empty)
    return max(0.0, 1 - mix.trained / computed) if computed else 0.0


def decide_block_chunks(
    cfg: Config, inputs: PlanInputs, capacity_gib: float, *, world_size: int, role: str | None = None
) -> ChunkDecision:
    """A set ``drafter.block_chunks`` as it is; auto (None): the fewest chunks (up to
    :data:`MAX_AUTO_CHUNKS`, at most one block each) with which the role fits ``capacity_gib`` without
    activation checkpointing, or 1 when none does (checkpointing then decides) or when
    ``drafter.activation_checkpointing=layers`` asks for recompute."""
    role = role or drafter_role(cfg)
    base = DrafterSettings(False, cfg.drafter.shard, num_drafters(cfg, world_size))

    def need(chunks: int) -> float:
        return need_gib(cfg, inputs, role, dataclasses.replace(base, block_chunks=chunks))

    setting = cfg.drafter.block_chunks
    if setting is not None:
        return ChunkDecision(setting, need(setting), capacity_gib, setting)
    if cfg.drafter.activation_checkpointing == "layers" or not math.isfinite(capacity_gib):
        return ChunkDecision(1, need(1), capacity_gib, None)
    most = max(1, min(MAX_AUTO_CHUNKS, inputs.packets.drafter.num_anchors))
    fitting = _fewest_fitting(need, capacity_gib, most)
    if fitting is None:
        return ChunkDecision(1, need(1), capacity_gib, None, 1)
    cap, skip = cfg.drafter.max_anchors_per_packet, not base.sharded
    chunks, share = fitting, padding_share(inputs, cap, fitting, skip)
    for n in range(fitting + 1, most + 1) if share > PADDING_SHARE else ():
        if (pad := padding_share(inputs, cap, n, skip)) < share:
            chunks, share = n, pad
        if share <= PADDING_SHARE:
            break
    return ChunkDecision(chunks, need(chunks), capacity_gib, None, fitting, share)


def _fewest_fitting(need: Callable[[int], float], capacity_gib: float, most: int) -> int | None:
    """The fewest chunks in ``1..most`` whose ``need`` fits ``capacity_gib``, or None. From 2 chunks on
    the need falls as the chunks grow (one chunk's activations; the context's keys and values kept for
    every chunk are the same), so that range is bisected."""
    if need(1) <= capacity_gib:
        return 1
    if most < 2 or need(most) > capacity_gib:
        return None
    lo, hi = 2, most  # need(hi) fits
    while lo < hi:
        mid = (lo + hi) // 2
        if need(mid) <= capacity_gib:
            hi = mid
        else:
            lo = mid + 1
    return lo


def decide_checkpointing(
    cfg: Config,
    inputs: PlanInputs,
    capacity_gib: float,
    *,
    world_size: int,
    role: str | None = None,
    block_chunks: int = 1,
) -> CheckpointDecision:
    """``layers`` -> on, ``none`` -> off, ``auto`` -> on exactly when the role (default: the config's drafter
    role) needs more than ``capacity_gib`` without checkpointing (its blocks in ``block_chunks``)."""
    role = role or drafter_role(cfg)
    base = DrafterSettings(False, cfg.drafter.shard, num_drafters(cfg, world_size), block_chunks=block_chunks)
    without = need_gib(cfg, inputs, role, base)
    with_ = need_gib(cfg, inputs, role, dataclasses.replace(base, checkpoint=True))
    setting = cfg.drafter.activation_checkpointing
    on = setting == "layers" or (setting == "auto" and without > capacity_gib)
    return CheckpointDecision(on, without, with_, capacity_gib, setting)


@dataclass(frozen=True)
class LeverDecisions:
    """A drafter role's memory levers resolved for one GPU, with why."""

    chunking: ChunkDecision
    checkpointing: CheckpointDecision
    settings: DrafterSettings


def decide_levers(
    cfg: Config, inputs: PlanInputs, capacity_gib: float, world_size: int, role: str | None = None
) -> LeverDecisions:
    """``drafter.block_chunks`` then ``drafter.activation_checkpointing`` of ``role`` (default the
    config's drafter role) on ``world_size`` GPUs of ``capacity_gib`` (auto resolved)."""
    chunking = decide_block_chunks(cfg, inputs, capacity_gib, world_size=world_size, role=role)
    checkpointing = decide_checkpointing(
        cfg, inputs, capacity_gib, world_size=world_size, role=role, block_chunks=chunking.chunks
    )
    settings = DrafterSettings(
        checkpointing.checkpoint,
        cfg.drafter.shard,
        num_drafters(cfg, world_size),
        block_chunks=chunking.chunks,
    )
    return LeverDecisions(chunking, checkpointing, settings)


def with_anchor_cap(cfg: Config, inputs: PlanInputs, cap: int) -> tuple[Config, PlanInputs]:
    """``cfg`` and its planner inputs with ``drafter.max_anchors_per_packet=cap``."""
    new = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, max_anchors_per_packet=cap))
    return new, with_packets(new, inputs)


def largest_anchors(
    cfg: Config, inputs: PlanInputs, capacity_gib: float, role: str, settings: DrafterSettings, step: int = 64
) -> int:
    """The largest ``drafter.max_anchors_per_packet`` (a multiple of ``step``, up to the anchors the
    packet offers) at which ``role`` fits ``capacity_gib`` with ``settings``; 0 when none does."""
    offered = inputs.packets.mix.largest_offer
    lo, hi = 0, max(1, -(-offered // step))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        c, i = with_anchor_cap(cfg, inputs, mid * step)
        if need_gib(c, i, role, settings) <= capacity_gib:
            lo = mid
        else:
            hi = mid - 1
    return min(lo * step, offered)


LEVERS = [(lever, shard) for lever in ("none", "chunks", "layers") for shard in ("none", "optimizer", "full")]
"""``(lever, drafter.shard)`` pairs :func:`anchor_caps` tries; the lever is nothing, the blocks in
:data:`MAX_AUTO_CHUNKS` chunks (what ``drafter.block_chunks=null`` (auto) can reach) or per-layer activation
checkpointing (``drafter.activation_checkpointing=layers``)."""


def lever_settings(lever: str, shard: str, num_drafters: int) -> DrafterSettings:
    """The :class:`DrafterSettings` of one of :data:`LEVERS`."""
    chunks = MAX_AUTO_CHUNKS if lever == "chunks" else 1
    return DrafterSettings(lever == "layers", shard, num_drafters, block_chunks=chunks)


@dataclass(frozen=True)
class AnchorCaps:
    """The largest ``drafter.max_anchors_per_packet`` that fits one GPU, by role and lever."""

    capacity_gib: float
    offered: int
    """The most anchors a packet offers at ``drafter.num_anchors`` per sample (the recipe's density)."""
    ranks: dict[str, int]
    """Ranks a sharded state is split over: the config's drafters, or every GPU co-located."""
    caps: dict[str, dict[tuple[str, str], int]]
    """``caps[role][(lever, shard)]`` for ``role`` in :data:`DRAFTER_ROLES`; 0: none fits."""


def anchor_caps(cfg: Config, inputs: PlanInputs, capacity_gib: float, world_size: int) -> AnchorCaps:
    """:class:`AnchorCaps` of ``cfg`` on ``world_size`` GPUs of ``capacity_gib`` for each of
    :data:`LEVERS` (the memory model on the typical packet, via :func:`largest_anchors`)."""
    ranks = {"drafter": num_drafters(cfg, world_size), "colocated": world_size}
    caps = {
        role: {
            (lever, shard): largest_anchors(cfg, inputs, capacity_gib, role, lever_settings(lever, shard, n))
            for lever, shard in LEVERS
        }
        for role, n in ranks.items()
    }
    return AnchorCaps(capacity_gib, inputs.packets.mix.largest_offer, ranks, caps)


def gpu_capacity_gib(gpu: GpuSpec, reserved_gib: float) -> float:
    """What tensors may use on a GPU of the table (``gpu.hbm_gb``, decimal GB): GiB minus ``reserved_gib``."""
    return gpu.hbm_gb * 1e9 / GIB - reserved_gib


def device_capacity_gib(device: torch.device, reserved_gib: float) -> float:
    """What tensors may use on ``device``: its memory minus ``reserved_gib`` (``plan.reserved_gib``);
    unbounded on a CPU."""
    if device.type != "cuda":
        return float("inf")
    return torch.cuda.get_device_properties(device).total_memory / GIB - reserved_gib
