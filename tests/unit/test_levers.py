"""A drafter rank resolves its memory levers without the planner's GPU probe (issue 40, item 5): with
``plan.gpu=auto``, ``drafter.block_chunks=null`` and ``activation_checkpointing=auto`` it decides
from its own device's memory alone; nothing reads ``plan.gpu``, so ``detect_gpu`` (CUDA contexts and
a device-wide sync on GPUs 0 and 1) never runs on a training rank (and training imports nothing of
the planner: ``tests/unit/test_architecture.py``)."""

from __future__ import annotations

import torch

import dflash.plan.gpus as gpus
import dflash.train.levers as levers
from dflash.cli import compose_config
from dflash.config import register_configs, to_config
from dflash.sizing.fit import decide_block_chunks
from dflash.sizing.inputs import model_inputs


def _cfg(*overrides: str):
    register_configs()
    return to_config(compose_config("config", ["experiment=qwen3_8b_8gpu", "data.path=unused", *overrides]))


def _no_probe(*_args, **_kwargs):
    raise AssertionError("the GPU probe ran on a training rank")


def test_auto_levers_on_a_gpu_rank_read_only_its_own_memory(monkeypatch):
    monkeypatch.setattr(gpus, "detect_gpu", _no_probe)
    monkeypatch.setattr(gpus, "plan_gpu", _no_probe)
    monkeypatch.setattr(torch.cuda, "get_device_properties", _no_probe)
    monkeypatch.setattr(torch.cuda, "synchronize", _no_probe)
    seen = []

    def capacity(device: torch.device, reserved_gib: float) -> float:  # an 80 GB GPU's, as the rank reads it
        seen.append(device)
        return 74.5 - reserved_gib

    monkeypatch.setattr(levers, "device_capacity_gib", capacity)
    cfg = _cfg("plan.gpu=auto")
    assert cfg.plan.gpu == "auto" and cfg.drafter.block_chunks is None
    got = levers.resolve_levers(cfg, torch.device("cuda", 3), world_size=8)
    assert seen == [torch.device("cuda", 3)]
    want = decide_block_chunks(cfg, model_inputs(cfg), 74.5 - cfg.plan.reserved_gib, world_size=8)
    assert got.block_chunks == want.chunks > 1 and len(got.reasons) == 2


def test_a_cpu_rank_and_set_levers_decide_nothing(monkeypatch):
    monkeypatch.setattr(levers, "model_inputs", _no_probe)
    cpu = levers.resolve_levers(_cfg("plan.gpu=auto"), torch.device("cpu"), world_size=8)
    assert (cpu.block_chunks, cpu.checkpoint, cpu.reasons) == (1, False, ())
    monkeypatch.setattr(levers, "device_capacity_gib", lambda *_: 70.0)
    set_ = levers.resolve_levers(
        _cfg("drafter.block_chunks=3", "drafter.activation_checkpointing=layers"),
        torch.device("cuda", 0),
        world_size=8,
    )
    assert (set_.block_chunks, set_.checkpoint) == (3, True)
