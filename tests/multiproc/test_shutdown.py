"""Shutting down on an error path never blocks on work a dead or stuck peer will never match
(gloo, real processes: 1 target + 1 drafter through ``init_distributed``).

The drafter has a packet header receive posted (``prefetch``) and the target a control receive and
a packet's sends pending when the other side dies or stops answering; ``destroy(ctx, failed=True)``
(what ``dflash.train.job`` runs when a rank fails: it aborts the communicators) must return at once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from ranks import finish_rank, rank_env, run_ranks

pytestmark = pytest.mark.multiproc

HIDDEN = 16


def _entry(rank: int, world: int, tmp: str, peer_fate: str, victim: int) -> None:
    rank_env(rank, world)

    def body() -> dict:
        import torch

        from dflash.config import Backend, Device, TopologyConfig
        from dflash.distributed.collectives import warm_up_links
        from dflash.distributed.links import DrafterLink, TargetLink
        from dflash.distributed.process_group import destroy, init_distributed
        from dflash.distributed.protocol import Packet, PacketSpec

        cfg = TopologyConfig(
            num_targets=1, num_drafters=1, backend=Backend.gloo, device=Device.cpu, init_timeout_s=30.0
        )
        ctx = init_distributed(cfg, init_method=f"file://{tmp}/pg")
        topo = ctx.topology
        assert topo is not None
        warm_up_links(topo, rank, ctx.device, 20.0, groups=ctx.link_groups)
        spec = PacketSpec(
            num_taps=1, hidden_size=HIDDEN, dtype=torch.float32, max_tokens=64, device=ctx.device
        )
        if rank == 0:
            target = TargetLink(topo, 0, 1, spec, 20.0, 2, groups=ctx.link_groups[(0, 1)])
            target.send(_packet(Packet, 0))  # its sends and the control receive stay pending
        else:
            drafter = DrafterLink(topo, 1, spec, 20.0, groups=ctx.drafter_links())
            drafter.prefetch(0)
            drafter.prefetch(1)  # deferred until packet 0's payload is posted
        Path(tmp, f"posted{rank}").touch()
        if rank == victim:
            _wait_for(Path(tmp, f"posted{1 - victim}"))  # the survivor's work is pending before it fails
            Path(tmp, "failing").touch()
            if peer_fate == "dies":
                os._exit(0)
            _wait_for(Path(tmp, f"rank{1 - victim}.json"))  # stuck: silent until the survivor is done
            return {}
        _wait_for(Path(tmp, "failing"))
        time.sleep(0.5)  # the victim's process has exited (or it is stuck) by now
        t0 = time.monotonic()
        destroy(ctx, failed=True)
        return {"destroy_s": time.monotonic() - t0}

    finish_rank(rank, tmp, body)


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.02)


def _packet(packet_cls, g: int):
    import torch

    n = 5
    return packet_cls(
        index=g,
        input_ids=torch.arange(n),
        loss_mask=torch.ones(n, dtype=torch.uint8),
        seq_lens=torch.tensor([n]),
        sample_ids=torch.tensor([g]),
        aux_hidden=torch.zeros(n, HIDDEN),
        final_hidden=torch.zeros(n, HIDDEN),
        forward_s=0.0,
        peak_mem_bytes=0,
    )


@pytest.mark.parametrize("peer_fate", ["dies", "hangs"])
@pytest.mark.parametrize("victim", [0, 1], ids=["target", "drafter"])
def test_error_path_shutdown_does_not_block(tmp_path: Path, peer_fate: str, victim: int):
    res = run_ranks(tmp_path, _entry, 2, (peer_fate, victim), deadline_s=40.0)
    survivor = res[1 - victim]
    assert survivor.get("ok"), survivor.get("traceback") or survivor
    assert survivor["destroy_s"] < 3.0, survivor
    print(f"FIGURE shutdown {peer_fate} {victim}: destroy(failed=True) took {survivor['destroy_s']:.3f}s")
