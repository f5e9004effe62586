"""The periodic eval's memory in the plan (issue 30, item 5).

- a disaggregated drafter with ``eval.every > 0`` holds a whole copy of the target to verify with:
  the plan adds it (``eval_target``) to the drafter and says when it no longer fits; a co-located
  rank verifies with its own target; ``eval.every=0`` adds nothing;
- the decode cache the plan counts equals, to its bookkeeping scalars, the cache transformers builds for a dense
  and for a hybrid (linear-attention) tiny target after a forward of the same length;
- the rehearsal's comparison leaves the eval's items out (it runs the training step only).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.cli import compose_config
from dflash.config import register_configs
from dflash.plan.app import plan_config
from dflash.plan.gpus import resolve_inputs
from dflash.plan.planner import make_plan
from dflash.plan.tables import measured_summary
from dflash.sizing.fit import role_memory
from dflash.sizing.memory import EVAL_ITEMS, DrafterSettings, target_cache_bytes
from dflash.targets.loader import read_target_meta


def _plan_inputs(*overrides: str):
    register_configs()
    cfg = plan_config(compose_config("plan_app", ["experiment=qwen3_6_27b_7x1", "plan.gpu=h200", *overrides]))
    return cfg, resolve_inputs(cfg)


def test_a_drafter_that_evaluates_holds_a_copy_of_the_target():
    cfg, inputs = _plan_inputs()
    off = role_memory(cfg, inputs, DrafterSettings())
    assert not set(EVAL_ITEMS) & set(off["drafter"])
    on_cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, every=500))
    on = role_memory(on_cfg, inputs, DrafterSettings())
    assert on["drafter"]["eval_target"] == off["target"]["weights"] > 40  # 27B in bf16: ~50 GiB
    assert on["colocated"]["eval_target"] == 0.0  # a co-located rank verifies with its own target
    assert sum(on["drafter"].values()) >= sum(off["drafter"].values()) + off["target"]["weights"]
    plan = make_plan(on_cfg, inputs)
    assert "eval_target" in plan.memory["drafter"]
    fake = {"drafter": type("M", (), {"peak_gib": 1.0})()}
    rehearsed = measured_summary(plan, fake)["estimated_gib"]["drafter"]  # type: ignore[arg-type]
    assert rehearsed == pytest.approx(
        sum(v for k, v in plan.memory["drafter"].items() if k not in EVAL_ITEMS), abs=1e-3
    )


def _tensor_bytes(obj, seen=None) -> int:
    """Bytes of every tensor reachable from a transformers cache object."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


@pytest.mark.parametrize("which", ["tiny_target_dir", "tiny_hybrid_target_dir"])
def test_the_planned_decode_cache_is_the_one_transformers_builds(which, request):
    directory = request.getfixturevalue(which)
    meta = read_target_meta(str(directory))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = 37
    with torch.no_grad():
        out = model(torch.randint(0, 100, (1, tokens)), use_cache=True, logits_to_keep=1)
    extra = _tensor_bytes(out.past_key_values) - target_cache_bytes(meta, tokens, 4)
    assert 0 <= extra <= 8 * meta.num_layers  # beyond the states: at most a step counter per layer
    if which == "tiny_hybrid_target_dir":
        assert meta.num_linear_layers > 0
