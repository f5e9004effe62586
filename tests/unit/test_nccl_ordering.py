"""The real job under NCCL's ordering rules (tests/nccl_sim.py), on CPU, one thread per rank.

Every rank runs what ``dflash.train.job`` runs after the setup: ``init_distributed`` (its real
group layout and timeouts), ``start_role`` (the warm-up on every link, then the ``TargetWorker`` or
``DrafterTrainer``), ``role.run()`` and the teardown. Only the models are stubs: the target's
forward returns random hidden states after ``FORWARD_S`` of "compute", the drafter's objective is a
tiny function of its real parameters after ``DRAFTER_S`` (so the gradient all-reduce runs). Each
case passes when no rank deadlocks under the strict model, every rank ends with 0, every wait is
shorter than its group's timeout by ``BACKEND_TIMEOUT_MARGIN_S``, and a target's packet time is
the forward's own: no wait for a peer while a packet is made and timed. ``NxK:M`` splits run target
replicas of K ranks (``topology.target_tp``): the stub forward all-reduces over the replica's group
as a sharded forward does, and the replica agrees on every packet before it.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from nccl_sim import NcclSim, SimDeadlock
from runner import FAST

from dflash.distributed.topology import links

FORWARD_S = 0.004
DRAFTER_S = 0.012
STEPS = 8
SPLITS = ["1:2", "1:3", "2:3", "3:5", "4:4", "7:1", "colocated:2", "2x2:1", "1x2:2", "2x3:3"]
SHIPPED = ["2:1", "1:7", "2:6", "5:3", "6:2", "2x2:4", "2x4:8"]
"""The shipped splits (conf/topology, conf/experiment) not in ``SPLITS``: one case each."""
TP_REGION = "tensor-parallel forward"
"""Where the stub forward waits for the other ranks of its replica (its own collectives, not a peer)."""


@pytest.fixture(scope="module")
def base_setup(run_cache: Path):
    """The fast test run's setup (tiny target, the shared tokenized corpus), at world size 3."""
    from runner import prepare_fast

    return prepare_fast(run_cache)


def _config(split: str, time_phases: bool, stop_after: int | None, cache: Path):
    from dflash.cli import compose_config
    from dflash.config import register_configs, to_config

    a, b = split.split(":")
    n, _, k = a.partition("x")
    topo = (
        ["topology=colocated"]
        if a == "colocated"
        else [f"topology.num_targets={n}", f"topology.target_tp={k or 1}", f"topology.num_drafters={b}"]
    )
    overrides = [
        *FAST,
        *topo,
        "topology.device=cuda",
        "topology.backend=nccl",
        "topology.init_timeout_s=60",
        "topology.step_timeout_s=30",
        f"train.max_steps={STEPS}",
        f"train.time_phases={str(time_phases).lower()}",
        "train.save_weights=false",
        "logging.mode=disabled",
        *([f"train.stop_after_steps={stop_after}"] if stop_after else []),
    ]
    register_configs()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_CACHE_DIR", str(cache))
        world = int(b) if a == "colocated" else int(n) * int(k or 1) + int(b)
        return to_config(compose_config("config", overrides)), world


class _ThreadEnv(dict):
    """``os.environ`` for ``process_group``: RANK/WORLD_SIZE/LOCAL_RANK of the calling rank thread."""

    def __init__(self, local: threading.local) -> None:
        super().__init__()
        self.local = local

    def get(self, key, default=None):
        return getattr(self.local, "env", {}).get(key, default)

    def __getitem__(self, key):
        return self.local.env[key]

    def __contains__(self, key) -> bool:
        return key in getattr(self.local, "env", {})


def _fake_objective(sim: NcclSim):
    """Stands for ``dflash_loss``: ``DRAFTER_S`` of compute queued on the current stream (the host
    goes on, as with CUDA kernels), the phases it marks, a loss through every drafter parameter."""

    def objective(self, packet, local):
        sim.compute(DRAFTER_S)
        return _objective_output(self)

    return objective


def _objective_output(self):
    from dflash.drafter.objective import ObjectiveOutput
    from dflash.train.step_stats import OBJECTIVE_SUMS

    self.phases.mark("drafter_forward")
    params = [p for p in self.model.parameters() if p.requires_grad]
    loss = torch.stack([p.float().sum() for p in params]).sum() * 1e-9
    self.phases.mark("loss")
    sums = {
        k: torch.zeros(n or self.setup.arch.block_size, dtype=torch.float64)
        for k, n in OBJECTIVE_SUMS.items()
    }
    sums["weight_sum"] += 1.0
    return ObjectiveOutput(loss=loss, num_rows=1, **sums)


def _stub_target(cfg, device, dtype, tp_group=None) -> torch.nn.Module:
    """Stands for ``load_target``: a module that only knows its replica's group."""
    stub = torch.nn.Identity()
    stub.tp_group = tp_group
    return stub


def _stub_forward(sim: NcclSim, dtype: torch.dtype, hidden: int, taps: int):
    """Stands for ``target_forward``: ``FORWARD_S`` of compute, random hidden states and, on a
    replica's rank, two all-reduces over its group (a sharded forward's rowwise layers)."""

    def forward(model, input_ids, attention_mask, layer_ids, position_ids=None, seq_lens=None):
        time.sleep(FORWARD_S)
        b, t = input_ids.shape
        if model.tp_group is not None:
            with sim.in_region(TP_REGION):
                for _ in range(2):
                    sim.all_reduce(torch.zeros(b, t, hidden), group=model.tp_group)
        return torch.randn(b, t, taps * hidden).to(dtype), torch.randn(b, t, hidden).to(dtype)

    return forward


def run_job(
    split: str,
    time_phases: bool,
    stop_after: int | None,
    base_setup,
    cache: Path,
    tmp_path: Path,
    monkeypatch,
):
    """Run the job of ``split`` under NcclSim; returns (sim, per-rank results, made packets)."""
    from dflash.config.resolve import torch_dtype
    from dflash.distributed import collectives, grad_reducer, links, process_group
    from dflash.distributed.process_group import BACKEND_TIMEOUT_MARGIN_S, destroy, init_distributed
    from dflash.distributed.topology import Topology
    from dflash.train import job, packets, target_worker, trainer

    cfg, world = _config(split, time_phases, stop_after, cache)
    topo = Topology.from_config(cfg.topology, world)
    setup = dataclasses.replace(
        base_setup, cfg=cfg, topology=topo, num_steps=base_setup.plan.num_steps(topo.packets_per_step, STEPS)
    )
    sim = NcclSim(world, min_margin_s=BACKEND_TIMEOUT_MARGIN_S)
    dtype = torch_dtype(cfg.target.dtype, torch.device("cuda"))
    fake_forward = _stub_forward(sim, dtype, setup.meta.hidden_size, len(setup.layer_ids))
    made: list[tuple[int, int, float, float]] = []
    forwarded: dict[int, list[int]] = {}
    real_make, real_forward_only = packets.PacketMaker.make, packets.PacketMaker.forward_only

    def make(self, g, flags=0):
        t0 = time.perf_counter()
        with sim.in_region(f"making packet {g}"):
            pkt = real_make(self, g, flags)
        made.append((sim._rank(), g, pkt.forward_s, time.perf_counter() - t0))
        forwarded.setdefault(sim._rank(), []).append(g)
        return pkt

    def forward_only(self, g):
        real_forward_only(self, g)
        forwarded.setdefault(sim._rank(), []).append(g)

    no_signals = SimpleNamespace(signal=lambda s, h: None, Signals=signal.Signals)
    monkeypatch.setattr(process_group, "os", SimpleNamespace(environ=_ThreadEnv(sim.local)))
    monkeypatch.setattr(
        process_group, "resolve_device", lambda device, local_rank: torch.device("cuda", local_rank)
    )
    monkeypatch.setattr(target_worker, "signal", no_signals)
    monkeypatch.setattr(trainer, "signal", no_signals)
    monkeypatch.setattr(target_worker, "load_target", _stub_target)
    monkeypatch.setattr(trainer, "load_target", _stub_target)
    monkeypatch.setattr(packets, "target_forward", fake_forward)
    monkeypatch.setattr(packets.PacketMaker, "make", make)
    monkeypatch.setattr(packets.PacketMaker, "forward_only", forward_only)
    monkeypatch.setattr(trainer.DrafterTrainer, "_forward_packet", _fake_objective(sim))

    def rank_main(rank: int) -> dict:
        sim.local.env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
        ctx = init_distributed(cfg.topology)
        role = job.start_role(cfg, setup, ctx, tmp_path, None)
        try:
            code = role.run()
        finally:
            role.close()
        destroy(ctx)
        out: dict[str, Any] = {"code": code}
        if isinstance(role, trainer.DrafterTrainer):
            out["step"] = role.state.step
        elif isinstance(role, target_worker.TargetWorker):
            out["stopped"] = {d: link.stopped for d, link in role.links.items()}
            out["forwarded"] = forwarded.get(rank, [])
        return out

    with sim.patch(monkeypatch, [collectives, grad_reducer, links, process_group]):
        results = sim.run(rank_main, deadline_s=120)
    return sim, setup, results, made


CASES = [
    pytest.param(
        split, phases, stop, id=f"{split}-{'phases' if phases else 'nophases'}-{'stop' if stop else 'end'}"
    )
    for split in SPLITS
    for phases in (True, False)
    for stop in (None, 2)
] + [pytest.param(split, False, 2, id=f"{split}-shipped") for split in SHIPPED]


def _split_of(topology) -> str:
    if topology.mode == "colocated":
        return "colocated"
    tp = f"x{topology.target_tp}" if topology.target_tp > 1 else ""
    return f"{topology.num_targets}{tp}:{topology.num_drafters}"


def test_every_shipped_split_is_simulated():
    """Every split a shipped topology or experiment runs is among the simulated ones."""
    from dflash.cli import compose_config
    from dflash.config import register_configs

    register_configs()
    conf = Path(__file__).resolve().parents[2] / "conf"
    overrides = [f"topology={p.stem}" for p in sorted((conf / "topology").glob("*.yaml"))]
    overrides += [f"experiment={p.stem}" for p in sorted((conf / "experiment").glob("*.yaml"))]
    shipped = {o: _split_of(compose_config("config", [o]).topology) for o in overrides}
    simulated = {s.partition(":")[0] if s.startswith("colocated") else s for s in SPLITS + SHIPPED}
    assert {o: s for o, s in shipped.items() if s not in simulated} == {}


@pytest.mark.parametrize(("split", "time_phases", "stop_after"), CASES)
def test_job_under_nccl_ordering(
    split, time_phases, stop_after, base_setup, run_cache, tmp_path, monkeypatch, one_thread
):
    sim, setup, results, made = run_job(
        split, time_phases, stop_after, base_setup, run_cache, tmp_path, monkeypatch
    )
    topo = setup.topology
    assert sim.eager and sim.backend == "nccl"  # the layout NCCL gets: eager init, device_id bound
    # every send and receive travels on a 2-rank group of its link (one communicator, one stream each)
    assert all(len(g.ranks) == 2 for g in sim.p2p_groups), sim.p2p_groups
    assert len(sim.p2p_groups) == (0 if topo.self_produced else 2 * len(links(topo)))
    assert sorted(results) == list(range(topo.world_size))
    assert all(r["code"] == 0 for r in results.values()), results
    steps = min(stop_after or setup.num_steps, setup.num_steps)
    assert [results[d]["step"] for d in topo.drafter_ranks] == [steps] * topo.num_drafters
    assert sim.watchdog_races == []
    assert not sim.aborted and sim.destroyed == set(range(topo.world_size))
    # Making and timing a packet never waits for a peer (only, in a replica, for the collectives of
    # its sharded forward), and forward_s is the forward's own time.
    waits = {r: [x for x in w if not x[0].startswith(TP_REGION)] for r, w in sim.region_blocked.items()}
    assert {r: w for r, w in waits.items() if w} == {}, waits
    assert len(made) >= steps * topo.packets_per_step
    for rank, g, forward_s, wall_s in made:
        assert FORWARD_S <= forward_s <= wall_s, (rank, g, forward_s, wall_s)
    if not topo.self_produced:  # every link got its drafter's STOP (then sent END)
        assert all(all(results[t]["stopped"].values()) for t in topo.target_ranks)
        assert [bool(results[t]["stopped"]) for t in topo.target_ranks] == [
            t in topo.sender_ranks for t in topo.target_ranks
        ]  # only a replica's sender has links
    if topo.target_tp > 1:  # every rank of a replica ran every packet of the replica, in lockstep
        forwarded = {t: results[t]["forwarded"] for t in topo.target_ranks}
        for s in topo.sender_ranks:
            assert len({len(forwarded[r]) for r in topo.replica_ranks(s)}) == 1, forwarded
            assert all(forwarded[r] == forwarded[s] for r in topo.replica_ranks(s)), forwarded


def test_simulator_reports_a_cycle(one_thread):
    """Two ranks that both send first on one communicator deadlock under the strict model (gloo
    would buffer the small sends and pass): the report names both ranks, both ops and the cycle."""
    sim = NcclSim(2)

    def rank_main(rank: int) -> None:
        sim.init_process_group(
            "nccl", rank=rank, world_size=2, timeout=_td(60), device_id=torch.device("cuda", rank)
        )
        out, buf = torch.ones(3), torch.zeros(3)
        sim.isend(out, 1 - rank).wait(_td(30))
        sim.irecv(buf, 1 - rank).wait(_td(30))

    with pytest.raises(SimDeadlock) as err:
        sim.run(rank_main, deadline_s=30)
    text = str(err.value)
    assert "rank 0 waits in Work.wait(send -> rank 1 [(3,) float32] on world)" in text
    assert "rank 1's head on world: send -> rank 0" in text
    assert "cycle: rank 0 -> rank 1 -> rank 0" in text


def test_simulator_orders_ops_per_communicator(one_thread):
    """Eager init: a receive from rank 2 posted before one from rank 1 on the same group blocks it
    (one queue); on separate groups, or without eager init (a 2-rank communicator per pair), the
    later receive completes first."""
    for eager, separate, blocked in ((True, False, True), (True, True, False), (False, False, False)):
        sim = NcclSim(3)
        order: list[str] = []

        def rank_main(rank: int, eager=eager, separate=separate, sim=sim, order=order) -> None:
            kw = {"device_id": torch.device("cuda", rank)} if eager else {}
            sim.init_process_group("nccl", rank=rank, world_size=3, timeout=_td(60), **kw)
            groups = [sim.new_group([0, 1, 2], timeout=_td(60)) for _ in range(2)]
            g1, g2 = (groups[0], groups[1]) if separate else (groups[0], groups[0])
            if rank == 0:
                late = sim.irecv(torch.zeros(1), 2, group=g2)
                early = sim.irecv(torch.zeros(1), 1, group=g1)
                early.wait(_td(1))
                order.append("from 1" if not late.is_completed() else "both")
                late.wait(_td(30))
            elif rank == 1:
                sim.isend(torch.ones(1), 0, group=g1).wait(_td(30))
            else:
                time.sleep(1.5)  # rank 0's receive from rank 1 must not wait for this
                sim.isend(torch.ones(1), 0, group=g2).wait(_td(30))

        if blocked:
            with pytest.raises(RuntimeError, match="timed out in blocking wait"):
                sim.run(rank_main, deadline_s=30)
        else:
            sim.run(rank_main, deadline_s=30)
            assert order == ["from 1"], (eager, separate)


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _overlapped(timeline: list[tuple[str, str, int]]) -> list[bool]:
    """For each packet after the first (in the order received; one compute each): was its payload
    receive posted while the previous packet's compute was still queued? By events, not the wall
    clock (which load moves): none of its receives is queued behind that compute on its stream, and
    the host waited for that compute nowhere before its last receive was posted."""
    computes = [n for kind, _, n in timeline if kind == "compute"]
    last_post: dict[str, int] = {}
    behind: dict[str, int] = {}
    for i, (kind, label, n) in enumerate(timeline):
        if kind == "payload":
            last_post[label] = i
            behind[label] = max(behind.get(label, 0), n)
    labels = sorted(last_post, key=last_post.__getitem__)
    assert len(labels) == len(computes), (len(labels), len(computes))
    return [
        behind[label] < previous
        and not any(kind == "host_wait" and n >= previous for kind, _, n in timeline[: last_post[label]])
        for label, previous in zip(labels[1:], computes[:-1], strict=True)
    ]


@pytest.mark.parametrize("split", ["2:1", "7:1", "2:3"])
def test_drafter_receives_the_next_packet_while_computing(
    split, base_setup, run_cache, tmp_path, monkeypatch, one_thread
):
    """The drafter posts packet g+1's payload receive while packet g's compute is still queued on
    the GPU, from a stream of its own: the transfer runs beside the compute, as the planner prices
    it. Reading the header on the compute stream (a device-to-host copy behind the queued compute)
    would post the payload only after the compute ends: no packet would overlap."""
    sim, setup, results, _ = run_job(split, False, None, base_setup, run_cache, tmp_path, monkeypatch)
    assert all(r["code"] == 0 for r in results.values()), results
    for d in setup.topology.drafter_ranks:
        overlapped = _overlapped(sim.timeline[d])
        assert len(overlapped) >= STEPS // 2, (d, sim.timeline[d])
        share = sum(overlapped) / len(overlapped)
        assert share >= 0.75, f"drafter rank {d}: {sum(overlapped)} of {len(overlapped)} payloads overlapped"
