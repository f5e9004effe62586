"""Every process group's timeout is strictly above the waits of the links and collectives (NCCL's
watchdog must never end a rank before its PeerError names the peer); the error path aborts.

The real loops check the same rule on every wait under tests/nccl_sim.py (``watchdog_races``).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from dflash.distributed import process_group
from dflash.distributed.links import LinkGroups
from dflash.distributed.process_group import (
    BACKEND_TIMEOUT_MARGIN_S,
    DistContext,
    backend_timeout_s,
    destroy,
    set_timeout,
)
from dflash.distributed.topology import Topology


@pytest.mark.parametrize("wait_s", [0.5, 3.0, 8.0, 60.0, 300.0, 600.0, 7200.0])
def test_group_timeout_is_above_the_wait_by_the_margin(wait_s):
    assert backend_timeout_s(wait_s) >= wait_s + BACKEND_TIMEOUT_MARGIN_S > wait_s
    # a target waits twice the drafter's step timeout: its groups get more still
    assert backend_timeout_s(2 * wait_s) > backend_timeout_s(wait_s)


def _ctx() -> DistContext:
    topo = Topology(1, 2, 3)
    return DistContext(
        rank=0,
        world_size=3,
        local_rank=0,
        device=torch.device("cpu"),
        backend="gloo",
        drafter_group="drafters",
        link_groups={(0, 1): LinkGroups("data01", "ctl01"), (0, 2): LinkGroups("data02", "ctl02")},
        timeout_s=600.0,
        topology=topo,
    )


def test_set_timeout_sets_every_group_or_one_link(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    seen: dict[object, float] = {}
    monkeypatch.setattr(c10d, "_set_pg_timeout", lambda t, g: seen.__setitem__(g, t.total_seconds()))
    ctx = _ctx()
    set_timeout(ctx, 60.0, link=(0, 2))  # one drafter finished its first step: only its link
    assert seen == {"data02": backend_timeout_s(60.0), "ctl02": backend_timeout_s(60.0)}
    assert ctx.timeout_s == 600.0
    seen.clear()
    set_timeout(ctx, 30.0)
    assert set(seen) == {None, "drafters", "data01", "ctl01", "data02", "ctl02"}
    assert set(seen.values()) == {backend_timeout_s(30.0)} and ctx.timeout_s == 30.0


@pytest.mark.parametrize("failed", [False, True])
def test_destroy_aborts_on_the_error_path(monkeypatch, failed):
    import torch.distributed.distributed_c10d as c10d

    calls: list[str] = []
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(process_group.dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: calls.append("abort"))
    destroy(_ctx(), failed=failed)
    assert calls == (["abort"] if failed else ["destroy"])


def test_init_distributed_gives_every_group_the_backend_timeout(monkeypatch):
    """The default group, the drafter group and the two groups of each link, created in one order."""
    made: list[tuple[str, object, float]] = []

    def init_process_group(backend, *, rank, world_size, timeout, **kw):
        made.append(("world", None, timeout.total_seconds()))

    def new_group(ranks, timeout: timedelta):
        made.append(("group", tuple(ranks), timeout.total_seconds()))
        return f"g{len(made)}" if 0 in ranks else process_group.dist.GroupMember.NON_GROUP_MEMBER

    monkeypatch.setattr(process_group.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(process_group.dist, "new_group", new_group)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    from dflash.config import TopologyConfig

    ctx = process_group.init_distributed(
        TopologyConfig(num_targets=1, num_drafters=2, backend="gloo", device="cpu", init_timeout_s=90.0),
        init_method="file:///unused",
    )
    assert [m[1] for m in made] == [None, (1, 2), (0, 1), (0, 1), (0, 2), (0, 2)]
    assert {m[2] for m in made} == {backend_timeout_s(90.0)} and ctx.timeout_s == 90.0
    assert ctx.link_groups == {(0, 1): LinkGroups("g3", "g4"), (0, 2): LinkGroups("g5", "g6")}
