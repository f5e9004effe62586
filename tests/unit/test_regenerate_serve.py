"""Regeneration against a real OpenAI-compatible server: ``transformers serve`` on 127.0.0.1 serving the
tiny target offline. The responses equal the target's own greedy continuation (HF ``generate``,
fp32) of the same chat-templated prompts, turn by turn; the server is killed mid-run and
restarted, and re-running the command completes the output with no duplicate and no lost record.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(model_dir: Path, port: int, log: Path) -> Iterator[subprocess.Popen]:
    """``transformers serve`` in a session of its own, ready when /health answers; the whole
    process group is killed on exit (or by the caller, to simulate a crash)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert proc.poll() is None, (
                f"transformers serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (
                f"transformers serve not ready in {READY_TIMEOUT_S}s:\n{log.read_text()[-3000:]}"
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


def regenerate(inp: Path, out: Path, url: str, model: str, run_dir: Path) -> subprocess.Popen:
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
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def greedy_regeneration(model, tok, messages: list[dict]) -> list[dict]:
    """The reference: each assistant turn = the target's greedy continuation (batch 1, fp32) of
    the chat-templated conversation so far, earlier turns already replaced, decoded as the server
    does: special tokens skipped, and stripped (``transformers serve`` parses Qwen3-family output
    with a response template whose text fields are stripped); a turn that reached MAX_TOKENS
    without an eos is marked ``cut_at_max_tokens``."""
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
        msg = {"role": "assistant", "content": tok.decode(new, skip_special_tokens=True).strip()}
        if len(new) == MAX_TOKENS and new[-1] not in eos:
            msg[CUT_AT_MAX_TOKENS] = True
        conv.append(msg)
    return conv


def test_transformers_serve_regeneration_equals_greedy_and_survives_a_server_restart(
    tiny_target_dir, tmp_path
):
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
    with serve(tiny_target_dir, port, log) as server:
        print(f"\ntransformers serve ready in {time.perf_counter() - t0:.1f} s")
        first = regenerate(inp, out, url, model, tmp_path / "run1")
        while first.poll() is None and (not out.exists() or len(out.read_text().splitlines()) < 3):
            time.sleep(0.05)
        kill_group(server)  # the server dies mid-run
        stdout, _ = first.communicate(timeout=120)
    assert first.returncode == 1, stdout  # the run stops: the server is gone
    done_first = len(out.read_text().splitlines())
    assert 3 <= done_first < len(records), stdout
    assert "request_error" in stdout and "incomplete: re-run the same command" in stdout

    with serve(tiny_target_dir, port, log):  # restarted: re-running the command finishes the output
        second = regenerate(inp, out, url, model, tmp_path / "run2")
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
        assert r["messages"] == greedy_regeneration(target, tok, src["messages"]), r["source_index"]
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
