#!/usr/bin/env python
"""Host memory of a sharded drafter's checkpoint save: DCP shards (what the trainer does) against
the whole-state gather they replaced, on 2 CPU drafters (gloo, one process each) sharding the
drafter with FSDP2 (``drafter.shard=full``).

Every method runs in a fresh pair of processes (their own allocators). Each drafter builds the
drafter of the given shape, shards it, takes one AdamW step (the moments exist), then:

- ``dcp``     the trainer's save (``DrafterTrainer.save``): ``save_checkpoint`` on the leader with the
              sharded parallel's shard writer while the other drafter joins: each writes its own shard;
- ``gather``  what the trainer did before: every drafter gathers the whole model and optimizer state
              on the CPU (one tensor at a time, every one kept), then the leader writes them (format 1);
- ``export``  the export's gather of the whole weights, kept on the leader alone (``export_model``).

Memory: per drafter, the peak RSS during the save (``VmHWM``, reset through ``/proc/self/clear_refs``
just before it) minus the RSS just before it, in GiB; ``state_gib`` is the whole fp32 state (weights
and the two AdamW moments). One JSON line per method and drafter.

    python scripts/bench_checkpoint.py                               # hidden 2048, 4 layers: 2.6 GiB of state
    python scripts/bench_checkpoint.py --hidden 256 --layers 2 --methods dcp,gather
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.distributed.tensor import DTensor

from dflash.config import OptimConfig
from dflash.distributed.drafter_parallel import Sharded
from dflash.distributed.process_group import DistContext
from dflash.distributed.sharding import whole_model
from dflash.distributed.topology import Topology
from dflash.drafter.arch import DrafterArch
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.optim import build_optimizer
from dflash.metrics import memory_gib, peak_memory_gib, reset_peak_memory
from dflash.train.checkpoint import TrainState, save_checkpoint
from dflash.train.rng_state import capture_rng_state

WORLD = 2
METHODS = ("dcp", "gather", "export")


def _gathered_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The removed ``full_optimizer_state``: every tensor of the optimizer's state gathered whole on the CPU."""
    sd = optimizer.state_dict()

    def whole(v: Any) -> Any:
        if not isinstance(v, Tensor):
            return v
        return (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu", copy=True)

    return {
        "state": {i: {k: whole(v) for k, v in s.items()} for i, s in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }


def _save(method: str, parallel: Sharded, optimizer: torch.optim.Optimizer, root: Path, leader: bool) -> None:
    common: dict[str, Any] = dict(
        scheduler_state={},
        train_state=TrainState(step=1, next_packet=WORLD),
        rng_state=capture_rng_state(),
        contract={},
        config_yaml="",
    )
    if method == "dcp":
        state = parallel.checkpoint_state(optimizer)
        if leader:
            save_checkpoint(root, 1, shards=state.shards, **common)
        else:
            state.join()
    elif method == "gather":
        model_state, optimizer_state = (
            whole_model(parallel.model).state_dict(),
            _gathered_optimizer(optimizer),
        )
        if leader:
            save_checkpoint(root, 1, model_state=model_state, optimizer_state=optimizer_state, **common)
    else:
        parallel.export_model(keep=leader)


def _rank(rank: int, args: argparse.Namespace, method: str, tmp: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=WORLD)
    topo = Topology(num_targets=0, num_drafters=WORLD, world_size=WORLD, mode="colocated")
    ctx = DistContext(rank, WORLD, rank, torch.device("cpu"), "gloo", dist.group.WORLD, topology=topo)
    arch = DrafterArch(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 128,
        num_kv_heads=max(1, args.hidden // 512),
        head_dim=128,
        vocab_size=1024,
        target_layer_ids=[1, 2, 3, 4, 5],
        block_size=16,
        mask_token_id=1000,
    )
    model = DFlashDraftModel(arch)
    model.reset_parameters(seed=0)
    parallel = Sharded(model, ctx, "full")
    optimizer = build_optimizer(list(model.parameters()), OptimConfig())
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    gc.collect()
    dist.barrier()
    before = memory_gib("cpu")
    reset_peak_memory("cpu")
    t0 = time.perf_counter()
    _save(method, parallel, optimizer, Path(tmp) / "checkpoints", leader=rank == 0)
    seconds = time.perf_counter() - t0
    peak = peak_memory_gib("cpu")
    dist.barrier()
    row = {
        "method": method,
        "drafter": rank,
        "params": params,
        "state_gib": round(3 * 4 * params / 2**30, 3),
        "rss_before_gib": round(before, 3),
        "save_peak_above_gib": round(peak - before, 3),
        "seconds": round(seconds, 2),
    }
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048, help="drafter hidden size (heads of 128)")
    ap.add_argument("--layers", type=int, default=4, help="drafter layers")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {','.join(METHODS)}")
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temp dir)")
    args = ap.parse_args()
    for method in args.methods.split(","):
        if method not in METHODS:
            ap.error(f"--methods: {method!r} is not one of {','.join(METHODS)}")
        with tempfile.TemporaryDirectory(prefix="bench-ckpt-", dir=args.dir) as tmp:
            mp.start_processes(_rank, args=(args, method, tmp), nprocs=WORLD, start_method="spawn")
            for rank in range(WORLD):
                print(Path(tmp, f"rank{rank}.json").read_text(), flush=True)


if __name__ == "__main__":
    main()
