"""Runs shared by several fault scenarios.

- ``reference``: the uninterrupted run that R1, R2, R8 and R9 compare with (same config, no fault).
  It runs with a sentinel ``WANDB_API_KEY`` in its environment, so R10 can check that no file it
  writes contains the key.
- ``killed_target_run``: R2's run (real torchrun: it restarts the job), whose checkpoints R8 then damages.
- ``hung_target_run``: R4's run, started in the background as soon as the session has its cache.
Every run but R2's is an in-process launch (tests/runner.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from faultkit import HANG_GRACE_S, HANG_TIMEOUT_S, SENTINEL, STEPS
from runner import Launch, launch

HANG_TEST = "test_crashes.py::test_hung_target_is_reported_by_the_drafter"


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, run_cache) -> Launch:
    run = launch(tmp_path_factory.mktemp("ref") / "run", STEPS, run_cache, env={"WANDB_API_KEY": SENTINEL})
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.fixture(scope="session")
def killed_target_run(tmp_path_factory: pytest.TempPathFactory, run_cache) -> Launch:
    """R2's run: target 1 gets SIGKILL at step 10 of the first attempt, ``--max-restarts=1``. Three
    checkpoints are kept (4, 8, 12) so that R8 can damage two of them."""
    return launch(
        tmp_path_factory.mktemp("killed_target") / "run",
        [*STEPS, "train.keep_checkpoints=3", "fault.kill_rank=1", "fault.kill_at_step=10"],
        run_cache,
        torchrun=True,
        max_restarts=1,
        record_exits=True,
        timeout=300,
    )


@pytest.fixture(scope="session", autouse=True)
def hung_target_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, run_cache
) -> Iterator[Future[Launch] | None]:
    """R4's run: target 0 stops responding at step 6 with topology.step_timeout_s=8. It mostly waits
    (the drafter's timeout, then the launch's SIGKILL grace of HANG_GRACE_S for the hung rank, which
    ignores SIGTERM like a stuck process), so it starts in the background when R4 is among the
    selected tests and the other scenarios run meanwhile. The session waits for it before it ends."""
    if not any(item.nodeid.endswith(HANG_TEST) for item in request.session.items):
        yield None
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(
            launch,
            tmp_path_factory.mktemp("hung_target") / "run",
            [
                "train.max_steps=12",
                "logging.mode=disabled",
                f"topology.step_timeout_s={HANG_TIMEOUT_S}",
                "fault.hang_rank=0",
                "fault.hang_at_step=6",
            ],
            run_cache,
            grace_s=HANG_GRACE_S,
            timeout=240,
        )
