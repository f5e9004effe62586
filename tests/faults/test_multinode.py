"""Several hosts, rehearsed on one: two torchrun agents on 127.0.0.1 (``--nnodes 2``, c10d rendezvous).

- Node 0 runs the target, node 1 the drafter (the layout of scripts/launch_multinode.sh). The target
  is SIGKILLed at step 3 of the first attempt; ``--max-restarts=1`` restarts both nodes' workers and
  the run resumes from its checkpoint and finishes on both agents.
- The shared-filesystem check: each node given its own run directory (as without a shared mount),
  the launch is refused, naming the rank that cannot see the leader's directory.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from faultkit import figure
from ranks import free_port
from runner import launch

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def _rdzv(port: int) -> list[str]:
    return [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={uuid.uuid4().hex[:8]}",
    ]


def _two_nodes(run_dirs, overrides, cache, max_restarts=0, timeout=400):
    rdzv = _rdzv(free_port())
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # as scripts/launch_multinode.sh
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [
            pool.submit(
                launch,
                d,
                overrides,
                cache,
                nproc=1,
                torchrun=True,
                rdzv=rdzv,
                max_restarts=max_restarts,
                timeout=timeout,
                env=env,
            )
            for d in run_dirs
        ]
        return [j.result() for j in jobs]


def test_two_nodes_survive_a_killed_worker(tmp_path, run_cache):
    run_dir = tmp_path / "shared" / "run"
    overrides = [
        "topology.num_targets=1",
        "train.max_steps=8",
        "train.save_every=1",
        "logging.mode=disabled",
        "fault.kill_rank=0",
        "fault.kill_at_step=3",
    ]
    runs = _two_nodes([run_dir, run_dir], overrides, run_cache, max_restarts=1)
    assert all(r.returncode == 0 for r in runs), [r.output[-2000:] for r in runs]
    ledger = runs[0].ledger()
    assert [e["step"] for e in ledger] == list(range(1, 9))
    log = (run_dir / "rank1.log").read_text()
    assert "resumed from" in log and (run_dir / "drafter" / "model.safetensors").exists()
    figure("2 nodes, target SIGKILL, --max-restarts=1", exit_codes=[r.returncode for r in runs], steps=8)


def test_nodes_that_do_not_share_the_run_dir_are_refused(tmp_path, run_cache):
    dirs = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    runs = _two_nodes(
        dirs, ["topology.num_targets=1", "train.max_steps=2", "logging.mode=disabled"], run_cache, timeout=200
    )
    assert all(r.returncode != 0 for r in runs)
    out = runs[0].output + runs[1].output
    assert f"hydra.run.dir={dirs[1]} is not one directory for every rank" in out or (
        f"hydra.run.dir={dirs[0]} is not one directory for every rank" in out
    ), out[-3000:]
    assert "cannot see what drafter 0 (rank 1) wrote there" in out
    figure("2 nodes, unshared run dir", refused=True)
