"""optim=muon (dflash.drafter.muon, dflash.drafter.optim) on the real tiny drafter, fp32 on CPU.

- which parameters Muon takes (every 2-D weight of the layers and fc) and which AdamW (the norms);
- ``MuonAdamW`` under the schedule equals torch's Muon and AdamW stepped side by side, bitwise;
- its state saved after 2 of 4 steps (through ``torch.save``) and loaded into a fresh optimizer continues
  bitwise as the uninterrupted one (the momentum of the matrices, the moments of the norms);
- the metrics name each group's learning rate; a checkpoint cannot switch optimizers;
- the planner counts one fp32 buffer per matrix parameter for Muon, two for AdamW;
- DFlash2's token-indexed codebooks stay with AdamW, and the planner counts its state to the byte.
"""

from __future__ import annotations

import io

import pytest
import torch
from tiny_drafter import tiny_arch

from dflash.config import OptimConfig
from dflash.drafter.families import build_drafter
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.muon import MuonAdamW, split_matrices
from dflash.drafter.optim import build_optimizer, build_scheduler, group_lrs, peak_lrs
from dflash.sizing.memory import GIB, DrafterSettings, drafter_num_params, drafter_state
from dflash.train.run_dir import check_contract

MUON = OptimConfig(name="muon", lr=1e-3, muon_lr=2e-2, weight_decay=0.01, warmup_ratio=0.2, min_lr_ratio=0.1)
STEPS = 4


def _model() -> DFlashDraftModel:
    model = DFlashDraftModel(tiny_arch(num_layers=1))  # Muon's bf16 Newton-Schulz is slow on CPU
    model.reset_parameters(seed=5)
    return model


def _grads(model: DFlashDraftModel, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _run(model, opt, sched, steps: range) -> None:
    for step in steps:
        _grads(model, step)
        opt.step()
        sched.step()


def test_muon_takes_the_matrices_and_adamw_the_norms():
    model = _model()
    matrices, others = split_matrices(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in matrices} == {
        n for n, p in model.named_parameters() if p.ndim == 2
    } and any(names[id(p)] == "fc.weight" for p in matrices)
    assert all(names[id(p)].endswith("norm.weight") for p in others) and len(others) == 6
    opt = build_optimizer(list(model.parameters()), MUON)
    assert isinstance(opt, MuonAdamW)
    assert [(g["optimizer"], len(g["params"]), g["lr"]) for g in opt.param_groups] == [
        ("adamw", len(others), 1e-3),
        ("muon", len(matrices), 2e-2),
    ]
    assert peak_lrs(OptimConfig(name="muon", lr=3e-4)) == [3e-4, 3e-4]  # muon_lr null: optim.lr
    adamw = build_optimizer(list(model.parameters()), OptimConfig())
    assert type(adamw) is torch.optim.AdamW and len(adamw.param_groups) == 1


@torch.no_grad()
def test_muon_adamw_equals_torch_muon_and_adamw_side_by_side():
    model, ref = _model(), _model()
    opt = build_optimizer(list(model.parameters()), MUON)
    sched = build_scheduler(opt, MUON, STEPS)
    matrices, others = split_matrices(ref.parameters())
    muon = torch.optim.Muon(
        matrices, lr=MUON.muon_lr, weight_decay=MUON.muon_weight_decay, adjust_lr_fn="match_rms_adamw"
    )
    adamw = torch.optim.AdamW(others, lr=MUON.lr, weight_decay=MUON.weight_decay)
    scheds = [build_scheduler(o, MUON, STEPS) for o in (muon, adamw)]
    ratios = []
    for step in range(STEPS):
        lrs = sched.get_last_lr()
        ratios.append(lrs[1] / lrs[0])  # one multiplier, each group's peak
        assert group_lrs(opt, lrs) == {"train/lr": lrs[0], "train/lr_muon": lrs[1]}
        _grads(model, step)
        _grads(ref, step)
        opt.step()
        muon.step()
        adamw.step()
        for s in (sched, *scheds):
            s.step()
    moved = max(
        float((a - b).abs().max()) for a, b in zip(model.parameters(), _model().parameters(), strict=True)
    )
    assert moved > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    assert ratios == pytest.approx([MUON.muon_lr / MUON.lr] * STEPS)


def test_state_saved_midway_continues_bitwise():
    straight = _model()
    opt = build_optimizer(list(straight.parameters()), MUON)
    sched = build_scheduler(opt, MUON, STEPS)
    _run(straight, opt, sched, range(STEPS))

    first = _model()
    opt = build_optimizer(list(first.parameters()), MUON)
    sched = build_scheduler(opt, MUON, STEPS)
    _run(first, opt, sched, range(2))
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    kinds = {k for s in saved["optim"]["state"].values() for k in s}
    assert kinds == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}

    resumed = _model()
    resumed.load_state_dict(saved["model"])
    opt = build_optimizer(list(resumed.parameters()), MUON)
    sched = build_scheduler(opt, MUON, STEPS)
    opt.load_state_dict(saved["optim"])
    sched.load_state_dict(saved["sched"])
    _run(resumed, opt, sched, range(2, STEPS))
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), straight.parameters(), strict=True))


def test_a_checkpoint_cannot_switch_optimizers():
    lr = {"optim.lr": 1e-3}
    with pytest.raises(ValueError, match="optim.name: the checkpoint holds adamw's state") as err:
        check_contract({**lr, "optim.name": "adamw"}, {**lr, "optim.name": "muon"}, allow_change=True)
    assert "drafter.init_from=<run dir>/drafter optim=muon" in str(err.value)
    with pytest.raises(ValueError, match="holds adamw's state"):  # a checkpoint from before optim.name
        check_contract(lr, {**lr, "optim.name": "muon"}, allow_change=True)
    assert check_contract(lr, {**lr, "optim.name": "adamw"}, allow_change=False) == []


def test_the_planner_counts_one_buffer_per_matrix_for_muon():
    arch = tiny_arch()
    p = drafter_num_params(arch)
    for shard, m in (("none", 1), ("optimizer", 4), ("full", 4)):
        adamw = drafter_state(arch, DrafterSettings(shard=shard, num_drafters=m))
        muon = drafter_state(arch, DrafterSettings(shard=shard, num_drafters=m, optimizer="muon"))
        assert adamw["optimizer_state"] == pytest.approx(8 * p / m / GIB)
        assert muon["optimizer_state"] == pytest.approx(4 * p / m / GIB)
        assert {k: v for k, v in muon.items() if k != "optimizer_state"} == {
            k: v for k, v in adamw.items() if k != "optimizer_state"
        }


def test_dflash2_codebooks_stay_with_adamw_and_the_planner_counts_its_state():
    arch = tiny_arch(num_layers=1, family="dflash2", selector_rank=8, selector_top_k=4)
    model = build_drafter(arch)
    model.reset_parameters(seed=5)
    tables = model.lookup_tables()
    opt = build_optimizer(list(model.parameters()), MUON, tables)
    groups = {g["optimizer"]: {id(p) for p in g["params"]} for g in opt.param_groups}
    assert len(tables) == 2 and all(id(t) in groups["adamw"] and id(t) not in groups["muon"] for t in tables)
    _grads(model, 0)
    opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    norms = sum(p.numel() for p in model.parameters() if p.ndim == 1)  # the planner leaves them out
    planned = drafter_state(arch, DrafterSettings(optimizer="muon"))["optimizer_state"] * GIB
    assert state == pytest.approx(planned + 8 * norms, rel=1e-12)
