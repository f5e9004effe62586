"""Launch real ``torchrun -m dflash.train`` jobs from tests (gloo, CPU) and read what they leave."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A small, fast variant of the embedded default: every test run shares one cache (tiny target,
# regenerated corpus, tokenized data), built once per session by the `run_cache` fixture.
FAST = [
    "data.embedded_num_prompts=64",
    "data.embedded_max_new_tokens=40",
    "data.num_eval_prompts=4",
    "data.max_length=160",
    "data.token_budget=640",
    "data.num_epochs=2",
    "drafter.num_anchors=8",
    "drafter.max_anchors_per_packet=64",
    "logging.progress_bar=false",
    "topology.init_timeout_s=120",
    "topology.step_timeout_s=60",
]


@dataclass
class Launch:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    run_dir: Path

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def rank_log(self, rank: int) -> str:
        p = self.run_dir / f"rank{rank}.log"
        return p.read_text() if p.exists() else ""

    def ledger(self) -> list[dict]:
        p = self.run_dir / "ledger.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def env_for(cache_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
        DFLASH_CACHE_DIR=str(cache_dir), HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
    )
    env.pop("WANDB_API_KEY", None)
    env.update(extra or {})
    return env


def torchrun_cmd(run_dir: Path, overrides: list[str], nproc: int = 3, max_restarts: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.5", "-m", "dflash.train",
        f"hydra.run.dir={run_dir}", *FAST, *overrides,
    ]


def launch(run_dir: Path, overrides: list[str], cache_dir: Path, *, nproc: int = 3, max_restarts: int = 0,
           timeout: float = 240, env: dict[str, str] | None = None, signal_after: tuple[float, int] | None = None) -> Launch:
    """Run one torchrun job to completion (the whole process group is killed on timeout).

    ``signal_after=(seconds, signum)`` sends a signal to every process of the job after a delay.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        torchrun_cmd(run_dir, overrides, nproc, max_restarts), cwd=REPO, env=env_for(cache_dir, env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        if signal_after is not None:
            delay, signum = signal_after
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signum)
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun did not finish within {timeout}s\n{out[-3000:]}\n{err[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return Launch(proc.returncode, out, err, time.perf_counter() - t0, run_dir)


def no_leftover_processes(run_dir: Path) -> bool:
    """True when no process still runs with this run dir on its command line."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return str(run_dir) not in out
