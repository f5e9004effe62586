"""The first message on a link waits ``topology.first_contact_timeout_s``, not the long model-loading
timeout, and a silent peer is reported with what usually causes it (gloo, real processes: 1 target
+ 1 drafter through ``init_distributed`` and ``dflash.train.job.start_role``)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ranks import finish_rank, rank_env, run_ranks

pytestmark = pytest.mark.multiproc


def _entry(rank: int, world: int, tmp: str) -> None:
    rank_env(rank, world)

    def body() -> dict:
        from dflash.config import Backend, Device, TopologyConfig
        from dflash.distributed.process_group import init_distributed
        from dflash.train.job import start_role

        topo = TopologyConfig(
            num_targets=1,
            num_drafters=1,
            backend=Backend.gloo,
            device=Device.cpu,
            init_timeout_s=600.0,
            first_contact_timeout_s=2.0,
        )
        ctx = init_distributed(topo, init_method=f"file://{tmp}/pg")
        if rank == 1:  # the drafter never answers: stuck before its first message
            while not Path(tmp, "rank0.json").exists():
                time.sleep(0.05)
            return {}
        t0 = time.monotonic()
        start_role(
            SimpleNamespace(topology=topo), SimpleNamespace(topology=ctx.topology), ctx, Path(tmp), None
        )
        return {"seconds": time.monotonic() - t0}

    finish_rank(rank, tmp, body)


def test_a_silent_peer_at_first_contact_is_named_with_the_likely_causes(tmp_path: Path):
    res = run_ranks(tmp_path, _entry, 2, deadline_s=60.0)
    target = res[0]
    assert not target["ok"] and target["error_type"] == "PeerError", target
    assert "first_contact_timeout_s=2" in target["error"] and "not busy" in target["error"], target["error"]
    assert "NCCL_P2P_DISABLE" not in target["error"]  # gloo: no NCCL advice


def test_the_nccl_hint_names_the_pcie_fixes():
    from dflash.distributed.collectives import first_contact_hint

    hint = first_contact_hint("nccl", 120)
    assert "NCCL_P2P_DISABLE=1" in hint and "NCCL_DEBUG=INFO" in hint and "ACS" in hint and "iommu" in hint
