"""The planner's output: a readable table and the one-line JSON summary that ends it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dflash.config import Config, TargetShape
from dflash.metrics import human_count
from dflash.plan.costs import verifier_positions
from dflash.plan.fit import LEVERS, MAX_AUTO_CHUNKS, AnchorCaps
from dflash.plan.inputs import attention_kinds, typical_packet
from dflash.plan.launch import launch_command
from dflash.plan.links import intranode_link, link_for
from dflash.plan.memory import EVAL_ITEMS, DrafterSettings
from dflash.plan.planner import ROLES, Plan, make_plan
from dflash.plan.throughput import Split, placement
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
    packet = typical_packet(new, plan.inputs.stats)
    target_kind, drafter_kind = attention_kinds(new, packet.num_seqs, plan.inputs.target.meta.model_type)
    inputs = dataclasses.replace(
        plan.inputs, packet=packet, target_attention=target_kind, drafter_attention=drafter_kind
    )
    return make_plan(new, inputs)


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
        need = sum(_replanned(cfg, plan, section, key, step).memory[role].values())
        return (
            f"no {section}.{key} fits ({step} still needs {need:.1f} GiB of {plan.capacity_gib:.1f} per GPU)"
        )
    need = sum(_replanned(cfg, plan, section, key, lo * step).memory[role].values())
    return f"{section}.{key}={lo * step} ({need:.1f} GiB of {plan.capacity_gib:.1f} per GPU)"


def fitting_overrides(cfg: Config, plan: Plan) -> dict[str, str]:
    """For each role that does not fit one GPU: the override that makes it fit with the least
    change to the run (``drafter.max_anchors_per_packet`` for the drafter and the co-located rank,
    whose activations grow with the blocks per packet; ``data.token_budget`` for a target that no
    tensor-parallel replica fits either: the warnings name a replica that does), found by
    replanning, with the GiB it then needs; or why no such value exists."""
    roles = [r for r in (ROLES if plan.world_size > 1 else ("colocated",)) if not plan.fits[r]]
    out = {}
    for role in roles:
        if role == "target":
            if any(ok for k, ok in plan.replica_fits.items() if k > 1):
                continue
            out[role] = _largest_fitting(
                cfg, plan, role, "data", "token_budget", cfg.data.token_budget, BUDGET_STEP
            )
        else:
            top = plan.inputs.packet.drafter_blocks or plan.inputs.packet.num_anchors
            out[role] = _largest_fitting(
                cfg, plan, role, "drafter", "max_anchors_per_packet", top, ANCHOR_STEP
            )
    return out


def summary(plan: Plan, name: str, gpu: str, fixes: dict[str, str] | None = None) -> dict[str, Any]:
    """The JSON summary (the last output line of ``python -m dflash.plan``); ``fixes``: the
    :func:`fitting_overrides` of the roles that do not fit (``fits_with``)."""
    best, co, spp = plan.best, plan.colocated, plan.samples_per_packet
    return {
        "experiment": name,
        "gpu": gpu,
        "world_size": plan.world_size,
        "mode": plan.mode,
        # As topology=colocated reads them: no target-only ranks, a drafter replica on every GPU.
        "num_targets": 0 if best is co else best.num_targets,
        "num_drafters": plan.world_size if best is co else best.num_drafters,
        "target_tp": best.target_tp,
        "expected_packets_per_s": round(best.packets_per_s, 4),
        "expected_samples_per_s": round(best.packets_per_s * spp, 3),
        "colocated_samples_per_s": round(co.packets_per_s * spp, 3) if co.fits else 0.0,
        "configured_samples_per_s": round(plan.configured.packets_per_s * spp, 3)
        if plan.configured
        else None,
        "samples_per_packet": spp,
        "anchors_per_packet": plan.inputs.packet.num_anchors,
        "target_tflop_per_packet": round(plan.costs.target_flop / TERA, 3),
        "drafter_tflop_per_packet": round(plan.costs.drafter_flop / TERA, 3),
        "drafter_loss_tflop_per_packet": round(plan.costs.drafter_loss_total / TERA, 3),
        "hidden_mb_per_packet": round(plan.costs.hidden_bytes / 1e6, 1),
        "link_gbps_busiest_gpu": round(link_gbps(plan, best), 3),
        "link": link_for(plan.inputs.gpu, plan.world_size).kind,
        **{f"link_{k}": round(v, 4) for k, v in link_times(plan).items()},
        "mfu_target": plan.times.mfu_target,
        "mfu_drafter": plan.times.mfu_drafter,
        "mfu_delta_rule": plan.times.mfu_delta_rule,
        "memory_gib": {role: round(sum(plan.memory[role].values()), 2) for role in ROLES},
        "nccl_gib": {role: round(gib, 3) for role, gib in plan.nccl_gib.items()},
        "target_rank_memory_gib": {str(k): round(sum(m.values()), 2) for k, m in plan.replica_memory.items()},
        "activation_checkpointing": plan.settings.checkpoint,
        "block_chunks": plan.settings.block_chunks,
        "fits": dict(plan.fits),
        "fits_with": dict(fixes or {}),
        "warnings": plan.warnings,
    }


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


def _inputs_lines(plan: Plan, name: str) -> list[str]:
    inp, gpu, arch = plan.inputs, plan.inputs.gpu, plan.inputs.arch
    ts = inp.target.meta
    return [
        f"dflash plan: {name} on {plan.world_size} x {gpu.name} ({gpu.bf16_tflops:g} TFLOP/s dense bf16 each)",
        f"  target : {ts.num_layers} layers ({ts.num_linear_layers} linear attention), H {ts.hidden_size}, "
        f"FFN {ts.intermediate_size}, {ts.num_heads}/{ts.num_kv_heads} heads x {ts.head_dim}, V {ts.vocab_size} "
        f"[{inp.target.source}]; attention {inp.target_attention}{_moe_text(ts)}",
        f"  drafter: {arch.num_layers} layers, FFN {arch.intermediate_size}, {arch.num_heads}/{arch.num_kv_heads} "
        f"heads x {arch.head_dim}, {arch.num_taps} taps, block {arch.block_size}; attention {inp.drafter_attention}",
        f"  data   : {inp.stats.mean_sample_tokens:.0f} tokens per sample, {inp.stats.supervised_fraction:.2f} "
        f"supervised [{inp.stats.source}]",
        _link_line(plan),
        "",
    ]


def link_times(plan: Plan) -> dict[str, float]:
    """Seconds one packet takes over the link, and one gradient all-reduce among the drafters of
    the recommended split (the plan's world: within a host, or over the network)."""
    link = link_for(plan.inputs.gpu, plan.world_size)
    m = plan.best.num_drafters
    grads = 4 * plan.times.drafter_params
    return {
        "packet_s": plan.costs.payload_bytes / link.one_way_bytes_per_s,
        "allreduce_s": 2 * (m - 1) / m * grads / link.allreduce_bytes_per_s if m > 1 else 0.0,
    }


def _link_line(plan: Plan) -> str:
    gpu = plan.inputs.gpu
    link = link_for(gpu, plan.world_size)
    t = link_times(plan)
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


def _padding_lines(plan: Plan) -> list[str]:
    padded, pk = plan.inputs.padded, plan.inputs.packet
    if padded is None:
        return []
    waste = 1 - padded.mean_real / padded.mean_computed
    return [
        f"  padded rows (target.pack=false): the data plan's packet of the most target work, {pk.num_seqs} rows x "
        f"{pk.target_row_tokens} = {pk.target_tokens} tokens computed for {pk.tokens} real; over the plan "
        f"{padded.mean_real:,.0f} real and {padded.mean_computed:,.0f} computed tokens per packet ({waste:.1%} "
        f"padding; lengths: {padded.source})"
    ]


def _packet_lines(plan: Plan) -> list[str]:
    inp, c, pk, arch = plan.inputs, plan.costs, plan.inputs.packet, plan.inputs.arch
    return [
        f"Per packet: {pk.num_seqs} samples, {pk.tokens} tokens, {pk.num_anchors} anchors x {arch.block_size} slots, "
        f"{pk.loss_rows} loss rows reading {verifier_positions(pk, arch.block_size)} verifier positions; drafter computes {pk.drafter_context_tokens or pk.tokens} context rows and "
        f"{pk.drafter_blocks if pk.drafter_blocks is not None else pk.num_anchors} blocks",
        *_padding_lines(plan),
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
    gpu = plan.inputs.gpu
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
    ts, link = plan.inputs.target.meta, intranode_link(plan.inputs.gpu)
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


def _split_lines(plan: Plan) -> list[str]:
    lines = [
        f"Splits of {plan.world_size} GPUs: packets/s = min(N / t_target, M / t_drafter, link); NxK:M = N replicas "
        "of K GPUs",
        "  split          packets/s  samples/s  bound      link GB/s (busiest GPU)",
    ]
    for s in [*plan.splits, plan.colocated]:
        marks = [
            m for m, hit in (("recommended", s is plan.best), ("configured", s is plan.configured)) if hit
        ]
        if not s.fits:
            marks.append("does not fit")
        lines.append(
            f"  {s.label:<14} {s.packets_per_s:9.3f} {s.packets_per_s * plan.samples_per_packet:10.2f}  "
            f"{s.bound:<9}  {link_gbps(plan, s):8.2f}   {' '.join(f'<- {m}' for m in marks)}"
        )
    return [*lines, ""]


def override(split: Split) -> str:
    """The command-line overrides that run ``split``."""
    if split.mode == "colocated":
        return "topology=colocated"
    tp = f" topology.target_tp={split.target_tp}" if split.target_tp > 1 else ""
    return f"topology.num_targets={split.num_targets}{tp} topology.num_drafters={split.num_drafters}"


_ROLE_WORDS = {"target": "a target", "drafter": "a drafter", "colocated": "a co-located rank"}


def _verdict_lines(plan: Plan, cfg: Config, overrides: Sequence[str], fixes: dict[str, str]) -> list[str]:
    b, spp = plan.best, plan.samples_per_packet
    fit = [f"To fit {_ROLE_WORDS[role]}: {fix}" for role, fix in fixes.items()]
    gpn = plan.inputs.gpu.gpus_per_node
    command = f"  {launch_command(b, cfg.topology, overrides, plan.world_size, gpn)}"
    anchors = plan.inputs.packet.num_anchors
    if not cfg.data.path:
        command += "  # + data.path=<your data>"
    if b is plan.colocated and not plan.splits:
        return [
            f"One GPU: co-located only (topology=colocated): {b.packets_per_s * spp:.2f} "
            f"samples/s{'' if b.fits else ' (does not fit: see below)'}",
            command,
            *fit,
        ]
    return [
        f"Recommended split: {b.label} ({override(b)}): {b.packets_per_s * spp:.2f} samples/s "
        f"({b.packets_per_s * anchors:,.0f} anchors/s)"
        f"{'' if b.fits else ' (a role does not fit: see below)'}",
        command,
        *(f"  {line}" for line in placement(b, gpn)),
        f"Co-located (topology=colocated, the whole target on every GPU): "
        f"{plan.colocated.packets_per_s * spp:.2f} samples/s ({plan.colocated.packets_per_s * anchors:,.0f} "
        f"anchors/s){'' if plan.colocated.fits else ' (does not fit)'}; "
        f"faster here: {plan.mode}",
        *fit,
    ]


def render(
    plan: Plan, cfg: Config, fixes: dict[str, str] | None = None, overrides: Sequence[str] = ()
) -> str:
    """The table of ``cfg``'s plan: inputs, per-packet FLOPs and bytes, memory per role, the
    tensor-parallel replicas, every split, the verdict with the launch command (``overrides``: the
    command line the plan was asked with, :func:`dflash.plan.launch.launch_command`); ``fixes``
    (:func:`fitting_overrides`): with which value each role that does not fit would."""
    lines = _inputs_lines(plan, cfg.name) + _packet_lines(plan) + _memory_lines(plan) + _tp_lines(plan)
    lines += _split_lines(plan) + _verdict_lines(plan, cfg, overrides, fixes or {})
    lines += [f"WARNING: {w}" for w in plan.warnings]
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
    ``chunks``, ``layers``: :data:`dflash.plan.fit.LEVERS`)."""
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
