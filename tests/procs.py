"""Run a world of real rank processes for a test: forkserver children, a deadline, results as JSON.

``run_ranks`` starts ``world`` processes (forked from a server that imported ``preload`` once),
each running ``entry(rank, world, tmp, *args)``; an entry ends with :func:`finish_rank`, which writes
its result to ``tmp/rank{r}.json``. A deadline kills every child still alive, so no test can hang;
``poll`` (if given) is called with the live processes about every millisecond while they run (e.g.
to sample their memory from outside).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_PRELOAD = ("torch", "torch.distributed")


def rank_env(rank: int, world: int) -> None:
    """The torchrun environment of ``rank`` and one intra-op thread (ranks share 2 cores)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)


def finish_rank(rank: int, tmp: str, body: Callable[[], dict | None]) -> None:
    """Run ``body`` in the rank's environment and write ``{"rank", "ok", ...body's result}`` (or the
    error and its traceback) to ``tmp/rank{rank}.json``; then exit the process without cleanup."""
    result: dict[str, Any] = {"rank": rank}
    try:
        result.update(body() or {})
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result.update(ok=False, error_type=type(e).__name__, error=str(e), traceback=traceback.format_exc())
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def run_ranks(
    tmp_path: Path,
    entry: Callable[..., None],
    world: int,
    args: Sequence[Any] = (),
    *,
    deadline_s: float = 40.0,
    preload: Sequence[str] = DEFAULT_PRELOAD,
    poll: Callable[[list[Any]], None] | None = None,
) -> dict[int, dict]:
    """Start the ranks, join them with a deadline (killing stragglers), return each rank's result."""
    if "forkserver" in mp.get_all_start_methods():  # children fork from a server that imported torch once
        ctx: Any = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
    else:
        ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=entry, args=(r, world, str(tmp_path), *args), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    try:
        if poll is not None:
            while time.monotonic() < end and any(p.is_alive() for p in procs):
                poll(procs)
                time.sleep(0.001)
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not hung, f"ranks {hung} still running after {deadline_s}s (killed)"
    results = {}
    for r, p in enumerate(procs):
        f = tmp_path / f"rank{r}.json"
        results[r] = (
            json.loads(f.read_text())
            if f.exists()
            else {"ok": False, "error": f"no result, exit code {p.exitcode}"}
        )
    return results
