"""``python -m dflash.plan``: how to use a world of GPUs for a training config.

    python -m dflash.plan experiment=qwen3_8b_8gpu plan.world_size=8 plan.gpu=h200
    python -m dflash.plan experiment=qwen3_6_27b_8gpu plan.gpu=h100 plan.mfu_drafter=0.3
    python -m dflash.plan experiment=qwen3_8b_8gpu plan.world_size=1 plan.gpu=h100   # one GPU: co-located
    python -m dflash.plan experiment=qwen3_8b_8gpu plan.measure=true   # + each role rehearsed at real size

The training config and its overrides (``conf/plan_app.yaml`` composes ``conf/config.yaml``) plus
``plan.*``. Prints the table of :mod:`dflash.plan.tables` and ends with one JSON line. Needs no
GPU and no network, builds nothing and writes nothing; ``data.path`` may stay unset. A bad value
is one short message (exit status 2), as in every dflash app. ``plan.measure=true`` also runs each
role's step at real size on CPU fake tensors (:mod:`dflash.plan.rehearse`, a minute or two) and
adds ``measured_gib`` and ``estimated_gib`` to the JSON line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dflash.config import Config, PlanConfig, register_configs, to_config
from dflash.config.checks import raise_problems
from dflash.plan.gpus import gpu_problems, resolve_inputs
from dflash.plan.search import pinned_fields, search
from dflash.plan.tables import (
    anchor_caps_summary,
    fitting_overrides,
    measured_summary,
    render,
    render_anchor_caps,
    render_measured,
    summary,
)
from dflash.sizing.fit import anchor_caps
from dflash.sizing.inputs import DEFAULT_MEAN_SAMPLE_TOKENS

register_configs()


def plan_problems(p: PlanConfig) -> list[str]:
    """Every invalid ``plan.*`` value, each with the override that fixes it."""
    checks = [
        (
            p.world_size >= 1,
            f"plan.world_size={p.world_size}: need at least 1 GPU; e.g. plan.world_size=8",
        ),
        (
            0 < p.mfu_target <= 1,
            f"plan.mfu_target={p.mfu_target}: must be in (0, 1]; e.g. plan.mfu_target=0.4",
        ),
        (
            0 < p.mfu_drafter <= 1,
            f"plan.mfu_drafter={p.mfu_drafter}: must be in (0, 1]; e.g. plan.mfu_drafter=0.4",
        ),
        (
            0 < p.mfu_delta_rule <= 1,
            f"plan.mfu_delta_rule={p.mfu_delta_rule}: must be in (0, 1]; e.g. plan.mfu_delta_rule=0.2",
        ),
        (
            p.mean_sample_tokens is None or p.mean_sample_tokens >= 2,
            f"plan.mean_sample_tokens={p.mean_sample_tokens}: must be >= 2 or null",
        ),
        (
            p.supervised_fraction is None or 0 < p.supervised_fraction <= 1,
            f"plan.supervised_fraction={p.supervised_fraction}: must be in (0, 1] or null",
        ),
        (
            math.isfinite(p.reserved_gib) and p.reserved_gib >= 0,
            f"plan.reserved_gib={p.reserved_gib}: must be a finite number >= 0",
        ),
        (
            p.num_samples is None or p.num_samples >= 1,
            f"plan.num_samples={p.num_samples}: must be >= 1 or null (the prepared dataset's, else 800,000)",
        ),
    ]
    return [msg for ok, msg in checks if not ok] + gpu_problems(p)


def plan_config(dcfg: DictConfig) -> Config:
    """The typed config to plan; ``data.path`` may be unset (then the data statistics come from
    ``plan.*`` or the defaults). Raises UserError naming every bad ``plan.*`` value."""
    if OmegaConf.is_missing(dcfg.data, "path"):
        dcfg.data.path = ""
    cfg = to_config(dcfg)
    raise_problems(plan_problems(cfg.plan) + packet_problems(cfg), "plan")
    return cfg


def packet_problems(cfg: Config) -> list[str]:
    """A packet size that holds no sample the plan would price (the mean sample, or ``data.max_length``
    when shorter); a budget below ``data.max_length`` is allowed here (training refuses it), so small
    shapes can be planned."""
    sample = min(cfg.data.max_length, cfg.plan.mean_sample_tokens or DEFAULT_MEAN_SAMPLE_TOKENS)
    if cfg.data.token_budget >= sample:
        return []
    return [
        f"data.token_budget={cfg.data.token_budget}: a packet must hold at least one sample, and the planned "
        f"ones have {sample} tokens (plan.mean_sample_tokens, or data.max_length when shorter); set "
        f"data.token_budget={cfg.data.max_length} or more (training needs data.max_length)"
    ]


def run(dcfg: DictConfig, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Plan ``dcfg`` (composed from ``overrides``, which the printed launch command repeats): print
    the table, then the JSON summary as the last line; returns the summary."""
    from dflash.cli import value_errors_are_user_errors

    cfg = plan_config(dcfg)
    with value_errors_are_user_errors():  # the target's config.json against the config (e.g. tap ids)
        inputs = resolve_inputs(cfg)
    found = search(cfg, inputs, pinned_fields(overrides))
    best, plan = found.best.cfg, found.best.plan
    fixes = fitting_overrides(cfg, found.configured.plan, found.configured.split.mode)
    caps = anchor_caps(best, plan.inputs, plan.capacity_gib, plan.world_size)
    print(render(found, cfg, fixes, overrides) + "\n\n" + render_anchor_caps(caps), flush=True)
    out = summary(found, cfg, fixes)
    out["largest_anchors"] = anchor_caps_summary(caps)
    if cfg.plan.measure:
        from dflash.plan.rehearse import rehearse  # torch and the fake-tensor machinery: only when asked

        measured = {
            role: m
            for roles, settings in (
                (("target", "drafter"), plan.settings),
                (("colocated",), plan.colocated_levers.settings),
            )
            for (role, _), m in rehearse(best, plan.inputs, roles, settings=settings).items()
        }
        print("\n" + render_measured(plan, measured), flush=True)
        out.update(measured_summary(plan, measured))
    print(json.dumps(out), flush=True)
    return out


def plan_task(dcfg: DictConfig, _run_dir: Path) -> int:
    from hydra.core.hydra_config import HydraConfig

    run(dcfg, list(HydraConfig.get().overrides.task))
    return 0


def main() -> None:
    from dflash.cli import run_app

    run_app("plan_app", Config, plan_task)
