"""Running ``scripts/serve_check_vllm.py`` (vLLM's decode of every export) in the vLLM environment.

One process serves every case in turn: it imports vLLM once and runs each ``vllm.LLM`` in it.
:func:`vllm_env` is the environment of every vLLM process of the check (this one and the OpenAI server
of the regeneration test): offline; one OpenMP thread (``OMP_NUM_THREADS=1``: vLLM binds its threads to
one core, a second one only contends); ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with
``distributed_executor_backend="uni"``, so the model runs in the engine's own process (the offline
``LLM``'s engine in the caller) instead of a further worker process, each of which costs an import of
vLLM and torch; the KV cache sized by ``VLLM_CPU_KVCACHE_SPACE``; and
the model-info cache (``VLLM_CACHE_ROOT``) under the check's work dir, so a second check skips vLLM's
model inspection subprocesses.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.serve_check.runs import REPO

log = logging.getLogger(__name__)

SCRIPT = REPO / "scripts" / "serve_check_vllm.py"


@dataclass
class VllmCase:
    name: str
    drafter: Path
    num_speculative_tokens: int


def vllm_env(cache_root: Path, kv_cache_gib: int) -> dict[str, str]:
    """The environment of a vLLM process of the check (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_CACHE_ROOT=str(Path(cache_root).absolute()),
        TOKENIZERS_PARALLELISM="false",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    return env


def decode_with_vllm(
    python: Path,
    target_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    cases: list[VllmCase],
    out_dir: Path,
    *,
    kv_cache_gib: int,
    cache_root: Path,
    timeout_s: float,
) -> tuple[dict[str, dict[str, Any]], float]:
    """vLLM's result per case name (see the script's docstring) and the process's wall time.
    ``RuntimeError`` with the log's tail when the process fails or writes no result."""
    max_prompt = max(len(p) for p in prompts)
    max_spec = max(c.num_speculative_tokens for c in cases)
    request = {
        "target": str(target_dir),
        "dtype": "float32",
        "max_model_len": max_prompt + max_new_tokens + max_spec + 1,
        "max_tokens": max_new_tokens,
        "prompts": prompts,
        "cases": [
            {"name": c.name, "drafter": str(c.drafter), "num_speculative_tokens": c.num_speculative_tokens}
            for c in cases
        ],
    }
    req_path, res_path, log_path = (
        out_dir / "vllm_request.json",
        out_dir / "vllm_result.json",
        out_dir / "vllm.log",
    )
    req_path.write_text(json.dumps(request))
    res_path.unlink(missing_ok=True)
    cmd = [str(python), str(SCRIPT), str(req_path), str(res_path)]
    t0 = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.run(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=vllm_env(cache_root, kv_cache_gib),
            timeout=timeout_s,
        )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or not res_path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"the vLLM decode exited {proc.returncode} ({log_path}):\n{tail}")
    result = json.loads(res_path.read_text())
    return {c["name"]: {**c, "vllm": result["vllm"]} for c in result["cases"]}, seconds
