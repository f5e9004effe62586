"""One owner per run directory; nothing of another run is ever deleted or silently resumed.

- ``train.resume=never`` in a directory that holds a finished run is refused (its checkpoints stay);
  with ``train.overwrite=true`` they are moved aside to ``replaced/<time>/``, still loadable.
- A second launch into a directory another launch is using is refused at once, naming the holder;
  the first one finishes untouched.
- Launches without ``--standalone`` and without ``--rdzv-id`` (torchrun's run id is then the string
  ``none``) each get a directory of their own; a torchrun restart stays in its launch's directory
  (real torchrun launches; the others are in-process).
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from faultkit import figure
from ranks import free_port
from runner import Launch, launch, no_leftover_processes

from dflash.config import EXIT_USER_ERROR
from dflash.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.faults

QUICK = ["topology.num_targets=1", "train.max_steps=3", "train.save_every=1", "logging.mode=disabled"]


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if "rank" not in p.name)


def test_resume_never_refuses_then_overwrite_moves_aside(tmp_path, run_cache, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference.run_dir, run_dir)
    before = _tree(run_dir)
    refused = launch(run_dir, [*QUICK, "train.resume=never"], run_cache, nproc=2)
    assert refused.returncode != 0
    assert refused.exits()[(1, 0)]["returncode"] == EXIT_USER_ERROR
    assert "holds another run's outputs" in refused.output and "train.overwrite=true" in refused.output
    assert _tree(run_dir) == before  # nothing deleted, nothing rewritten

    fresh = launch(run_dir, [*QUICK, "train.resume=never", "train.overwrite=true"], run_cache, nproc=2)
    assert fresh.returncode == 0, fresh.output[-3000:]
    (aside,) = (run_dir / "replaced").iterdir()
    old = sorted(p.name for p in (aside / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert (
        old == ["step_00000008", "step_00000012"]
        and load_checkpoint(aside / "checkpoints" / old[-1]).step == 12
    )
    assert [e["step"] for e in fresh.ledger()] == [1, 2, 3]  # the new run's own ledger
    figure("run dir: resume=never", refused_exit=EXIT_USER_ERROR, moved_aside=str(aside.relative_to(run_dir)))


def test_two_launches_into_one_run_dir_one_is_refused(tmp_path, run_cache):
    """Started together (the leader takes the lock right after validating the config, before any
    data or model work): one trains every step, the other is refused at once, naming the holder."""
    run_dir = tmp_path / "run"
    long = ["topology.num_targets=1", "data.num_epochs=8", "train.max_steps=40", "logging.mode=disabled"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [pool.submit(launch, run_dir, long, run_cache, nproc=2, timeout=300) for _ in range(2)]
        runs = [j.result() for j in jobs]
    (done,) = [r for r in runs if r.returncode == 0]
    (refused,) = [r for r in runs if r.returncode != 0]
    assert f"hydra.run.dir={run_dir} is in use by another launch" in refused.output, refused.output[-3000:]
    assert '"pid"' in refused.output and refused.seconds < done.seconds
    assert [e["step"] for e in done.ledger()] == list(range(1, 41))  # one run's steps, once each
    assert load_checkpoint(run_dir / "checkpoints" / "step_00000040").step == 40
    figure("run dir: two launches at once", refused_after_s=round(refused.seconds, 1), winner_steps=40)


@pytest.mark.slow
def test_launches_without_a_run_id_get_their_own_directories(tmp_path, run_cache):
    """``torchrun --nnodes 1 --master-addr 127.0.0.1 --master-port P`` twice (torchrun's run id is
    ``none`` both times): two directories. The first launch loses a target at step 2 and is restarted
    by torchrun (--max-restarts=1): the restart resumes in the first launch's directory."""

    def rdzv():
        return ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]

    common = ["topology.num_targets=1", "train.max_steps=4", "train.save_every=1", "logging.mode=disabled"]
    first = launch(
        None,
        [*common, "fault.kill_rank=0", "fault.kill_at_step=2"],
        run_cache,
        nproc=2,
        torchrun=True,
        rdzv=rdzv(),
        cwd=tmp_path,
        max_restarts=1,
    )
    second = launch(None, common, run_cache, nproc=2, torchrun=True, rdzv=rdzv(), cwd=tmp_path)
    assert first.returncode == 0 and second.returncode == 0, (first.output[-2000:], second.output[-2000:])
    runs = sorted(p for p in (tmp_path / "outputs" / "tiny_cpu").iterdir())
    assert len(runs) == 2 and "none" not in {p.name for p in runs}, runs
    for run in runs:
        assert [e["step"] for e in Launch(0, "", "", 0.0, run).ledger()] == [1, 2, 3, 4]
        assert (run / "drafter" / "model.safetensors").exists()
    # The restarted attempt logged into its own launch's directory: two drafter starts in one log.
    starts = sorted((r / "rank1.log").read_text().count("trainable parameters") for r in runs)
    assert starts == [1, 2], starts
    figure("run dir: no rendezvous id", directories=[p.name for p in runs], restart_stayed_in_its_dir=True)
    assert all(no_leftover_processes(r) for r in runs)
