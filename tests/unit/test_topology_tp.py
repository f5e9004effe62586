"""Tensor-parallel target replicas in the run's layout (``topology.target_tp``): which rank does
what, the config checks before anything starts, the replica groups and their timeouts, the end
summary's split advice."""

from __future__ import annotations

from datetime import timedelta

import pytest

from dflash.cli import compose_config
from dflash.config import TopologyConfig, register_configs, to_config
from dflash.config.checks import validate
from dflash.config.modes import planned_world_size
from dflash.distributed import process_group
from dflash.distributed.links import LinkGroups
from dflash.distributed.process_group import backend_timeout_s, replica_wait_s
from dflash.distributed.topology import Topology, first_on_link, linked_drafters, linked_targets, links
from dflash.train.summary import balance_line, best_split


def test_replicas_are_consecutive_ranks_and_only_their_first_rank_sends():
    """2 replicas of 2 ranks + 2 drafters: replica 0 = ranks 0-1, replica 1 = ranks 2-3, drafters 4-5."""
    topo = Topology(2, 2, 6, target_tp=2)
    assert (topo.target_ranks, topo.sender_ranks, topo.drafter_ranks) == ([0, 1, 2, 3], [0, 2], [4, 5])
    assert topo.leader_rank == 4 and topo.drafter_index(5) == 1
    assert [topo.role_of(r) for r in range(6)] == ["target"] * 4 + ["drafter"] * 2
    assert [topo.producer_of(g) for g in range(4)] == [0, 2, 0, 2]
    assert [topo.producer_replica(g) for g in range(4)] == [0, 1, 0, 1]
    assert [topo.consumer_of(g) for g in range(4)] == [4, 5, 4, 5]
    assert topo.replica_ranks(3) == [2, 3] and topo.replica_of(1) == 0
    # every rank of a replica walks the replica's packets; only the sender has links
    assert topo.packets_of_target(1, 0, 9) == topo.packets_of_target(0, 0, 9) == [0, 2, 4, 6, 8]
    assert topo.packets_of_target(3, 3, 9) == [3, 5, 7]
    assert links(topo) == [(0, 4), (2, 5)] and linked_drafters(topo, 1) == []
    assert linked_targets(topo, 5) == [2] and first_on_link(topo, 1, 4) is None
    assert topo.packets_of_step(1, 5) == [3]
    assert topo.describe(3) == "target replica 1, TP rank 1 (rank 3)"
    assert topo.describe(4) == "drafter 0 (rank 4)"
    assert Topology(2, 1, 3).describe(1) == "target 1 (rank 1)"  # one rank per target: as before


def test_topology_from_config_counts_replicas_of_k_ranks():
    cfg = TopologyConfig(num_targets=3, target_tp=2, num_drafters=None)
    assert Topology.from_config(cfg, 8).num_drafters == 2
    nodes = TopologyConfig(num_targets=1, target_tp=4, num_drafters=None, drafter_nodes=1)
    topo = Topology.from_config(nodes, 16, local_world_size=8)  # node 0: replicas 0-1, node 1: drafters
    assert (topo.num_targets, topo.num_drafters, topo.leader_rank) == (2, 8, 8)
    with pytest.raises(
        ValueError, match=r"2 target replicas x 2 ranks \+ 1 drafters = 5 ranks but WORLD_SIZE=3"
    ):
        Topology(2, 1, 3, target_tp=2)
    with pytest.raises(ValueError, match="topology.target_tp=2"):
        Topology(0, 2, 2, mode="colocated", target_tp=2)


def _cfg(*overrides: str):
    register_configs()
    return to_config(compose_config("config", ["eval.every=0", *overrides]))


def test_the_world_size_check_counts_every_rank_of_every_replica():
    cfg = _cfg("topology.target_tp=2")  # 2 replicas x 2 + 1 drafter
    assert planned_world_size(cfg.topology) == 5
    assert planned_world_size(_cfg("topology=colocated").topology) == 1
    assert planned_world_size(_cfg("topology=colocated", "topology.num_drafters=4").topology) == 4
    validate(cfg, 5)
    with pytest.raises(ValueError) as err:
        validate(cfg, 3)
    msg = str(err.value)
    assert "topology.num_targets=2 x topology.target_tp=2 + topology.num_drafters=1 = 5 ranks" in msg
    assert "WORLD_SIZE=3; launch with torchrun --nproc_per_node 5, or set topology.num_targets=1" in msg


def test_replicas_that_would_span_nodes_or_hold_the_whole_target_are_refused(monkeypatch):
    """One node: any k the target splits (no replica can span two nodes). Several nodes: k must
    divide LOCAL_WORLD_SIZE. Co-located ranks and the periodic eval run the whole target: refused."""
    validate(_cfg("topology.target_tp=2"), 5)  # one node of 5 ranks: 2 replicas of 2 + 1 drafter
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # two nodes of 3: replica 1 would be ranks 2 and 3
    with pytest.raises(
        ValueError, match=r"topology.target_tp=2 must divide the ranks of a node \(LOCAL_WORLD_SIZE=3\)"
    ):
        validate(_cfg("topology.target_tp=2", "topology.num_drafters=2"), 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    validate(_cfg("topology.num_targets=3", "topology.target_tp=2", "topology.num_drafters=2"), 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError) as err:
        validate(_cfg("topology.target_tp=2", "eval.every=10"), 5)
    assert "eval.every=10 with topology.target_tp=2" in str(err.value) and "set eval.every=0" in str(
        err.value
    )
    with pytest.raises(ValueError, match="topology.mode=colocated with topology.target_tp=2"):
        validate(_cfg("topology=colocated", "topology.target_tp=2"), 2)


def test_replica_groups_get_a_timeout_above_the_senders_longest_wait(monkeypatch):
    """init_distributed makes one group per replica after the link groups, with the backend timeout
    of ``replica_wait_s`` (the sender may wait that long for a drafter's ACK between two packets)."""
    made: list[tuple[tuple[int, ...] | None, float]] = []

    def init_process_group(backend, *, rank, world_size, timeout, **kw):
        made.append((None, timeout.total_seconds()))

    def new_group(ranks, timeout: timedelta):
        made.append((tuple(ranks), timeout.total_seconds()))
        return f"g{len(made)}" if 1 in ranks else process_group.dist.GroupMember.NON_GROUP_MEMBER

    monkeypatch.setattr(process_group.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(process_group.dist, "new_group", new_group)
    monkeypatch.setattr(process_group.dist, "get_rank", lambda: 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = TopologyConfig(
        num_targets=2,
        target_tp=2,
        num_drafters=1,
        backend="gloo",
        device="cpu",
        init_timeout_s=90.0,
        step_timeout_s=60.0,
    )
    ctx = process_group.init_distributed(cfg, init_method="file:///unused")
    assert [m[0] for m in made] == [None, (4,), (0, 4), (0, 4), (2, 4), (2, 4), (0, 1), (2, 3)]
    assert replica_wait_s(cfg) == max(90.0, 2 * 60.0) + 60.0 == ctx.tp_wait_s
    assert [m[1] for m in made[-2:]] == [backend_timeout_s(180.0)] * 2
    assert (
        ctx.tp_group == "g7" and ctx.link_groups == {} and ctx.name == "target replica 0, TP rank 1 (rank 1)"
    )

    import torch.distributed.distributed_c10d as c10d

    seen: dict[object, float] = {}
    monkeypatch.setattr(c10d, "_set_pg_timeout", lambda t, g: seen.__setitem__(g, t.total_seconds()))
    process_group.set_timeout(ctx, 30.0)  # never below the replica's own wait
    assert seen["g7"] == backend_timeout_s(180.0) and seen[None] == backend_timeout_s(30.0)
    ctx.link_groups = {(1, 4): LinkGroups("d", "c")}
    process_group.set_timeout(ctx, 30.0, link=(1, 4))
    assert seen["d"] == backend_timeout_s(30.0)


def test_the_end_summary_advises_splits_in_replicas_of_k_ranks():
    # 8 ranks, replicas of 2, 1 s per replica forward, 0.5 s per drafter packet: 3 replicas + 2 drafters
    assert best_split(8, 1.0, 0.5, 2) == (3, 3.0)
    rows = [
        {
            "perf/target_s_per_packet": 1.0,
            "perf/drafter_s_per_packet": 0.5,
            "perf/target_busy_frac": 0.3,
            "comm/recv_wait_frac": 0.0,
            "perf/step_s": 1.0,
        }
    ] * 2
    line = balance_line(rows, 1, 6, self_produced=False, target_tp=2)
    assert line is not None and line.endswith(
        ": 3 target replicas x 2 ranks + 2 drafters would be ~3.0x faster "
        "(measured 1s per target forward, 0.5s per drafter packet)"
    )
    assert str(balance_line(rows, 2, 1, self_produced=False, target_tp=2)).endswith(
        ": 2 target replicas x 2 ranks + 1 drafter is the best split of 5 ranks"
    )
