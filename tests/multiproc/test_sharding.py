"""Drafter state sharding (dflash.distributed.sharding, FSDP2) on two gloo drafters against
unsharded training: the real DFlashDraftModel, dflash_loss and AdamW on synthetic packets, fp32.

- the gradient reduction is a SUM on the installed torch (its default AVG once summed on gloo:
  pytorch#162338): after one backward each rank's shard equals that slice of the sum of both
  drafters' gradients;
- 10 sharded steps (each drafter its own packet, the trainer's step: global weight sum, clip by the
  whole norm, AdamW) equal 10 unsharded steps of one process over both packets (weights to 1e-5);
- checkpoints cross shard settings and drafter counts: the DCP shards of a sharded run after 5 steps
  (each drafter writes its own, ``sharded_state``), loaded into one unsharded drafter, continue to
  the same weights, and the whole state of the unsharded run, loaded into a sharded one, too; the
  same shards loaded by 3 sharded drafters hold bitwise the state the 2 wrote (weights and the
  optimizer's moments);
- a drafter with no packet in a step still joins its peer's collectives (the resumed sharded run
  has one such step, as has its reference); a dead peer is named.
- optim=muon: each sharded step (Muon on the matrices, each gathered whole for Newton-Schulz; AdamW
  on the norms) equals the unsharded optimizer's step on the same whole gradient bitwise, as does its
  whole state, which a sharded drafter loads and continues from bitwise; torch's own Muon on the
  shards does not (its Newton-Schulz sums bf16 products of the shards across ranks). The gradients
  themselves differ from one process's by rounding (``grad_sum_diff`` above), which Muon's
  orthogonalisation amplifies over steps: sharded Muon is held to the unsharded step per step, not
  to a whole unsharded run (measured 4e-4 after 6 steps at lr 1e-3; AdamW stays under 1e-5).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import finish_rank, rank_env, run_ranks
from tiny_drafter import tiny_arch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dflash.config import LossConfig, OptimConfig
from dflash.distributed.links import PeerError
from dflash.distributed.process_group import DistContext
from dflash.distributed.sharded_state import read_shards, write_shards
from dflash.distributed.sharding import (
    ShardedGradReducer,
    clip_grad_norm,
    drafter_collectives,
    drafter_mesh,
    load_full_model_state,
    load_full_optimizer_state,
    shard_drafter,
    whole_model,
)
from dflash.distributed.topology import Topology
from dflash.drafter.blocks import sample_anchors
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.muon import Muon
from dflash.drafter.objective import dflash_loss
from dflash.drafter.optim import build_optimizer
from dflash.targets.packing import doc_ids_from_positions

WORLD, STEPS, HALF = 2, 10, 5
LOSS = LossConfig(ce=1.0, kl=0.5, chunk_size=16)
OPTIM = OptimConfig(lr=1e-3, max_grad_norm=0.5)


def _packet(g: int, arch):
    """Synthetic packet g: two documents, random taps, final states and ids, 6 anchors."""
    gen = torch.Generator().manual_seed(1000 + g)
    lens = (13 + g % 3, 11)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    s, h = pos.shape[1], arch.hidden_size
    mask = torch.ones(1, s, dtype=torch.long)
    mask[0, :3] = 0
    anchors = sample_anchors(mask, doc_ids_from_positions(pos), 3, gen)
    ids = torch.randint(0, arch.vocab_size - 2, (1, s), generator=gen)
    aux = torch.randn(1, s, arch.num_taps * h, generator=gen)
    final = torch.randn(1, s, h, generator=gen)
    return aux, final, ids, mask, anchors, pos


def _frozen(arch):
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(arch.vocab_size, arch.hidden_size, generator=gen) for _ in range(2))


def _loss(model, g: int, arch, embed, head):
    aux, final, ids, mask, anchors, pos = _packet(g, arch)
    return dflash_loss(
        model, aux, final, ids, mask, anchors, embed, head, LOSS, position_ids=pos, normalizer=1.0
    )


def _fresh(arch) -> DFlashDraftModel:
    model = DFlashDraftModel(arch)
    model.reset_parameters(seed=3)
    return model


def _unsharded_steps(
    model, opt, steps: range, arch, embed, head, grads_at: int | None = None, idle: int | None = None
) -> dict:
    """One process over both drafters' packets per step (gradients summed, then the trainer's update);
    ``idle``: the step without drafter 1's packet."""
    out: dict = {}
    for step in steps:
        opt.zero_grad(set_to_none=False)
        weight_sum = 0.0
        for r in range(WORLD):
            if step == idle and r == 1:
                continue
            res = _loss(model, step * WORLD + r, arch, embed, head)
            res.loss.backward()
            weight_sum += float(res.weight_sum)
        if step == grads_at:
            out["grad_sum"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad.mul_(1.0 / weight_sum)
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.max_grad_norm)
        opt.step()
    return out


def _sharded_steps(model, opt, reducer, steps: range, rank: int, arch, embed, head, idle: int | None = None):
    """Each drafter its own packet per step (``idle``: the step in which rank 1 has none)."""
    shard_grads = None
    for step in steps:
        summed = _sharded_grads(model, opt, reducer, step, rank, arch, embed, head, idle)
        shard_grads = summed if shard_grads is None else shard_grads
        opt.step()
    return shard_grads


def _sharded_grads(model, opt, reducer, step: int, rank: int, arch, embed, head, idle: int | None = None):
    """The trainer's gradients of a step (its packet's backward, reduce-scattered, divided by the
    global weight sum and clipped by the whole norm), up to the optimizer step; returns this rank's
    shards of the summed gradients as reduced (before the division)."""
    opt.zero_grad(set_to_none=False)
    weight_sum = torch.zeros((), dtype=torch.float64)
    if not (step == idle and rank == 1):
        res = _loss(model, step * WORLD + rank, arch, embed, head)
        reducer.arm()
        reducer.backward(res.loss)
        weight_sum += res.weight_sum
    reducer.finish(60.0)
    summed = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    dist.all_reduce(weight_sum)
    for p in model.parameters():
        p.grad.mul_(1.0 / float(weight_sum))
    clip_grad_norm(list(model.parameters()), OPTIM.max_grad_norm)
    return summed


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _entry(rank: int, world: int, tmp: str, mode: str) -> None:
    rank_env(rank, world)

    def body() -> dict:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
        topo = Topology(num_targets=0, num_drafters=world, world_size=world, mode="colocated")
        ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo", dist.group.WORLD, topology=topo)
        arch = tiny_arch()
        embed, head = _frozen(arch)
        mesh = drafter_mesh(dist.group.WORLD, torch.device("cpu"))
        out: dict = {}

        # the reference: one unsharded drafter over both packets; its state at HALF kept for a resume
        ref = _fresh(arch)
        ref_opt = build_optimizer(list(ref.parameters()), OPTIM)
        grads = _unsharded_steps(ref, ref_opt, range(HALF), arch, embed, head, grads_at=0)["grad_sum"]
        ref_half = (_whole_weights(ref), copy.deepcopy(ref_opt.state_dict()))  # a whole-tensor checkpoint
        _unsharded_steps(ref, ref_opt, range(HALF, STEPS), arch, embed, head)
        ref_end = _whole_weights(ref)

        # sharded from step 0; its shards at HALF (and, for the 3-drafter load, its whole state)
        model = shard_drafter(_fresh(arch), mesh, mode)
        opt = build_optimizer(list(model.parameters()), OPTIM)
        reducer = ShardedGradReducer(model, ctx)
        shard_grads = _sharded_steps(model, opt, reducer, range(HALF), rank, arch, embed, head)
        write_shards(Path(tmp, "half"), model, opt, dist.group.WORLD)
        whole = _whole_state(model, opt)
        if rank == 0:
            torch.save(whole, Path(tmp, "half.pt"))
        _sharded_steps(model, opt, reducer, range(HALF, STEPS), rank, arch, embed, head)
        out["sharded_vs_unsharded"] = _max_diff(_whole_weights(model), ref_end)
        # the SUM: each local shard is that slice of the summed gradient (dim-0 shards, uneven allowed)
        out["grad_sum_diff"] = max(
            float((g - grads[n][_shard_rows(grads[n].shape[0], rank, world)]).abs().max())
            for n, g in shard_grads.items()
        )

        # sharded state -> one unsharded drafter; unsharded state -> a sharded run (drafter 1 idle once)
        plain = _fresh(arch)
        plain_opt = build_optimizer(list(plain.parameters()), OPTIM)
        read_shards(Path(tmp, "half"), plain, plain_opt, group=None)
        out["shards_vs_whole"] = _max_diff(_whole_state(plain, plain_opt), whole)
        _unsharded_steps(plain, plain_opt, range(HALF, STEPS), arch, embed, head)
        out["sharded_to_unsharded"] = _max_diff(_whole_weights(plain), ref_end)
        load_full_model_state(plain, ref_half[0])
        load_full_optimizer_state(plain_opt, ref_half[1])
        _unsharded_steps(plain, plain_opt, range(HALF, STEPS), arch, embed, head, idle=HALF + 1)
        again = shard_drafter(_fresh(arch), mesh, mode)
        again_opt = build_optimizer(list(again.parameters()), OPTIM)
        load_full_model_state(again, ref_half[0])
        load_full_optimizer_state(again_opt, ref_half[1])
        reducer = ShardedGradReducer(again, ctx)
        _sharded_steps(again, again_opt, reducer, range(HALF, STEPS), rank, arch, embed, head, idle=HALF + 1)
        out["unsharded_to_sharded"] = _max_diff(_whole_weights(again), _whole_weights(plain))
        out["weights_moved"] = _max_diff(ref_end, ref_half[0])
        dist.barrier()
        dist.destroy_process_group()
        return out

    finish_rank(rank, tmp, body)


def _whole_weights(model) -> dict[str, torch.Tensor]:
    return whole_model(model).state_dict()


def _whole_state(model, opt) -> dict[str, torch.Tensor]:
    """The model's and the optimizer's tensors, whole (gathered when sharded), by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{k}": v for k, v in _whole_weights(model).items()}
    for p, state in opt.state.items():
        for key, v in state.items():
            out[f"optim.{names[id(p)]}.{key}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return out


def _reshard_entry(rank: int, world: int, tmp: str, mode: str, src: str) -> None:
    """``world`` sharded drafters load the shards 2 drafters wrote; their whole state."""
    rank_env(rank, world)

    def body() -> dict:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
        model = shard_drafter(_fresh(tiny_arch()), drafter_mesh(dist.group.WORLD, torch.device("cpu")), mode)
        opt = build_optimizer(list(model.parameters()), OPTIM)
        read_shards(Path(src, "half"), model, opt, dist.group.WORLD)
        whole = _whole_state(model, opt)
        written = torch.load(Path(src, "half.pt"), weights_only=True)
        dist.destroy_process_group()
        return {
            "keys_equal": sorted(whole) == sorted(written),
            "bitwise": all(torch.equal(whole[k], written[k]) for k in written if k in whole),
            "tensors": len(written),
        }

    finish_rank(rank, tmp, body)


def _shard_rows(n: int, rank: int, world: int) -> slice:
    """The rows of dim 0 that ``rank`` holds (torch.chunk's split, as DTensor's Shard(0))."""
    size = -(-n // world)
    return slice(min(rank * size, n), min((rank + 1) * size, n))


@pytest.mark.parametrize("mode", ["optimizer", "full"])
def test_sharded_training_equals_unsharded_and_resumes_across_settings(tmp_path, mode):
    res = run_ranks(tmp_path, _entry, WORLD, (mode,), deadline_s=120.0)
    for r in range(WORLD):
        assert res[r]["ok"], res[r].get("traceback")
        print(r, {k: v for k, v in res[r].items() if k != "rank"})
        assert res[r]["weights_moved"] > 1e-3  # the steps did train
        assert res[r]["grad_sum_diff"] < 1e-6
        assert res[r]["sharded_vs_unsharded"] < 1e-5
        assert res[r]["shards_vs_whole"] == 0.0
        assert res[r]["sharded_to_unsharded"] < 1e-5
        assert res[r]["unsharded_to_sharded"] < 1e-5
    three = run_ranks(tmp_path / "three", _reshard_entry, 3, (mode, str(tmp_path)), deadline_s=120.0)
    for r in range(3):
        assert three[r]["ok"], three[r].get("traceback")
        assert three[r]["keys_equal"] and three[r]["bitwise"], three[r]
        assert three[r]["tensors"] > 20, three[r]


MUON = OptimConfig(name="muon", lr=1e-2, max_grad_norm=OPTIM.max_grad_norm)
MUON_STEPS, MUON_HALF = 4, 2


def _state_diff(a: dict, b: dict) -> float:
    """Largest difference between two optimizer ``state_dict``s' tensors (the same layout)."""
    assert a["state"].keys() == b["state"].keys()
    return max(
        float((x.float() - b["state"][i][k].float()).abs().max())
        for i, s in a["state"].items()
        for k, x in s.items()
    )


def _whole_optimizer_state(opt) -> dict:
    """``opt.state_dict()`` with its moments whole (gathered when sharded)."""
    sd = opt.state_dict()
    state = {
        i: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in s.items()}
        for i, s in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def _muon_matrices(mesh) -> dict:
    """Muon alone on random matrices sharded by rows (one with rows no rank count divides): ours and
    torch's on the shards against torch's on the whole matrices, two steps on the same gradients."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(64, 64), (96, 64), (64, 192), (5, 7)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    whole = [torch.nn.Parameter(w.clone()) for w in weights]
    ours = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in weights]
    torchs = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in weights]
    opts = [
        torch.optim.Muon(whole, lr=0.02, adjust_lr_fn="match_rms_adamw"),
        Muon(ours, lr=0.02, adjust_lr_fn="match_rms_adamw"),
        torch.optim.Muon(torchs, lr=0.02, adjust_lr_fn="match_rms_adamw"),
    ]
    for step_grads in grads:
        for p, g in zip(whole, step_grads, strict=True):
            p.grad = g.clone()
        for params in (ours, torchs):
            for p, g in zip(params, step_grads, strict=True):
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        for opt in opts:
            opt.step()

    def worst(params) -> float:
        return max(
            float((p.detach().full_tensor() - w.detach()).abs().max())
            for p, w in zip(params, whole, strict=True)
        )

    return {"muon_ours_vs_whole": worst(ours), "muon_torch_dtensor_vs_whole": worst(torchs)}


def _muon_entry(rank: int, world: int, tmp: str) -> None:
    rank_env(rank, world)

    def body() -> dict:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
        topo = Topology(num_targets=0, num_drafters=world, world_size=world, mode="colocated")
        ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo", dist.group.WORLD, topology=topo)
        arch = tiny_arch()
        embed, head = _frozen(arch)
        mesh = drafter_mesh(dist.group.WORLD, torch.device("cpu"))
        out = _muon_matrices(mesh)

        model = shard_drafter(_fresh(arch), mesh, "full")
        opt = build_optimizer(list(model.parameters()), MUON)
        reducer = ShardedGradReducer(model, ctx)
        ref = _fresh(arch)
        ref_opt = build_optimizer(list(ref.parameters()), MUON)
        start = _whole_weights(ref)
        step_diffs, again = [], None
        for step in range(MUON_STEPS):
            if step == MUON_HALF:  # the unsharded state, loaded into a sharded drafter that joins in
                out["state_diff"] = _state_diff(_whole_optimizer_state(opt), ref_opt.state_dict())
                again = shard_drafter(_fresh(arch), mesh, "full")
                again_opt = build_optimizer(list(again.parameters()), MUON)
                load_full_model_state(again, _whole_weights(ref))
                load_full_optimizer_state(again_opt, ref_opt.state_dict())
                again_reducer = ShardedGradReducer(again, ctx)
            _sharded_grads(model, opt, reducer, step, rank, arch, embed, head)
            whole = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            for n, p in ref.named_parameters():
                p.grad = whole[n].clone()
            opt.step()
            ref_opt.step()
            if again is not None:
                _sharded_grads(again, again_opt, again_reducer, step, rank, arch, embed, head)
                again_opt.step()
            step_diffs.append(_max_diff(_whole_weights(model), _whole_weights(ref)))
        out["step_vs_unsharded"] = max(step_diffs)
        out["resumed_vs_straight"] = _max_diff(_whole_weights(again), _whole_weights(model))
        out["weights_moved"] = _max_diff(_whole_weights(ref), start)
        dist.barrier()
        dist.destroy_process_group()
        return out

    finish_rank(rank, tmp, body)


def test_sharded_muon_steps_equal_unsharded_steps_and_resume_bitwise(tmp_path):
    res = run_ranks(tmp_path, _muon_entry, WORLD, deadline_s=180.0)
    for r in range(WORLD):
        assert res[r]["ok"], res[r].get("traceback")
        print(r, {k: v for k, v in res[r].items() if k != "rank"})
        assert res[r]["weights_moved"] > 1e-2
        assert res[r]["step_vs_unsharded"] == 0.0 and res[r]["state_diff"] == 0.0
        assert res[r]["resumed_vs_straight"] == 0.0
        assert res[r]["muon_ours_vs_whole"] == 0.0
        assert res[r]["muon_torch_dtensor_vs_whole"] > 1e-5  # why ours gathers the matrix


def _dead_peer_entry(rank: int, world: int, tmp: str) -> None:
    rank_env(rank, world)

    def body() -> dict:
        from datetime import timedelta

        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world, timeout=timedelta(seconds=10)
        )
        topo = Topology(num_targets=0, num_drafters=world, world_size=world, mode="colocated")
        ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo", dist.group.WORLD, topology=topo)
        arch = tiny_arch()
        embed, head = _frozen(arch)
        model = shard_drafter(_fresh(arch), drafter_mesh(dist.group.WORLD, torch.device("cpu")), "full")
        reducer = ShardedGradReducer(model, ctx)
        reducer.backward(_loss(model, rank, arch, embed, head).loss)
        if rank == 1:
            os._exit(0)  # dies between steps
        try:
            with drafter_collectives(ctx):
                reducer.backward(_loss(model, 2, arch, embed, head).loss)
        except PeerError as e:
            return {"error": str(e)}
        return {"error": None}

    finish_rank(rank, tmp, body)


def test_a_dead_drafter_is_named_by_the_sharded_reduction(tmp_path):
    res = run_ranks(tmp_path, _dead_peer_entry, WORLD, deadline_s=90.0)
    assert res[0]["ok"], res[0].get("traceback")
    err = res[0]["error"]
    print(err)
    assert err is not None and "drafter 0 (rank 0)" in err and "drafter 1 (rank 1)" in err, err
