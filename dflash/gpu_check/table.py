"""The check's table of results and targets (the header printed before the parts run is ``Check.header``)."""

from __future__ import annotations

from typing import Any

from dflash.gpu_check.profiles import TRAIN_PARTS


def _f(x: Any, fmt: str = "{:.3g}") -> str:
    return "-" if x is None else fmt.format(x)


def render(out: dict[str, Any]) -> str:
    """The table of ``out`` (the summary): a row per part with its figures (and the tail of a failed
    one), the targets, and the verdict."""
    bar = "-" * 100
    name_w = max([10, *(len(p) + 1 for p in out["parts"])])
    indent = " " * (name_w + 9 + 13)
    lines = [bar, f"{'part':<{name_w}}{'status':<9}{'time (s)':<13}figures", bar]
    budgets = out["budget_s"]
    for part, r in out["parts"].items():
        budget = budgets.get(part)
        t = f"{r.get('part_s', 0):g}" + (f"/{budget:g}" if budget else "")
        first, more = _part_lines(part, r)
        lines.append(f"{part:<{name_w}}{r['status']:<9}{t:<13}{first}")
        lines += [indent + m for m in more]
        if r["status"] not in ("passed", "skipped"):
            for m in ([r["error"]] if "error" in r else []) + r.get("errors", []) + r.get("tail", [])[-8:]:
                lines.append(indent + "| " + str(m)[:160])
    lines.append(bar)
    judged = not out["dry_run"]
    lines.append("targets" + ("" if judged else " (performance ones not judged in a dry run)") + ":")
    for name, t in out["targets"].items():
        met = {True: "MET", False: "NOT MET", None: "-"}[t["met"]]
        lines.append(f"  {name:<24}{_f(t['value']):>10}  goal {t['goal']:<42} {met}")
    lines.append(bar)
    verdict = "PASSED" if out["passed"] else "FAILED"
    lines.append(f"gpu check {verdict} in {out['wall_s']:g} s" + (" (dry run)" if out["dry_run"] else ""))
    return "\n".join(lines)


def _part_lines(part: str, r: dict[str, Any]) -> tuple[str, list[str]]:
    """The first line of a part's row and the lines below it."""
    if part == "kernels":
        c = r.get("counts", {})
        first = f"pytest -m gpu: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped, {c.get('errors', 0)} errors"
        more = [f"hybrid targets: {r['linear_attention']}"] if "linear_attention" in r else []
        return first + (f" ({r['note']})" if "note" in r else ""), more + r.get("failed_tests", [])
    if part == "loss":
        more = [
            f"{'case':<15}{'terms':<7}{'chunk':>6}{'time s':>9}{'peak GB':>9}{'TFLOP/s':>9}{'of peak':>9}"
            f"{'t/naive':>9}{'m/naive':>9}{'t/limit':>9}{'t/lce':>8}"
        ]
        for c in r.get("cases", []):
            if "error" in c:
                more.append(
                    f"{c['case']:<15}{c.get('terms') or '':<7}{_f(c['chunk'], '{}'):>6}  "
                    + ("OOM" if c.get("oom") else "ERROR " + c["error"][:60])
                )
                continue
            more.append(
                f"{c['case']:<15}{c['terms']:<7}{_f(c['chunk'], '{}'):>6}{_f(c['time_s'], '{:.4f}'):>9}"
                f"{_f(c['peak_extra_gb'], '{:.3f}'):>9}{_f(c.get('tflops'), '{:.1f}'):>9}{_f(c.get('peak_frac'), '{:.3f}'):>9}"
                f"{_f(c.get('time_vs_naive'), '{:.3f}'):>9}{_f(c.get('mem_vs_naive'), '{:.3f}'):>9}"
                f"{_f(c.get('time_vs_limit'), '{:.3f}'):>9}{_f(c.get('time_vs_torch_lce'), '{:.3f}'):>8}"
            )
        more += [f"baseline not measured: {e[:140]}" for e in r.get("baseline_errors", [])]
        best = r.get("best_chunked") or {}
        first = f"loss bench ({r.get('args', '')})"
        if best:
            first = (
                f"chunked CE+KL best: chunk {best['chunk']}, {_f(best.get('tflops'), '{:.1f}')} TFLOP/s = {_f(best.get('peak_frac'), '{:.3f}')} of peak; "
                + first
            )
        return first, more
    if part in TRAIN_PARTS:
        if r.get("status") == "skipped":
            return r.get("note", ""), []
        more = [r["anchors"]] if "anchors" in r else []
        more += _extra_lines(part, r)
        probe = r.get("target_probe")
        if probe and "headless" in probe:
            h, f = probe["headless"], probe["full"]
            more.append(
                f"target probe ({probe['tokens']} tokens, {probe['dtype']}, {probe.get('attention', '?')} attention): weights {probe['weights_gib']:.2f} GiB; headless forward "
                f"+{h['extra_gib']:.2f} GiB (planner {probe['planner_activations_gib']:.2f}), largest tensor "
                f"{h['largest_tensor']['shape']}, vocab-sized tensors {h['vocab_tensors']}; model(...) +{f['extra_gib']:.2f} GiB, "
                f"vocab-sized {f['vocab_tensors']} (logits {probe['logits_gib']:.2f} GiB)"
            )
        if "steady_steps" in r:
            s = r.get("split_s", {})
            more.append(
                f"{r['steps']}/{r['steps_requested']} steps (steady {r['steady_steps']}): {_f(r['samples_per_s'])} samples/s, "
                f"{_f(r['tokens_per_s'], '{:.0f}')} tokens/s, step {_f(r['step_s'])} s, first step {_f(r['first_step_s'])} s "
                f"(compile ~{_f(r['compile_s'])} s, {r.get('recompiles', 0)} recompiles"
                + (", RECOMPILE LIMIT HIT: eager fallback" if r.get("recompile_limit_hit") else "")
                + ")"
            )
            more.append(
                "split (s): "
                + ", ".join(f"{k.removesuffix('_s')} {_f(v)}" for k, v in s.items())
                + f"; busy {r.get('busy', {})}"
            )
            p = r.get("planner") or {}
            if p:
                flop = _f(p["target_tflop_per_packet"])
                if "target_rank_tflop_per_packet" in p:  # a TP replica: one rank's share
                    flop = f"{_f(p['target_rank_tflop_per_packet'])} per rank of {flop}"
                more.append(
                    f"MFU (planner FLOP / measured s / {p['gpu_spec']} peak): target {_f(p['target_mfu'])} "
                    f"({flop} TFLOP/packet in {_f(r['target_s_per_packet'])} s), drafter "
                    f"{_f(p['drafter_mfu'])} ({_f(p['drafter_tflop_per_packet'])} TFLOP in {_f(r['drafter_s_per_packet'])} s); "
                    f"planner at {p['planner_s_per_packet']['mfu']:g} MFU: {_f(p['planner_samples_per_s'])} samples/s"
                )
                more.append(
                    f"peak memory GiB: {r.get('peak_mem_gib_by_role')}; planner {p['memory_gib']}, capacity {p['capacity_gib']}"
                )
                if "allreduce_s" in p:
                    reduce = (r.get("phases_s") or {}).get("reduce")
                    more.append(
                        f"gradient reduction per step: measured {_f(reduce)} s; planner's all-reduce "
                        f"{_f(p['allreduce_s'])} s on {p['link']}"
                    )
        return f"{r.get('mode', '')} ({r.get('backend', '')}), {r.get('wall_s', '-')} s wall" + (
            f"; {r['note']}" if "note" in r else ""
        ), more
    return "", []


def _extra_lines(part: str, r: dict[str, Any]) -> list[str]:
    """What a training part checks beyond the steady-state figures: the GPUs it ran on, the kernels,
    the replica check, the stop and the resume."""
    if part == "split" and "gpus" in r:
        return [f"on {r['gpus']}"]
    if part == "hybrid":
        return [
            f"target {r.get('target', '?')} ({r.get('target_model', '?')})",
            f"linear attention ran: {r.get('linear_attention') or 'NOT REPORTED'}",
        ]
    if part == "allreduce" and "replicas" in r:
        return [f"drafter replicas {r['replicas']}"]
    if part == "sigterm" and "signalled_after_s" in r:
        lines = [
            f"SIGTERM to torchrun's process group at step {r['signal_at_step']} ({r['signalled_after_s']} s): "
            f"stopped at step {_f(r.get('stopped_at_step'), '{}')} of {r['steps_requested']} in {r['stopped_in_s']} s, "
            f"checkpoint {_f(r.get('checkpoint_gib'), '{:.3g}')} GiB saved in {_f(r.get('save_s'))} s, "
            f"torchrun exit {r['torchrun_exit']}"
        ]
        if "resume_exit" in r:
            lines.append(
                f"relaunch: resumed at step {_f(r.get('resumed_at_step'), '{}')}, exit {r['resume_exit']} in "
                f"{r['resume_wall_s']} s; ledger steps {r.get('ledger_steps')}; W&B offline runs {r.get('wandb')}"
            )
        return lines
    return []
