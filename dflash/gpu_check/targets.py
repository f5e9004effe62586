"""The check's "good" figures (docs/gpu-check.md) judged from the parts' results."""

from __future__ import annotations

from typing import Any

LOSS_GOAL, DRAFTER_MFU_GOAL = 0.60, 0.40


def judged_targets(results: dict[str, dict[str, Any]], judged: bool) -> dict[str, dict[str, Any]]:
    """Each target with what it measures, its goal, its value and whether it was met. The performance
    ones are judged only when ``judged`` (a GPU run; ``met`` null in a dry run); no logits in the
    target's forward is judged everywhere."""
    b, c = results.get("loss", {}), results.get("colocated", {})
    out: dict[str, dict[str, Any]] = {}
    best = b.get("best_chunked")
    value = best.get("peak_frac") if best else None
    out["loss_bf16_peak_frac"] = {
        "what": "chunked CE+KL loss, best chunk: useful TFLOP/s / dense bf16 peak",
        "goal": f">= {LOSS_GOAL}",
        "value": value,
        "met": (value is not None and value >= LOSS_GOAL) if judged else None,
    }
    mfu = (c.get("planner") or {}).get("drafter_mfu")
    out["drafter_mfu"] = {
        "what": "co-located drafter step: planner FLOP per packet / measured s per packet / bf16 peak",
        "goal": f">= {DRAFTER_MFU_GOAL}",
        "value": mfu,
        "met": (mfu is not None and mfu >= DRAFTER_MFU_GOAL) if judged else None,
    }
    probe = c.get("target_probe") or {}
    head = probe.get("headless") or {}
    vocab_gib = None
    if head:
        vocab_gib = 0.0 if head["vocab_tensors"] == 0 else probe["logits_gib"] * head["vocab_tensors"]
    out["target_logits_gib"] = {
        "what": "GiB of vocabulary-sized tensors the target's headless forward makes (model(...) makes "
        "one [tokens x vocab] logits tensor)",
        "goal": "0",
        "value": vocab_gib,
        "met": vocab_gib == 0.0 if head else False,
    }
    planner = c.get("planner") or {}
    peak = (c.get("peak_mem_gib_by_role") or {}).get("colocated")
    cap = planner.get("capacity_gib")
    out["colocated_memory_fits"] = {
        "what": "peak memory of the co-located rank (target + drafter) at the experiment's settings",
        "goal": f"<= {cap} GiB (HBM minus plan.reserved_gib)" if cap else "fits",
        "value": peak,
        "met": (peak is not None and cap is not None and peak <= cap) if judged else None,
    }
    return out
