"""One optimizer step's statistics: summed over micro-batches and drafters, turned into metrics.

A drafter adds each packet's objective sums (``ObjectiveOutput``) and its own counters (tokens,
sequences, wait and compute times, non-finite samples, stop flags) into ``StepSums``; the trainer
sums the flat vector over the drafters (one all-reduce) and the per-target figures with a max
(``target_forward_s`` summed, ``target_peak_gib`` maxed, per target rank). ``step_metrics`` then
gives every ``train/``, ``perf/``, ``comm/`` and ``mem/`` value of the step, the same on every
drafter.

Busy fractions: a drafter is busy while it is not blocked on a packet (``1 - wait / step``); the
targets are busy for the summed forward time of the step's packets over ``num_targets x step``
(a co-located rank spends that time on its own device: ``perf/target_frac`` of its step). Targets
work ahead of the drafters (``topology.max_in_flight``), so one step's target fraction can exceed 1;
its mean over many steps cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash.drafter.objective import SELECTOR_SUMS, ObjectiveOutput
from dflash.loss.terms import TERMS

OBJECTIVE_SUMS: dict[str, int] = {
    "weight_sum": 1,
    "base_weight_sum": 1,
    "loss_sum": 1,
    "slot_count": 0,
    "slot_hit": 0,
    "slot_hit_verifier": 0,
    "tau_sum": 1,
    "tau_verifier_sum": 1,
    "inv_tau_sum": 1,
    "inv_tau_verifier_sum": 1,
    "num_blocks": 1,
    "term_sums": len(TERMS),
    "selector_sums": len(SELECTOR_SUMS),
}
"""ObjectiveOutput fields summed per step: name -> length (0: the block size)."""
COUNTERS = (
    "tokens",
    "seqs",
    "stop",
    "wait_s",
    "target_s",
    "busy_s",
    "wall_s",
    "nonfinite_loss",
    "nonfinite_samples",
    "oom_samples",
    "oom_splits",
    "target_flop",
    "drafter_flop",
    "anchors_offered",
    "packets_cut",
)
"""Per-drafter counters summed per step (``stop``: stop requests seen; ``target_s``: the forward
time of the step's packets; ``wall_s``: the drafter's own step time up to the reduction; ``busy_s``: ``wall_s`` minus its
waits; the ``*_frac`` metrics divide by the summed ``wall_s``, so drafters that start a step at
different moments never share more than all of it; ``*_flop``:
the cost model (``dflash.sizing.packet_costs``) of the step's packets; ``anchors_offered``:
what ``drafter.num_anchors`` per document offers before ``drafter.max_anchors_per_packet``;
``packets_cut``: the packets that cap took anchors from;
``oom_splits`` / ``oom_samples``: the target forwards split after running out of memory, and the
samples dropped because one alone did not fit)."""


@dataclass
class StepSums:
    """Sums of one step on one drafter (before the all-reduce).

    The objective sums and the non-finite loss count accumulate on ``device`` (no host sync per
    packet); the host counters are host floats; ``flat()`` joins them once per step."""

    block_size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    objective: dict[str, torch.Tensor] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    nonfinite_loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    """0-dim float64 on ``device``: packets whose loss was not finite (``counters`` after ``load``)."""

    def __post_init__(self) -> None:
        self.objective = {
            k: torch.zeros(n or self.block_size, dtype=torch.float64, device=self.device)
            for k, n in OBJECTIVE_SUMS.items()
        }
        self.counters = dict.fromkeys(COUNTERS, 0.0)
        self.nonfinite_loss = torch.zeros((), dtype=torch.float64, device=self.device)

    def add(self, out: ObjectiveOutput) -> None:
        for k in OBJECTIVE_SUMS:
            self.objective[k] += getattr(out, k).detach().double().reshape(-1)

    def count_nonfinite(self, loss: torch.Tensor) -> None:
        """Count ``loss`` if it is not finite (on the device: the step's reduction reads it)."""
        self.nonfinite_loss += (~torch.isfinite(loss.detach())).double()

    def flat(self) -> torch.Tensor:
        """float64 [all objective sums..., counters...] on ``device`` (the all-reduce payload)."""
        counters = torch.tensor([self.counters[k] for k in COUNTERS], dtype=torch.float64).to(self.device)
        counters[COUNTERS.index("nonfinite_loss")] += self.nonfinite_loss
        return torch.cat([self.objective[k] for k in OBJECTIVE_SUMS] + [counters])

    def load(self, flat: torch.Tensor) -> None:
        """Replace the sums by an all-reduced ``flat()`` (on the host)."""
        self.nonfinite_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        offset = 0
        for k in OBJECTIVE_SUMS:
            n = self.objective[k].numel()
            self.objective[k] = flat[offset : offset + n].clone()
            offset += n
        self.counters = dict(zip(COUNTERS, flat[offset:].tolist(), strict=True))


def step_metrics(
    s: StepSums,
    *,
    step: int,
    step_s: float,
    lr: float,
    grad_norm: float,
    loss_weights: dict[str, float],
    num_targets: int,
    num_drafters: int,
    self_produced: bool,
) -> dict[str, float]:
    """Every per-step metric from the all-reduced sums (the same on every drafter)."""
    o, c = s.objective, s.counters
    w, supervised, blocks = float(o["weight_sum"]), float(o["slot_count"].sum()), float(o["num_blocks"])
    step_s = max(step_s, 1e-9)
    m: dict[str, float] = {
        "train/step": float(step),
        "train/loss": _ratio(float(o["loss_sum"]), w),
        "train/acc": _ratio(float(o["slot_hit"].sum()), supervised),
        "train/acc_verifier": _ratio(float(o["slot_hit_verifier"].sum()), supervised),
        "train/tau_hat": _ratio(blocks, float(o["inv_tau_verifier_sum"])),
        "train/tau_hat_arith": _ratio(float(o["tau_verifier_sum"]), blocks),
        "train/tau_hat_data": _ratio(blocks, float(o["inv_tau_sum"])),
        "train/lr": lr,
        "train/grad_norm": grad_norm,
        "train/num_blocks": float(o["num_blocks"]),
        "train/anchors_per_sample": _ratio(blocks, c["seqs"]),
        "train/anchors_offered_per_sample": _ratio(c["anchors_offered"], c["seqs"]),
        "train/packets_cut": c["packets_cut"],
        "train/supervised_slots": float(o["slot_count"].sum()),
        "train/slot_weight_mean": _ratio(w, supervised),
        "perf/step_s": step_s,
        "perf/tokens_per_s": c["tokens"] / step_s,
        "perf/samples_per_s": c["seqs"] / step_s,
        "perf/anchors_per_s": blocks / step_s,
        "perf/slots_per_s": supervised / step_s,
        "comm/recv_wait_s": c["wait_s"] / num_drafters,
        "comm/recv_wait_frac": _ratio(c["wait_s"], c["wall_s"]),
        "perf/drafter_busy_frac": _ratio(c["busy_s"], c["wall_s"]),
        "perf/tflops/target": c["target_flop"] / max(c["target_s"], 1e-9) / 1e12,
        "perf/tflops/drafter": c["drafter_flop"] / max(c["busy_s"], 1e-9) / 1e12,
    }
    if self_produced:  # co-located: the rank's own target forward, a share of its step
        m["perf/target_frac"] = _ratio(c["target_s"], c["wall_s"])
    else:
        m["perf/target_busy_frac"] = c["target_s"] / (num_targets * step_s)
    for i, term in enumerate(TERMS):
        if loss_weights.get(term.name, 0.0) > 0 or float(o["term_sums"][i]) != 0.0:
            m[term.metric] = _ratio(float(o["term_sums"][i]), float(o["base_weight_sum"]))
    m.update(selector_metrics(o["selector_sums"], blocks))
    for k in range(1, s.block_size):
        count = float(o["slot_count"][k])
        m[f"train/acc_slot_{k}"] = _ratio(float(o["slot_hit"][k]), count)
        m[f"train/acc_verifier_slot_{k}"] = _ratio(float(o["slot_hit_verifier"][k]), count)
    return m


def selector_metrics(sums: torch.Tensor, blocks: float, prefix: str = "train") -> dict[str, float]:
    """DFlash2's selector metrics from the summed ``selector_sums`` (none for DFlash-1): recall@k
    (the label among the top-k), the teacher-forced accuracy, the selector loss per unit of its
    weight and ``tau_hat_unary`` (the argmax decode of the same logits; ``tau_hat`` is the chain's)."""
    v = dict(zip(SELECTOR_SUMS, sums.tolist(), strict=True))
    if v["rows"] <= 0:
        return {}
    return {
        f"{prefix}/selector_recall": v["recall"] / v["rows"],
        f"{prefix}/selector_acc": v["hit"] / v["rows"],
        f"{prefix}/loss_selector": _ratio(v["loss"], v["weight"]),
        f"{prefix}/tau_hat_unary": _ratio(blocks, v["inv_tau_unary"]),
    }


def _ratio(num: float, den: float) -> float:
    """``num / den``, NaN when there is nothing to average over (a step that trained on nothing)."""
    return num / den if den > 0 else float("nan")
