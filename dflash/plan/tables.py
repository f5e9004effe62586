"""The planner's output: a readable table and the one-line JSON summary that ends it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dflash.config import Config, TargetShape
from dflash.metrics import human_count
from dflash.plan.launch import launch_command
from dflash.plan.links import intranode_link, link_for
from dflash.plan.planner import ROLES, Plan, computed_mean_packet, make_plan
from dflash.plan.search import Choice, Search
from dflash.plan.throughput import Split, placement
from dflash.sizing.costs import verifier_positions
from dflash.sizing.fit import LEVERS, MAX_AUTO_CHUNKS, AnchorCaps, LeverDecisions
from dflash.sizing.inputs import with_packets
from dflash.sizing.memory import EVAL_ITEMS, DrafterSettings
from dflash.targets.families import active_params, num_params

if TYPE_CHECKING:  # the rehearsal imports torch; the plain planner does not
    from dflash.plan.rehearse import RoleMeasurement

TERA = 1e12


def link_gbps(plan: Plan, split: Split) -> float:
    """GB/s through the busiest GPU's link at the split's packet rate: each drafter receives
    ``rate / M`` packets/s, each target sends ``rate / N``."""
    if split.mode == "colocated":
        return 0.0
    busiest = min(split.num_targets, split.num_drafters)
    return split.packets_per_s / busiest * plan.costs.payload_bytes / 1e9


ANCHOR_STEP = 64
"""``drafter.max_anchors_per_packet`` values tried by :func:`fitting_overrides`: multiples of this."""
BUDGET_STEP = 1024
"""``data.token_budget`` values tried by :func:`fitting_overrides`: multiples of this."""


def _replanned(cfg: Config, plan: Plan, section: str, key: str, value: int) -> Plan:
    """The plan of ``cfg`` with ``<section>.<key>=value`` (the packet re-derived from the same data statistics)."""
    new = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})})
    return make_plan(new, with_packets(new, plan.inputs))


def _largest_fitting(cfg: Config, plan: Plan, role: str, section: str, key: str, top: int, step: int) -> str:
    """``<section>.<key>=<v>``, v the largest multiple of ``step`` below ``top`` with which ``role``
    fits (memory grows with v), with the GiB it then needs; or why none does."""
    lo, hi = 0, max(1, top // step)  # invariant: lo fits (0: none known), hi * step does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _replanned(cfg, plan, section, key, mid * step).fits[role]:
            lo = mid
        else:
            hi = mid
    if lo == 0:
        items = _replanned(cfg, plan, section, key, step).memory[role]
        need, copy = sum(items.values()), items.get("eval_target", 0.0)
        why = (
            f"; {copy:.1f} GiB of it is the periodic eval's copy of the target (eval.every={cfg.eval.every}): "
            "set eval.every=0 and evaluate the export with dflash.eval where the target fits"
            if copy > 0
            else ""
        )
        return f"no {section}.{key} fits ({step} still needs {need:.1f} GiB of {plan.capacity_gib:.1f} per GPU{why})"
    need = sum(_replanned(cfg, plan, section, key, lo * step).memory[role].values())
    return f"{section}.{key}={lo * step} ({need:.1f} GiB of {plan.capacity_gib:.1f} per GPU)"


def fitting_overrides(cfg: Config, plan: Plan, mode: str | None = None) -> dict[str, str]:
    """For each role that does not fit one GPU: the override that makes it fit with the least
    change to the run (``drafter.max_anchors_per_packet`` for the drafter and the co-located rank,
    whose activations grow with the blocks per packet; ``data.token_budget`` for a target that no
    tensor-parallel replica fits either: the warnings name a replica that does), found by
    replanning, with the GiB it then needs; or why no such value exists. ``mode``: only the roles it
    runs (``disaggregated``: target and drafter; ``colocated``); None: every role."""
    modes = {"disaggregated": ("target", "drafter"), "colocated": ("colocated",), None: ROLES}
    roles = [r for r in (modes[mode] if plan.world_size > 1 else ("colocated",)) if not plan.fits[r]]
    out = {}
    for role in roles:
        if role == "target":
            if any(ok for k, ok in plan.replica_fits.items() if k > 1):
                continue
            out[role] = _largest_fitting(
                cfg, plan, role, "data", "token_budget", cfg.data.token_budget, BUDGET_STEP
            )
        else:
            drafter = plan.inputs.packets.drafter
            top = drafter.drafter_blocks or drafter.num_anchors
            out[role] = _largest_fitting(
                cfg, plan, role, "drafter", "max_anchors_per_packet", top, ANCHOR_STEP
            )
    return out


DEFAULT_NUM_SAMPLES = 800_000
"""Samples per epoch without a prepared dataset or ``plan.num_samples``: the scale the published
DFlash drafters were trained at (about 800K samples, 6 epochs)."""


def epoch_samples(cfg: Config, plan: Plan) -> tuple[int, str]:
    """Samples of one epoch and where the figure comes from."""
    if cfg.plan.num_samples is not None:
        return cfg.plan.num_samples, "plan.num_samples"
    if plan.inputs.stats.num_samples is not None:
        return plan.inputs.stats.num_samples, "the prepared dataset"
    return DEFAULT_NUM_SAMPLES, "plan.num_samples default"


def epoch_hours(cfg: Config, choice: Choice) -> dict[str, float]:
    """Hours of one epoch and of the config's ``data.num_epochs``, and GPU-hours of those, at ``choice``."""
    samples, _ = epoch_samples(cfg, choice.plan)
    rate = choice.samples_per_s
    epoch = samples / rate / 3600 if rate > 0 else math.inf
    run = epoch * cfg.data.num_epochs
    return {"epoch_hours": epoch, "run_hours": run, "gpu_hours": run * choice.split.world_size}


def summary(found: Search, cfg: Config, fixes: dict[str, str] | None = None) -> dict[str, Any]:
    """The JSON summary (the last output line of ``python -m dflash.plan``) of the search's
    recommendation; ``fixes``: the :func:`fitting_overrides` of the configured run's roles that do not
    fit (``fits_with``, beside ``configured_fits``)."""
    best, plan = found.best, found.best.plan
    split, mix = best.split, plan.inputs.packets.mix
    co = [c for c in (found.best, found.other) if c is not None and c.split.mode == "colocated"]
    faster = max(
        (c for c in (found.best, found.other) if c is not None and c.fits), key=_signal, default=best
    )
    samples, source = epoch_samples(cfg, plan)
    return {
        "experiment": cfg.name,
        "gpu": cfg.plan.gpu,
        "world_size": plan.world_size,
        "mode": faster.split.mode,
        # As topology=colocated reads them: no target-only ranks, a drafter replica on every GPU.
        "num_targets": 0 if split.mode == "colocated" else split.num_targets,
        "num_drafters": plan.world_size if split.mode == "colocated" else split.num_drafters,
        "target_tp": split.target_tp,
        "recommended": best.fits,
        "changes": list(best.changes),
        "token_budget": best.cfg.data.token_budget,
        "max_anchors_per_packet": best.cfg.drafter.max_anchors_per_packet,
        "shard": str(best.cfg.drafter.shard),
        "expected_packets_per_s": round(split.packets_per_s, 4),
        "expected_samples_per_s": round(best.samples_per_s, 3),
        "expected_anchors_per_s": round(best.anchors_per_s, 1),
        "expected_slots_per_s": round(best.signal_per_s, 1),
        "anchors_per_sample": round(best.anchors_per_sample, 2),
        "recipe_anchors_per_sample": round(best.recipe_per_sample, 2),
        "anchors_cut": best.cut,
        "colocated_samples_per_s": round(co[0].samples_per_s, 3) if co and co[0].fits else 0.0,
        "configured_samples_per_s": round(found.configured.samples_per_s, 3),
        "configured_anchors_per_s": round(found.configured.anchors_per_s, 1),
        "configured_anchors_per_sample": round(found.configured.anchors_per_sample, 2),
        "num_samples": samples,
        "num_samples_source": source,
        "num_epochs": cfg.data.num_epochs,
        **{k: round(v, 2) for k, v in epoch_hours(cfg, best).items()},
        "samples_per_packet": round(plan.samples_per_packet, 2),
        "anchors_per_packet": round(mix.trained, 1),
        "slots_per_packet": round(mix.slots, 1),
        "samples_per_step": round(plan.samples_per_packet * _packets_per_step(best), 1),
        "target_tflop_per_packet": round(plan.costs.target_flop / TERA, 3),
        "drafter_tflop_per_packet": round(plan.costs.drafter_flop / TERA, 3),
        "drafter_loss_tflop_per_packet": round(plan.costs.drafter_loss_total / TERA, 3),
        "hidden_mb_per_packet": round(plan.costs.hidden_bytes / 1e6, 1),
        "link_gbps_busiest_gpu": round(link_gbps(plan, split), 3),
        "link": link_for(plan.gpu, plan.world_size).kind,
        **{f"link_{k}": round(v, 4) for k, v in link_times(plan, split).items()},
        "mfu_target": plan.times.mfu_target,
        "mfu_drafter": plan.times.mfu_drafter,
        "mfu_delta_rule": plan.times.mfu_delta_rule,
        "memory_gib": {role: round(sum(plan.memory[role].values()), 2) for role in ROLES},
        "nccl_gib": {role: round(gib, 3) for role, gib in plan.nccl_gib.items()},
        "target_rank_memory_gib": {str(k): round(sum(m.values()), 2) for k, m in plan.replica_memory.items()},
        "activation_checkpointing": _levers(best).settings.checkpoint,
        "block_chunks": _levers(best).settings.block_chunks,
        "fits": dict(plan.fits),
        "configured_fits": dict(found.configured.plan.fits),
        "fits_with": dict(fixes or {}),
        "warnings": plan.warnings_for(split.mode),
    }


def _signal(choice: Choice) -> float:
    return choice.signal_per_s


def _levers(choice: Choice) -> LeverDecisions:
    """The memory levers of the role that trains the drafter on ``choice``'s split."""
    return choice.plan.colocated_levers if choice.split.mode == "colocated" else choice.plan.levers


def _lever_words(choice: Choice) -> str:
    """The memory levers ``choice`` runs with, in words (``34 block chunks, no recompute``)."""
    settings = _levers(choice).settings
    chunks = f"{settings.block_chunks} block chunk{'s' * (settings.block_chunks != 1)}"
    return f"{chunks}, {'activation checkpointing' if settings.checkpoint else 'no recompute'}"


def _packets_per_step(choice: Choice) -> int:
    """Packets one optimizer step takes: every drafter's ``optim.grad_accum_steps``."""
    return choice.split.num_drafters * choice.cfg.optim.grad_accum_steps


def _tf(x: float) -> str:
    return f"{x / TERA:10.2f}"


def _moe_text(ts: TargetShape) -> str:
    if not ts.num_experts:
        return ""
    shared = (
        f" + a shared expert of {ts.shared_expert_intermediate_size}"
        if ts.shared_expert_intermediate_size
        else ""
    )
    return (
        f"\n           MoE: {ts.num_experts} experts of FFN {ts.moe_intermediate_size}, {ts.num_experts_per_tok} per token"
        f"{shared}; {human_count(num_params(ts))} parameters, {human_count(active_params(ts))} "
        "active per token in the decoder layers"
    )


def _inputs_lines(plan: Plan, name: str, split: Split) -> list[str]:
    inp, gpu, arch = plan.inputs, plan.gpu, plan.inputs.arch
    ts = inp.target.meta
    return [
        f"dflash plan: {name} on {plan.world_size} x {gpu.name} ({gpu.bf16_tflops:g} TFLOP/s dense bf16 each)",
        f"  target : {ts.num_layers} layers ({ts.num_linear_layers} linear attention), H {ts.hidden_size}, "
        f"FFN {ts.intermediate_size}, {ts.num_heads}/{ts.num_kv_heads} heads x {ts.head_dim}, V {ts.vocab_size} "
        f"[{inp.target.source}]; attention {inp.target_attention}{_moe_text(ts)}",
        f"  drafter: {arch.num_layers} layers, FFN {arch.intermediate_size}, {arch.num_heads}/{arch.num_kv_heads} "
        f"heads x {arch.head_dim}, {arch.num_taps} taps, block {arch.block_size}; attention {inp.drafter_attention}",
        f"  data   : {inp.stats.mean_sample_tokens:.0f} tokens per sample, {inp.stats.supervised_fraction:.2f} "
        f"supervised [{inp.stats.source}]; packets laid out from {inp.packets.lengths}",
        _link_line(plan, split),
        "",
    ]


def link_times(plan: Plan, split: Split) -> dict[str, float]:
    """Seconds one packet takes over the link, and one gradient all-reduce among the drafters of
    ``split`` (the plan's world: within a host, or over the network)."""
    link = link_for(plan.gpu, plan.world_size)
    m = split.num_drafters
    grads = 4 * plan.times.drafter_params
    return {
        "packet_s": plan.costs.payload_bytes / link.one_way_bytes_per_s,
        "allreduce_s": 2 * (m - 1) / m * grads / link.allreduce_bytes_per_s if m > 1 else 0.0,
    }


def _link_line(plan: Plan, split: Split) -> str:
    link = link_for(plan.gpu, plan.world_size)
    t = link_times(plan, split)
    return (
        f"  link   : {link.kind}, {link.one_way_bytes_per_s / 1e9:g} GB/s one way, all-reduce "
        f"{link.allreduce_bytes_per_s / 1e9:g} GB/s bus; a packet {t['packet_s']:.3f} s, the drafters' "
        f"all-reduce {t['allreduce_s']:.3f} s per step [{plan.inputs.gpu_source or 'plan.gpu'}]"
    )


def _delta_rule_text(plan: Plan) -> str:
    delta = plan.costs.target_flop_by_part.get("delta_rule", 0.0)
    if not delta:
        return ""
    return (
        f"; the target's delta rule, {_tf(delta).strip()} TFLOP of it, at MFU {plan.times.mfu_delta_rule:g}"
    )


def _modelled_lines(plan: Plan) -> list[str]:
    """The packets the memory model takes when they differ from the mean one (:mod:`dflash.sizing.packets`)."""
    packets = plan.inputs.packets
    if packets.target is packets.mean:
        return []
    t, d = packets.target, packets.drafter
    rows = "padded rows (target.pack=false)" if t.target_row_tokens != t.target_tokens else "a packed row"
    waste = 1 - packets.mean.tokens / (packets.mean.target_tokens or packets.mean.tokens)
    return [
        f"  memory of the packet of the most target work ({rows}): {t.num_seqs} samples, {t.target_tokens} tokens "
        f"computed for {t.tokens} real (rows of {t.target_row_tokens}); of the most trained anchors: "
        f"{d.num_seqs} samples, {d.tokens} tokens, {d.num_anchors} anchors",
        f"  over the plan's {packets.mix.num_packets} packets: {packets.mean.tokens:,} real and "
        f"{packets.mean.target_tokens:,} computed tokens per packet ({waste:.1%} padding); anchors offered per "
        "packet at the quantiles 50/75/90/100%: "
        + " / ".join(f"{packets.mix.offer_quantiles[q]:,}" for q in sorted(packets.mix.offer_quantiles)),
    ]


def _packet_lines(plan: Plan) -> list[str]:
    inp, c, mix, arch = plan.inputs, plan.costs, plan.inputs.packets.mix, plan.inputs.arch
    mean = computed_mean_packet(inp, plan.settings)
    blocks = mean.drafter_blocks if mean.drafter_blocks is not None else mean.num_anchors
    return [
        f"Per packet (the mean of one epoch's): {mix.samples:.1f} samples, {mix.tokens:,.0f} tokens, "
        f"{mix.trained:,.0f} anchors x {arch.block_size} slots ({mix.trained_per_sample:.0f} per sample of the "
        f"recipe's {mix.offered_per_sample:.0f}), {mix.slots:,.0f} supervised slots (loss rows) reading {verifier_positions(mean, arch.block_size):,} "
        f"verifier positions; the drafter computes {mean.drafter_context_tokens or mean.tokens} context rows and "
        f"{blocks} blocks",
        *_modelled_lines(plan),
        "  role     what                                      TFLOP",
        f"  target   forward, headless (no lm_head)       {_tf(c.target_flop)}",
        f"             of which attention                 {_tf(c.target_attention_flop)}",
        f"  drafter  fc + layers, forward + backward      {_tf(c.drafter_layers_flop)}",
        f"             of which attention                 {_tf(c.drafter_attention_flop)}",
        f"           loss: drafter logits                 {_tf(c.drafter_loss_flop['drafter_logits'])}",
        f"           loss: logit gradient (dh = G W)      {_tf(c.drafter_loss_flop['logit_grad'])}",
        f"           loss: verifier logits, per position  {_tf(c.drafter_loss_flop['verifier_logits'])}",
        *(
            [
                f"           loss: candidate logits (DFlash2)     {_tf(c.drafter_loss_flop['candidate_logits'])}",
                f"           loss: selector (DFlash2)             {_tf(c.drafter_loss_flop['selector'])}",
            ]
            if c.drafter_loss_flop["candidate_logits"]
            else []
        ),
        f"           total                                {_tf(c.drafter_flop)}",
        f"  drafter/target FLOP ratio {c.drafter_flop / c.target_flop:.2f}; on the wire {c.hidden_bytes / 1e6:.1f} MB "
        f"of hidden states ({arch.num_taps} taps + final, {inp.dtypes.target_bytes} bytes each), "
        f"{c.payload_bytes / 1e6:.1f} MB in all",
        f"  one GPU per packet: target {plan.times.target_s:.3f} s, drafter {plan.times.drafter_s:.3f} s "
        f"(t = FLOP / (peak x MFU), MFU target {plan.times.mfu_target:g}, drafter {plan.times.mfu_drafter:g}"
        f"{_delta_rule_text(plan)})",
        "",
    ]


def _memory_lines(plan: Plan) -> list[str]:
    gpu = plan.gpu
    lines = [
        f"Memory per GPU, GiB (capacity {plan.capacity_gib:.1f}: {gpu.hbm_gb:g} GB minus reserved)",
        f"  {plan.chunking.reason}",
        f"  {plan.checkpointing.reason}; drafter.shard={plan.settings.shard} "
        f"({plan.settings.num_drafters} drafter{'s' if plan.settings.num_drafters > 1 else ''})",
    ]
    co = plan.colocated_levers
    if co.settings != plan.settings:
        lines.append(f"  co-located rank: {co.chunking.reason}; {co.checkpointing.reason}")
    rows = [(role, plan.memory[role], plan.fits[role]) for role in ROLES]
    rows[1:1] = [(f"target/{k}", plan.replica_memory[k], plan.replica_fits[k]) for k in plan.layouts]
    for role, items, fits in rows:
        text = ", ".join(f"{k} {v:.1f}" for k, v in items.items())
        verdict = "FITS" if fits else "DOES NOT FIT"
        lines.append(f"  {role:<9} {sum(items.values()):7.1f}  {verdict:<12}  ({text})")
    if plan.layouts:
        lines.append("  (target/k: one rank of a tensor-parallel replica of k GPUs)")
    split = plan.configured or plan.best
    nccl = ", ".join(f"{role} {gib:.2f}" for role, gib in plan.nccl_gib.items())
    reserved = gpu.hbm_gb * 1e9 / 2**30 - plan.capacity_gib
    lines.append(
        f"  NCCL buffers, estimated for {split.label} over {link_for(gpu, plan.world_size).kind}: {nccl} GiB per "
        f"rank, inside plan.reserved_gib={reserved:.1f}"
    )
    return [*lines, ""]


def _tp_lines(plan: Plan) -> list[str]:
    """The interconnect each tensor-parallel degree needs: bytes per packet per layer and per packet."""
    if not plan.layouts:
        return []
    ts, link = plan.inputs.target.meta, intranode_link(plan.gpu)
    parts = {k: ", ".join(sorted(layout.parts)) for k, layout in plan.layouts.items()}
    width = max(len("split parts (the rest on every rank)"), *(len(p) for p in parts.values()))
    lines = [
        f"Tensor-parallel replicas (one node each; {link.kind} {link.one_way_bytes_per_s / 1e9:g} GB/s one way "
        f"per GPU): t = rank FLOP / (peak x MFU) + sent / {link.kind}",
        f"  k   {'split parts (the rest on every rank)':<{width}} experts  sent per layer MB  per packet GB   t s",
    ]
    for k, layout in plan.layouts.items():
        total = sum(plan.tp_bytes_per_packet[k].values())
        lines.append(
            f"  {k:<3} {parts[k]:<{width}} {layout.experts:<8} {total / ts.num_layers / 1e6:17.1f} "
            f"{total / 1e9:13.2f} {plan.times.replica_s[k]:6.3f}"
        )
    return [*lines, ""]


def _split_lines(plan: Plan, recommended: Split) -> list[str]:
    """Every split of the recommended packet size and levers (its packets, anchors and slots per packet)."""
    spp, app, slots = plan.samples_per_packet, plan.anchors_per_packet, plan.slots_per_packet
    lines = [
        f"Splits of {plan.world_size} GPUs at these packets: packets/s = min(N / t_target, M / t_drafter, link); "
        "NxK:M = N replicas of K GPUs; slots/s = supervised block slots per second (the training signal)",
        "  split          packets/s  samples/s  anchors/s    slots/s  bound      link GB/s (busiest GPU)",
    ]
    for s in [*plan.splits, plan.colocated]:
        marks = [
            m
            for m, hit in (
                ("recommended", s.label == recommended.label),
                ("configured", s is plan.configured),
            )
            if hit
        ]
        if not s.fits:
            marks.append("does not fit")
        lines.append(
            f"  {s.label:<14} {s.packets_per_s:9.3f} {s.packets_per_s * spp:10.2f} {s.packets_per_s * app:10,.0f} "
            f"{s.packets_per_s * slots:10,.0f}  {s.bound:<9}  {link_gbps(plan, s):8.2f}   "
            f"{' '.join(f'<- {m}' for m in marks)}"
        )
    return [*lines, ""]


CHOICE_ROWS = 8
"""Rows of the search's table: the best choices by signal (and the configured one)."""


def _choice_text(c: Choice) -> str:
    levers = _levers(c).settings
    lever = f"{levers.block_chunks} chunk{'s' if levers.block_chunks > 1 else ''}" + (
        ", checkpointed" if levers.checkpoint else ""
    )
    cap = c.cfg.drafter.max_anchors_per_packet
    return (
        f"  {c.cfg.data.token_budget:>7} {'null' if cap is None else cap:>7} {str(c.cfg.drafter.shard):<9} "
        f"{lever:<17} {c.split.label:<14} {c.samples_per_s:9.2f} {c.anchors_per_sample:7.0f}/{c.recipe_per_sample:<5.0f} "
        f"{c.anchors_per_s:10,.0f} {c.signal_per_s:11,.0f}"
    )


def _choice_lines(found: Search) -> list[str]:
    """The best split of each packet size, anchor cap and sharding the search tried (the best first)."""
    best_of: dict[tuple, Choice] = {}
    for c in found.choices:
        if c.split.mode != found.best.split.mode or not c.fits:
            continue
        key = (c.cfg.data.token_budget, c.cfg.drafter.max_anchors_per_packet, str(c.cfg.drafter.shard))
        if key not in best_of or c.signal_per_s > best_of[key].signal_per_s:
            best_of[key] = c
    ranked = sorted(best_of.values(), key=_signal, reverse=True)[:CHOICE_ROWS]
    held = f"; held as given: {', '.join(sorted(found.pinned))}" if found.pinned else ""
    lines = [
        f"Packet sizes, anchor caps and sharding (each at its best split; levers auto; slots/s = supervised "
        f"block slots per second, what the recommendation maximises{held}):",
        "   budget     cap shard     levers            split          samples/s anchors/sample  anchors/s     slots/s",
    ]
    for c in ranked:
        mark = (
            "  <- recommended" if c.cfg == found.best.cfg and c.split.label == found.best.split.label else ""
        )
        lines.append(_choice_text(c) + mark)
    if found.configured.cfg not in [c.cfg for c in ranked]:
        lines.append(_choice_text(found.configured) + "  <- configured")
    return [*lines, ""]


def override(split: Split) -> str:
    """The command-line overrides that run ``split``."""
    if split.mode == "colocated":
        return "topology=colocated"
    tp = f" topology.target_tp={split.target_tp}" if split.target_tp > 1 else ""
    return f"topology.num_targets={split.num_targets}{tp} topology.num_drafters={split.num_drafters}"


_ROLE_WORDS = {"target": "a target", "drafter": "a drafter", "colocated": "a co-located rank"}


def _rates(c: Choice) -> str:
    return (
        f"{c.signal_per_s:,.0f} supervised slots/s = {c.anchors_per_s:,.0f} anchors/s ({c.anchors_per_sample:.0f} per "
        f"sample of the recipe's {c.recipe_per_sample:.0f}), {c.samples_per_s:.2f} samples/s"
    )


def anchors_lines(found: Search, cfg: Config) -> list[str]:
    """Anchors per sample trained against the recipe's, and, when the recommendation cuts them, why and
    what restores them at what cost."""
    best = found.best
    lines = [
        f"Anchors per sample: {best.anchors_per_sample:.0f} trained of the recipe's {best.recipe_per_sample:.0f} "
        f"(drafter.num_anchors={cfg.drafter.num_anchors}, fewer in samples with fewer eligible positions; on "
        f"{best.plan.inputs.packets.lengths})"
    ]
    if not best.cut:
        return lines
    cap = best.cfg.drafter.max_anchors_per_packet
    keep = found.restore
    copy = best.plan.memory["drafter"].get("eval_target", 0.0) if best.split.mode != "colocated" else 0.0
    if "drafter.max_anchors_per_packet" in found.pinned:
        why = f"drafter.max_anchors_per_packet={cap} as asked"
    elif keep is None or keep.split.mode != best.split.mode:
        mode = "co-located" if best.split.mode == "colocated" else "disaggregated"
        why = f"memory: no packet size and lever fits the recipe's anchors {mode} on {best.plan.gpu.name}"
        if copy > 0:
            why += (
                f", {copy:.1f} GiB of each drafter being the periodic eval's copy of the target "
                f"(eval.every={cfg.eval.every}; eval.every=0 frees it)"
            )
    else:
        why = (
            f"drafter.max_anchors_per_packet={cap} trains more per second than the recipe's cap (padding every "
            "packet to the largest packet's anchors costs more than the cut)"
        )
    where = f"{keep.split.label}, topology=colocated" if keep and keep.split.mode != best.split.mode else ""
    restore = (
        f"{' '.join(keep.changes) or 'the configured packets'} on {where or keep.split.label} ({_lever_words(keep)}) trains "
        f"them all at {keep.anchors_per_s:,.0f} anchors/s ({keep.signal_per_s / best.signal_per_s:.2f}x the signal, "
        f"{keep.samples_per_s / best.samples_per_s:.2f}x the samples/s)"
        if keep is not None
        else "a GPU with more memory, or fewer anchors per sample (drafter.num_anchors), restores the recipe"
    )
    lines.append(
        f"  NOTE: the recommendation trains {best.anchors_per_sample:.0f} anchors per sample, not the recipe's "
        f"{best.recipe_per_sample:.0f} ({why}); {restore}"
    )
    return lines


def _verdict_lines(found: Search, cfg: Config, overrides: Sequence[str], fixes: dict[str, str]) -> list[str]:
    best, plan = found.best, found.best.plan
    b = best.split
    fit = [f"To fit {_ROLE_WORDS[role]} as configured: {fix}" for role, fix in fixes.items()]
    gpn = plan.gpu.gpus_per_node
    command = f"  {launch_command(b, cfg.topology, overrides, plan.world_size, gpn, best.changes)}"
    if not cfg.data.path:
        command += "  # + data.path=<your data>"
    hours = epoch_hours(cfg, best)
    samples, source = epoch_samples(cfg, plan)
    epoch = (
        f"One epoch of {samples:,} samples ({source}): {hours['epoch_hours']:.1f} h; data.num_epochs="
        f"{cfg.data.num_epochs}: {hours['run_hours']:.1f} h = {hours['gpu_hours']:,.0f} GPU-hours"
    )
    changed = f" with {' '.join(best.changes)}" if best.changes else ""
    head = (
        f"One GPU: co-located only (topology=colocated){changed}"
        if not plan.splits
        else f"Recommended: {b.label}{changed} ({override(b)})"
    )
    if best.fits:
        lines = [
            f"{head}: {_rates(best)}",
            command,
            *(f"  {line}" for line in placement(b, gpn)),
            *anchors_lines(found, cfg),
            epoch,
        ]
    else:  # no launch line to paste: it would run out of memory
        lines = [
            f"Nothing fits {plan.world_size} x {plan.gpu.name} (nearest: {b.label}{changed}, {_rates(best)}): "
            "no split is recommended; see the memory per role above and the fixes below"
        ]
    conf = found.configured
    if conf.cfg != best.cfg or conf.split.label != b.label:
        gain = best.signal_per_s / conf.signal_per_s if conf.signal_per_s > 0 else math.inf
        lines.append(
            f"As configured ({conf.split.label}, data.token_budget={cfg.data.token_budget}, "
            f"drafter.max_anchors_per_packet={cfg.drafter.max_anchors_per_packet}): {_rates(conf)}"
            f"{'' if conf.fits else ' (does not fit)'}; the recommendation trains {gain:.2f}x its signal"
        )
    if found.other is not None:
        o = found.other
        words = (
            "Co-located (topology=colocated, the whole target on every GPU)"
            if o.split.mode == "colocated"
            else f"Disaggregated ({o.split.label})"
        )
        changes = f" with {' '.join(o.changes)}" if o.changes else ""
        faster = o.split.mode if o.fits and o.signal_per_s > best.signal_per_s else b.mode
        lines.append(
            f"{words}{changes}: {_rates(o)}{'' if o.fits else ' (does not fit)'}; faster here: {faster}"
        )
    return [*lines, *fit]


def render(
    found: Search, cfg: Config, fixes: dict[str, str] | None = None, overrides: Sequence[str] = ()
) -> str:
    """The table of ``cfg``'s plan at the search's recommendation: inputs, per-packet FLOPs and bytes,
    memory per role, the tensor-parallel replicas, every split, the packet sizes and caps tried, the
    verdict with the launch command (``overrides``: the command line the plan was asked with,
    :func:`dflash.plan.launch.launch_command`); ``fixes`` (:func:`fitting_overrides`): with which
    value each role that does not fit would."""
    plan = found.best.plan
    lines = _inputs_lines(plan, cfg.name, found.best.split) + _packet_lines(plan) + _memory_lines(plan)
    lines += _tp_lines(plan) + _split_lines(plan, found.best.split) + _choice_lines(found)
    lines += _verdict_lines(found, cfg, overrides, fixes or {})
    lines += [f"WARNING: {w}" for w in plan.warnings_for(found.best.split.mode)]
    return "\n".join(lines)


def measured_summary(plan: Plan, measured: dict[str, RoleMeasurement]) -> dict[str, Any]:
    """The JSON keys of a rehearsal: measured and estimated GiB per role (same keys)."""
    return {
        "measured_gib": {role: round(m.peak_gib, 3) for role, m in measured.items()},
        "estimated_gib": {role: round(_rehearsed_estimate(plan, role), 3) for role in measured},
    }


def _rehearsed_estimate(plan: Plan, role: str) -> float:
    """The estimated GiB of what the rehearsal runs: ``role``'s items but the periodic eval's."""
    return sum(v for k, v in plan.memory[role].items() if k not in EVAL_ITEMS)


def render_anchor_caps(caps: AnchorCaps) -> str:
    """The largest anchors per packet that fit one GPU, per role and memory lever (:func:`anchor_caps`)."""
    lines = [
        f"Largest drafter.max_anchors_per_packet that fits {caps.capacity_gib:.1f} GiB per GPU (multiples "
        f"of 64; the packet offers {caps.offered} at drafter.num_anchors per sample; a sharded state is "
        f"split over {caps.ranks['drafter']} drafters, or {caps.ranks['colocated']} co-located ranks)",
        f"  {'lever':<40} {'shard':<10} {'drafter':>8} {'colocated':>10}",
    ]
    for lever, shard in LEVERS:
        d, c = caps.caps["drafter"][(lever, shard)], caps.caps["colocated"][(lever, shard)]
        lines.append(f"  {LEVER_TEXT[lever]:<40} {shard:<10} {d:>8} {c:>10}")
    return "\n".join(lines)


LEVER_TEXT = {
    "none": "none",
    "chunks": f"drafter.block_chunks={MAX_AUTO_CHUNKS}",
    "layers": "drafter.activation_checkpointing=layers",
}


def anchor_caps_summary(caps: AnchorCaps) -> dict[str, dict[str, int]]:
    """The JSON key ``largest_anchors``: ``{role: {"<lever>/<shard>": anchors}}`` (levers ``none``,
    ``chunks``, ``layers``: :data:`dflash.sizing.fit.LEVERS`)."""
    return {
        role: {f"{lever}/{shard}": n for (lever, shard), n in by.items()} for role, by in caps.caps.items()
    }


def _levers_text(settings: DrafterSettings) -> str:
    ckpt = "with" if settings.checkpoint else "without"
    chunks = settings.block_chunks
    return f"{ckpt} activation checkpointing, the blocks in {chunks} chunk{'s' if chunks > 1 else ''}"


def render_measured(plan: Plan, measured: dict[str, RoleMeasurement], top: int = 10) -> str:
    """Measured beside estimated GiB per role and item, the largest tensors at each peak, the limits."""
    from dflash.plan.rehearse import LIMITS, measured_items

    lines = [
        "Rehearsed at real size (one step per role on CPU fake tensors, GPU code paths, the drafter roles "
        f"with their levers: drafter {_levers_text(plan.settings)}, co-located "
        f"{_levers_text(plan.colocated_levers.settings)}), GiB measured / estimated:"
    ]
    for role, m in measured.items():
        est = {k: v for k, v in plan.memory[role].items() if k not in EVAL_ITEMS}
        total = _rehearsed_estimate(plan, role)
        items = measured_items(role, m.by_term)
        keys = list(est) + [k for k in items if k not in est]
        parts = ", ".join(f"{k} {items.get(k, 0.0):.2f}/{est.get(k, 0.0):.2f}" for k in keys)
        lines.append(
            f"  {role:<9} {m.peak_gib:7.2f} / {total:7.2f} ({(total / m.peak_gib - 1) * 100:+.1f}%, "
            f"{m.seconds:.0f} s)  {parts}"
        )
    for role, m in measured.items():
        lines.append(f"  largest tensors live at the {role} peak:")
        lines += [f"    {a.nbytes / 2**30:6.3f} GiB {a.term:<15} {a.what}" for a in m.largest[:top]]
        lines += [f"    NOTE: {n}" for n in m.notes]
    lines.append(
        f"  {LIMITS}; add them to the measured figure ({plan.capacity_gib:.1f} GiB is after reserving them)"
    )
    return "\n".join(lines)
