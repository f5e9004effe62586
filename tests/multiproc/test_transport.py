"""The packet transport between real processes: 2 targets + 1 drafter on gloo (CPU).

Each test starts a world of 3 rank processes (tests/ranks.py ``run_ranks``; ``init_distributed``
with a ``file://`` rendezvous), runs one scenario per rank, and collects each rank's result from a
JSON file. A deadline kills every rank that is still alive, so no test can hang.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from ranks import finish_rank, rank_env, run_ranks

pytestmark = pytest.mark.multiproc

WORLD = 3  # targets 0, 1; drafter 2
HIDDEN = 32
TAPS = 3
MAX_TOKENS = 256


# ----------------------------------------------------------------------------------------------
# process harness


def _entry(rank: int, world: int, tmp: str, scenario: str, num_targets: int, num_drafters: int) -> None:
    def body() -> dict:
        rank_env(rank, world)
        from dflash.config import TopologyConfig
        from dflash.distributed.process_group import destroy, init_distributed

        cfg = TopologyConfig(
            num_targets=num_targets,
            num_drafters=num_drafters,
            backend="gloo",
            device="cpu",
            init_timeout_s=30.0,
        )
        ctx = init_distributed(cfg, init_method=f"file://{tmp}/pg")
        result = SCENARIOS[scenario](ctx, Path(tmp)) or {}
        if result.pop("destroy", True):
            destroy(ctx)
        return result

    finish_rank(rank, tmp, body)


def run_world(
    tmp_path: Path, scenario: str, deadline_s: float = 40.0, num_targets: int = 2, num_drafters: int = 1
) -> dict[int, dict]:
    """Start the ranks of ``scenario``, join them with a deadline, return each rank's result."""
    args = (scenario, num_targets, num_drafters)
    try:
        return run_ranks(tmp_path, _entry, num_targets + num_drafters, args, deadline_s=deadline_s)
    except AssertionError as e:
        raise AssertionError(f"scenario {scenario}: {e}") from None


# ----------------------------------------------------------------------------------------------
# shared scenario pieces (run inside the children)


def _spec(dtype, hidden=HIDDEN):
    import torch

    from dflash.distributed.protocol import PacketSpec

    return PacketSpec(
        num_taps=TAPS, hidden_size=hidden, dtype=dtype, max_tokens=MAX_TOKENS, device=torch.device("cpu")
    )


def make_packet(g: int, dtype, hidden: int = HIDDEN):
    """Deterministic packet g with a size that varies with g."""
    import torch

    from dflash.distributed.protocol import Packet

    gen = torch.Generator().manual_seed(1000 + g)
    num_seqs = 0 if g % 7 == 3 else 1 + g % 3  # every 7th packet: all samples dropped (empty packet)
    seq_lens = torch.randint(1, 40, (num_seqs,), generator=gen)
    t = int(seq_lens.sum())
    return Packet(
        index=g,
        input_ids=torch.randint(0, 50_000, (t,), generator=gen),
        loss_mask=torch.randint(0, 2, (t,), generator=gen).to(torch.uint8),
        seq_lens=seq_lens,
        sample_ids=torch.arange(num_seqs) + 100 * g,
        aux_hidden=torch.randn(t, TAPS * hidden, generator=gen).to(dtype),
        final_hidden=torch.randn(t, hidden, generator=gen).to(dtype),
        forward_s=0.25 + g,
        peak_mem_bytes=123_456 + g,
        flags=g % 4,
        num_skipped_nonfinite=3 if num_seqs == 0 else g % 2,
    )


def _same(a, b) -> bool:
    import torch

    fields = ("input_ids", "loss_mask", "seq_lens", "sample_ids", "aux_hidden", "final_hidden")
    tensors_equal = all(
        getattr(a, f).dtype == getattr(b, f).dtype and torch.equal(getattr(a, f), getattr(b, f))
        for f in fields
    )
    stats_equal = (a.index, a.flags, a.peak_mem_bytes, a.num_skipped_nonfinite) == (
        b.index,
        b.flags,
        b.peak_mem_bytes,
        b.num_skipped_nonfinite,
    ) and abs(a.forward_s - b.forward_s) < 1e-6
    return tensors_equal and stats_equal


def _target_loop(
    ctx, spec, packets, *, max_in_flight=2, timeout=20.0, start=0, hidden=HIDDEN, sleep_before=0.0, lazy=False
):
    """Send this target's packets in [start, start + packets) until done or STOP; then END."""
    from dflash.distributed.links import TargetLink

    topo = ctx.topology
    link = TargetLink(
        topo,
        ctx.rank,
        2,
        spec,
        timeout,
        max_in_flight,
        start_index=None if lazy else start,
        groups=ctx.link_groups[(ctx.rank, 2)],
    )
    time.sleep(sleep_before)
    for g in topo.packets_of_target(ctx.rank, start, start + packets):
        link.send(make_packet(g, spec.dtype, hidden))
        if link.stopped:
            break
    link.wait_for_stop()
    link.send_end()
    return {"sent": link.num_sent, "acked": link.num_acked, "max_unacked": link.max_unacked_seen}


def _drafter_link(ctx, spec, timeout=20.0, start=0):
    from dflash.distributed.links import DrafterLink
    from dflash.distributed.topology import Topology

    return DrafterLink(Topology(2, 1, WORLD), 2, spec, timeout, start_index=start, groups=ctx.drafter_links())


def _resume_world(ctx, next_packet, num_steps):
    from dflash.distributed.collectives import agree_on_start

    mine = next_packet if ctx.rank == ctx.topology.leader_rank else 0  # only the leader's resume point counts
    return agree_on_start(ctx, ctx.topology, mine, num_steps)


# ----------------------------------------------------------------------------------------------
# scenarios


def sc_happy(ctx, tmp):
    """Phase A (fp32): every packet consumed, normal end. Phase B (bf16, resumed at packet 8, links
    without start_index as after a resume): early STOP with drain. Every 7th packet is empty."""
    import torch

    from dflash.distributed.collectives import warm_up_links
    from dflash.distributed.links import DrafterLink
    from dflash.distributed.topology import Topology

    warm_up_links(Topology(2, 1, WORLD), ctx.rank, ctx.device, 20.0, groups=ctx.link_groups)
    n_a, n_b = 8, 24
    if ctx.role == "target":
        a = _target_loop(ctx, _spec(torch.float32), n_a)
        start, _ = _resume_world(ctx, n_a, n_b)
        b = _target_loop(ctx, _spec(torch.bfloat16), n_b, start=start, lazy=True)
        return {"a": a, "b": b, "start_b": start}
    link = _drafter_link(ctx, _spec(torch.float32))
    mismatched = []
    link.prefetch(0)
    for g in range(n_a):
        for ahead in (g + 1, g + 2):  # g + 2 comes from g's target: posted once g's payload is
            if ahead < n_a:
                link.prefetch(ahead)
        pkt = link.recv(g)
        if not _same(pkt, make_packet(g, torch.float32)):
            mismatched.append(g)
        time.sleep(0.05)  # a slow drafter: the targets fill their window
        link.ack(g)
    drained_a = link.stop_all()
    start_b, _ = _resume_world(ctx, n_a, n_b)
    link = DrafterLink(
        ctx.topology, 2, _spec(torch.bfloat16), 20.0, groups=ctx.drafter_links()
    )  # start fixed by the first recv
    consumed_b = 5
    for g in range(start_b, start_b + consumed_b):
        pkt = link.recv(g)
        if not _same(pkt, make_packet(g, torch.bfloat16)):
            mismatched.append(g)
        link.ack(g)
    time.sleep(0.5)  # let the targets put packets in flight
    drained_b = link.stop_all()
    try:
        link.recv(n_a + consumed_b)
    except RuntimeError as e:
        recv_after_stop = str(e)
    return {
        "mismatched": mismatched,
        "drained_a": drained_a,
        "drained_b": drained_b,
        "consumed_b": consumed_b,
        "total_wait_s": link.total_wait_s,
        "recv_after_stop": recv_after_stop,
    }


def sc_bad_hidden(ctx, tmp):
    """Target 1 sends hidden size 48 where 32 is expected: ProtocolError on the drafter, which lives on."""
    import torch

    from dflash.distributed.links import PeerError
    from dflash.distributed.protocol import ProtocolError

    if ctx.role == "target":
        hidden = 48 if ctx.rank == 1 else HIDDEN
        try:
            return _target_loop(ctx, _spec(torch.float32, hidden), 4, timeout=10.0, hidden=hidden)
        except PeerError as e:  # the drafter gave up on us and exited
            return {"peer_error": str(e), "destroy": False}
    link = _drafter_link(ctx, _spec(torch.float32))
    received = [link.recv(0).index]
    try:
        link.recv(1)
    except ProtocolError as e:
        return {
            "received": received,
            "protocol_error": str(e),
            "is_value_error": isinstance(e, ValueError),
            "destroy": False,
        }
    return {"received": received}


def sc_target_dies(ctx, tmp):
    import torch

    from dflash.distributed.links import PeerError

    if ctx.role == "target":
        if ctx.rank == 1:
            time.sleep(0.5)
            os._exit(3)  # dies without a word
        try:
            return _target_loop(ctx, _spec(torch.float32), 6, timeout=10.0)
        except PeerError as e:
            return {"peer_error": str(e), "destroy": False}
    link = _drafter_link(ctx, _spec(torch.float32), timeout=30.0)
    link.recv(0)
    link.ack(0)
    t0 = time.monotonic()
    try:
        link.recv(1)
    except PeerError as e:
        return {"peer_error": str(e), "elapsed": time.monotonic() - t0, "destroy": False}
    return {}


def sc_drafter_dies(ctx, tmp):
    import torch

    from dflash.distributed.links import PeerError

    if ctx.role == "drafter":
        link = _drafter_link(ctx, _spec(torch.float32))
        for g in range(2):
            link.recv(g)
            link.ack(g)
        time.sleep(0.3)
        os._exit(3)
    t0 = time.monotonic()
    try:
        _target_loop(ctx, _spec(torch.float32), 10, timeout=30.0)
    except PeerError as e:
        return {"peer_error": str(e), "elapsed": time.monotonic() - t0, "destroy": False}
    return {}


def sc_target_sleeps(ctx, tmp):
    """Target 1 is stuck for 6 s; the drafter's 3 s link timeout reports it. Then init.set_timeout."""
    import torch
    import torch.distributed as dist

    from dflash.distributed import process_group
    from dflash.distributed.links import PeerError

    if ctx.role == "target":
        try:
            return _target_loop(
                ctx, _spec(torch.float32), 4, timeout=20.0, sleep_before=6.0 if ctx.rank == 1 else 0.0
            )
        except PeerError as e:
            return {"peer_error": str(e), "destroy": False}
    link = _drafter_link(ctx, _spec(torch.float32), timeout=30.0)
    link.recv(0)
    link.ack(0)
    link.set_timeout(3.0)
    out = {"destroy": False}
    t0 = time.monotonic()
    try:
        link.recv(1)
    except PeerError as e:
        out.update(peer_error=str(e), elapsed=time.monotonic() - t0)
    # The process-group timeout (backend_timeout_s(init_timeout_s=30) = 120 s) lowered to
    # backend_timeout_s(0.75) = 2 s (a 0.5 s margin here) bounds a collective that the targets never
    # join. (On gloo it does not shorten blocking point-to-point receives: their timeout is fixed when
    # the group is created; the transport passes explicit wait timeouts.)
    process_group.BACKEND_TIMEOUT_MARGIN_S = 0.5
    process_group.set_timeout(ctx, 0.75)
    t0 = time.monotonic()
    try:
        dist.barrier()
    except RuntimeError as e:
        out.update(pg_timeout_error=str(e)[:300], pg_elapsed=time.monotonic() - t0)
    return out


def sc_two_drafters(ctx, tmp):
    """1 target feeding 2 drafters (even packets -> rank 1, odd -> rank 2), resumed at packet 6."""
    import torch

    from dflash.distributed.collectives import all_reduce_sum
    from dflash.distributed.links import DrafterLink, TargetLink
    from dflash.distributed.topology import linked_drafters

    topo = ctx.topology
    spec = _spec(torch.float32)
    start, num_steps = _resume_world(ctx, 6, 5)
    if ctx.role == "target":
        links = {
            d: TargetLink(topo, 0, d, spec, 20.0, 2, groups=ctx.link_groups[(0, d)])
            for d in linked_drafters(topo, 0)
        }
        for g in topo.packets_of_target(0, start, start + num_steps * topo.packets_per_step):
            links[topo.consumer_of(g)].send(make_packet(g, spec.dtype))
        for link in links.values():
            link.wait_for_stop()
            link.send_end()
        return {"sent": {d: link.num_sent for d, link in links.items()}, "start": start}
    link = DrafterLink(topo, ctx.rank, spec, 20.0, groups=ctx.drafter_links())
    first_step = start // topo.packets_per_step
    got, mismatched = [], []
    for step in range(first_step, first_step + num_steps):
        (g,) = topo.packets_of_step(step, ctx.rank)
        pkt = link.recv(g)
        got.append(g)
        if not _same(pkt, make_packet(g, spec.dtype)):
            mismatched.append(g)
        link.ack(g)
    total = all_reduce_sum(ctx, torch.tensor([float(ctx.rank), 1.0]))
    return {
        "got": got,
        "mismatched": mismatched,
        "drained": link.stop_all(),
        "sum": total.tolist(),
        "start": start,
    }


SCENARIOS = {
    "two_drafters": sc_two_drafters,
    "happy": sc_happy,
    "bad_hidden": sc_bad_hidden,
    "target_dies": sc_target_dies,
    "drafter_dies": sc_drafter_dies,
    "target_sleeps": sc_target_sleeps,
}


# ----------------------------------------------------------------------------------------------
# tests


def _ok(res: dict) -> dict:
    assert res.get("ok"), res.get("traceback") or res
    return res


def test_round_trip_backpressure_and_stop_drain(tmp_path):
    res = run_world(tmp_path, "happy")
    d, t0, t1 = _ok(res[2]), _ok(res[0]), _ok(res[1])
    assert d["mismatched"] == []  # bitwise equal, fp32 and bf16, packets of different sizes
    # phase A: all 8 packets consumed and ACKed, nothing left to drain
    assert d["drained_a"] == 0
    assert t0["a"]["sent"] == t1["a"]["sent"] == 4 and t0["a"]["acked"] == t1["a"]["acked"] == 4
    # backpressure: never more than max_in_flight=2 un-ACKed, and the window did fill
    for t in (t0, t1):
        assert t["a"]["max_unacked"] == 2 and t["b"]["max_unacked"] <= 2
    # phase B: STOP after 5 consumed packets; every packet still in flight is drained, then END
    sent_b = t0["b"]["sent"] + t1["b"]["sent"]
    assert d["drained_b"] == sent_b - d["consumed_b"] and 1 <= d["drained_b"] <= 4
    assert sent_b < 24
    assert "after stop_all" in d["recv_after_stop"]
    assert t0["start_b"] == t1["start_b"] == 8


def test_one_target_two_drafters_resumed(tmp_path):
    res = run_world(tmp_path, "two_drafters", num_targets=1, num_drafters=2)
    t, d1, d2 = _ok(res[0]), _ok(res[1]), _ok(res[2])
    assert t["start"] == d1["start"] == d2["start"] == 6  # the leader's resume point reached every rank
    assert t["sent"] == {"1": 5, "2": 5}
    assert d1["got"] == [6, 8, 10, 12, 14] and d2["got"] == [7, 9, 11, 13, 15]
    assert d1["mismatched"] == d2["mismatched"] == [] and d1["drained"] == d2["drained"] == 0
    assert d1["sum"] == d2["sum"] == [3.0, 2.0]  # all_reduce_sum over the drafter-only group


def test_wrong_hidden_size_is_a_protocol_error(tmp_path):
    res = run_world(tmp_path, "bad_hidden")
    d = _ok(res[2])
    assert d["received"] == [0] and d["is_value_error"]
    assert (
        "packet header from target 1 (rank 1): field hidden_size expected 32, got 48" in d["protocol_error"]
    )
    for r in (0, 1):  # the targets see the drafter go away, and say so
        assert "drafter 0 (rank 2)" in _ok(res[r]).get("peer_error", "drafter 0 (rank 2)")


def test_dead_target_is_named_on_the_drafter(tmp_path):
    res = run_world(tmp_path, "target_dies")
    d = _ok(res[2])
    assert d["peer_error"].startswith(
        "drafter 0 (rank 2): recv header with target 1 (rank 1) for packet 1 failed"
    )
    assert "Connection closed by peer" in d["peer_error"] and "the target died" in d["peer_error"]
    assert d["elapsed"] < 10  # not the 30 s timeout
    assert res[1].get("ok") is None or res[1].get("ok") is False  # rank 1 wrote nothing


def test_dead_drafter_is_named_on_the_targets(tmp_path):
    res = run_world(tmp_path, "drafter_dies")
    for r in (0, 1):
        t = _ok(res[r])
        assert (
            t["peer_error"].startswith(f"target {r} (rank {r}):") and "drafter 0 (rank 2)" in t["peer_error"]
        )
        assert "the drafter died" in t["peer_error"] and "GLHF" not in t["peer_error"] and t["elapsed"] < 15


def test_stuck_target_reported_after_timeout(tmp_path):
    res = run_world(tmp_path, "target_sleeps")
    d = _ok(res[2])
    assert d["peer_error"] == (
        "drafter 0 (rank 2): no packet header from target 1 (rank 1) for packet 1 within 3s (recv header); "
        "the target is dead or stuck"
    )
    assert 2.8 < d["elapsed"] < 6
    # set_timeout lowered the process-group timeout from 120 s to 2 s (torch 2.13 _set_pg_timeout)
    assert "pg_timeout_error" in d and 1.8 < d["pg_elapsed"] < 6, d
