"""The block-chunked step on two gloo drafters, each with its own packet, through the trainer's
``DrafterParallel`` (armed for the step's last packet, the chunks' ``partial_backward``, the last
backward, ``finish``): the summed gradient equals the unchunked step's to 1e-6 relative, replicated
(the overlapped ``GradReducer``, held during the chunks' backwards) and sharded with FSDP2 (``optimizer``
and ``full``: no gradient sync in the chunks' backwards, the layers' ``context_kv`` gathered as a
forward method)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from ranks import finish_rank, rank_env, run_ranks
from tiny_drafter import CHUNK_ANCHORS, CHUNK_BS, chunk_arch, chunk_packet
from torch.distributed.tensor import DTensor

from dflash.config import LossConfig
from dflash.distributed.drafter_parallel import drafter_parallel
from dflash.distributed.process_group import DistContext
from dflash.distributed.topology import Topology
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.step import StepPlan, objective_step, packet_anchors

WORLD = 2
LOSS = dataclasses.replace(LossConfig(), ce=1.0, kl=0.5)


def _summed_grads(shard: str, chunks: int, rank: int, ctx: DistContext) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = DFlashDraftModel(chunk_arch("dflash"))
    parallel = drafter_parallel(model, ctx, shard, WORLD)
    plan = StepPlan(
        LOSS, CHUNK_BS, "sdpa", "cpu", torch.float32, None, None, None, 0, 1.0, block_chunks=chunks
    )
    p = chunk_packet(seed=rank)
    anchors = packet_anchors(plan, p["positions"], p["loss_mask"], torch.tensor(CHUNK_ANCHORS), 12)
    parallel.arm()  # this drafter's only packet is the step's last
    with parallel.forward():
        out = objective_step(
            model,
            p["embed"],
            p["head"],
            p["aux"],
            p["final"],
            p["ids"],
            p["loss_mask"][0],
            anchors,
            plan,
            partial_backward=parallel.partial_backward,
        )
    parallel.backward(out.loss)
    parallel.finish(60.0)
    return {
        n: (q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad).clone()
        for n, q in model.named_parameters()
    }


def _entry(rank: int, world: int, tmp: str, shard: str) -> None:
    rank_env(rank, world)

    def body() -> dict:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
        topo = Topology(num_targets=0, num_drafters=world, world_size=world, mode="colocated")
        ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo", dist.group.WORLD, topology=topo)
        whole = _summed_grads(shard, 1, rank, ctx)
        chunked = _summed_grads(shard, 3, rank, ctx)
        rel = {
            n: float((chunked[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in whole.items()
        }
        dist.destroy_process_group()
        return {"worst": max(rel.items(), key=lambda kv: kv[1]), "fc_norm": float(whole["fc.weight"].norm())}

    finish_rank(rank, tmp, body)


@pytest.mark.parametrize("shard", ["none", "optimizer", "full"])
def test_chunked_step_on_two_drafters_equals_the_whole_packet(tmp_path, shard):
    res = run_ranks(tmp_path, _entry, WORLD, (shard,), deadline_s=120.0)
    for r in range(WORLD):
        assert res[r]["ok"], res[r].get("traceback")
        print(r, res[r]["worst"])
        assert res[r]["fc_norm"] > 0
        assert res[r]["worst"][1] < 1e-6, res[r]["worst"]
