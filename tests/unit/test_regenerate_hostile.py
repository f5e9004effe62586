"""python -m dflash.data.regenerate against hostile servers (the scriptable stub, tests/openai_stub.py):
the API key echoed back never reaches a file or the console; a trickling server is given up on at
the request deadline; every malformed or oversized reply is rejected with its reason, never a crash
or a silent "complete"; a refusal (401/403/404) stops the run at once; SIGTERM, SIGINT and SIGHUP
end the run with its summary, meta.json updated and exit 75; turns cut at max_tokens are marked
and trained without the end-of-turn token the target never wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from openai_stub import OpenAIStub, StubResponse, completion, wait_for
from test_regenerate import regen_cfg
from testpaths import REPO
from transformers import AutoTokenizer

from dflash.config import EXIT_STOPPED, EXIT_USER_ERROR, DataConfig
from dflash.data.cache import build_or_load_dataset
from dflash.data.regenerate.app import run
from dflash.data.regenerate.openai_client import max_reply_bytes

SENTINEL = "sk-dflash-SENTINEL-4b1d9e07c2"


def questions(path: Path, n: int) -> None:
    path.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(n))
    )


def failures(tmp_path: Path) -> dict[int, dict]:
    lines = (tmp_path / "out.jsonl.failed.jsonl").read_text().splitlines()
    return {f["source_index"]: f for f in map(json.loads, lines)}


def meta(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out.jsonl.meta.json").read_text())


def app(tmp_path: Path, url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "dflash.data.regenerate",
        f"input={tmp_path / 'in.jsonl'}",
        f"output={tmp_path / 'out.jsonl'}",
        f"endpoint={url}",
        "model=stub",
        "progress_bar=false",
        "retry_backoff_s=0.01",
        f"hydra.run.dir={tmp_path / 'run'}",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_api_key_a_server_echoes_reaches_no_file_and_no_message(tmp_path):
    """Record 0's reply quotes the key, record 1 gets 500s quoting it (retried, then failed), record
    2 a 401 quoting it (the run stops: exit 2, records 3-5 not attempted)."""
    questions(tmp_path / "in.jsonl", 6)

    def echo(body: dict, headers: dict) -> StubResponse:
        q, auth = body["messages"][-1]["content"], headers.get("Authorization", "")
        if q == "q0":
            return StubResponse(200, completion({"role": "assistant", "content": f"your key: {auth}"}))
        return StubResponse(500 if q == "q1" else 401, {"error": {"message": f"bad token {auth}"}})

    with OpenAIStub(respond=echo) as stub:
        proc = app(tmp_path, stub.url, "concurrency=1", "max_retries=1", env={"OPENAI_API_KEY": SENTINEL})
        stdout, stderr = proc.communicate(timeout=120)
    assert {h["Authorization"] for h in stub.headers} == {f"Bearer {SENTINEL}"}  # the key was in play
    assert proc.returncode == EXIT_USER_ERROR, stdout + stderr
    assert len(stub.requests) == 4  # q0, q1 twice, q2: nothing after the 401
    assert "dflash: error: the run stopped:" in stderr and "HTTP 401" in stderr and "OPENAI_API_KEY" in stderr
    assert "not attempted 3" in stdout and "Traceback" not in stdout + stderr
    written = list(tmp_path.rglob("*"))
    assert {p.name for p in written} >= {
        "out.jsonl",
        "out.jsonl.failed.jsonl",
        "out.jsonl.meta.json",
        "regenerate.log",
    }
    texts = [stdout, stderr] + [p.read_text() for p in written if p.is_file()]
    print(f"\nthe key is in none of {len(texts) - 2} files, stdout and stderr")
    for text in texts:
        assert SENTINEL not in text
    assert "Bearer <redacted>" in (tmp_path / "out.jsonl").read_text()
    failed = failures(tmp_path)
    assert (failed[1]["reason"], failed[2]["reason"]) == ("request_error", "rejected")
    assert all("Bearer <redacted>" in failed[i]["error"] for i in (1, 2))
    assert "Bearer <redacted>" in (tmp_path / "run" / "regenerate.log").read_text()
    assert meta(tmp_path)["status"] == "stopped"


def test_a_trickling_server_is_given_up_on_at_the_request_deadline(tmp_path):
    """One byte every 0.3 s never trips httpx's per-read timeout (1 s), and the ~150-byte body would
    take ~45 s; the total deadline gives up after request_timeout_s per attempt."""
    questions(tmp_path / "in.jsonl", 2)

    def trickle(body: dict, headers: dict) -> StubResponse:
        return StubResponse(200, completion({"role": "assistant", "content": "slow"}), trickle_s=0.3)

    with OpenAIStub(respond=trickle) as stub:
        t0 = time.perf_counter()
        summary = run(regen_cfg(tmp_path, stub.url, request_timeout_s=1.0, max_retries=1, concurrency=2))
        took = time.perf_counter() - t0
    print(f"\ngave up on 2 records (2 attempts of 1 s each, concurrently) in {took:.1f} s")
    assert summary.failed == {"request_error": 2} and summary.written == 0 and len(stub.requests) == 4
    assert took < 15
    assert all(
        "no complete reply within request_timeout_s=1" in f["error"] for f in failures(tmp_path).values()
    )
    assert summary.exit_code == 1 and meta(tmp_path)["status"] == "incomplete"


MAX_TOKENS = 16
_MSG = {"role": "assistant", "content": "fine"}
HOSTILE: dict[str, tuple[StubResponse, str]] = {
    "message a string": (StubResponse(200, completion("hello")), "choices[0].message is not an object"),
    "usage a string": (StubResponse(200, completion(_MSG, usage="lots")), "usage is not an object"),
    "tokens Infinity": (
        StubResponse(
            200, '{"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": Infinity}}'
        ),
        "usage.completion_tokens=inf is not a count",
    ),
    "tokens beyond max_tokens": (
        StubResponse(200, completion(_MSG, usage={"completion_tokens": MAX_TOKENS + 1})),
        f"usage.completion_tokens={MAX_TOKENS + 1} for max_tokens={MAX_TOKENS}",
    ),
    "content an int": (StubResponse(200, completion({"content": 5})), "content is not a string (int: 5)"),
    "content a list": (
        StubResponse(200, completion({"content": [{"type": "text"}]})),
        "content is not a string (list",
    ),
    "tool call": (
        StubResponse(200, completion({"content": "", "tool_calls": [{"id": "1", "type": "function"}]})),
        "the reply is a tool call",
    ),
    "finish content_filter": (
        StubResponse(200, completion(_MSG, finish_reason="content_filter")),
        "content_filter",
    ),
    "lone surrogate": (
        StubResponse(200, '{"choices": [{"message": {"content": "a \\ud800 b"}, "finish_reason": "stop"}]}'),
        "content is not valid Unicode",
    ),
    "surrogate reasoning": (
        StubResponse(200, '{"choices": [{"message": {"content": "a", "reasoning_content": "\\udfff"}}]}'),
        "reasoning_content is not valid Unicode",
    ),
    "not JSON": (StubResponse(200, b"<html>gateway</html>"), "the body is not JSON"),
    "nested too deep": (
        StubResponse(200, "[" * 100_000 + "]" * 100_000),
        "the body is not JSON (RecursionError",
    ),
    "a list": (StubResponse(200, [1, 2]), "not a chat completion"),
    "no choices": (StubResponse(200, {"choices": []}), "not a chat completion"),
    "far more text than max_tokens": (
        StubResponse(200, completion({"content": "x" * (33 * MAX_TOKENS)})),
        f"{33 * MAX_TOKENS} characters for max_tokens={MAX_TOKENS}",
    ),
    "more bytes than max_tokens": (
        StubResponse(200, completion({"content": "y" * (max_reply_bytes(MAX_TOKENS) + 10)})),
        f"the reply is over {max_reply_bytes(MAX_TOKENS)} bytes",
    ),
}


def test_every_malformed_reply_is_rejected_with_its_reason(tmp_path):
    names = list(HOSTILE)
    records = [{"messages": [{"role": "user", "content": name}]} for name in names]
    records += [
        {"messages": [{"role": "user", "content": "good"}]},
        {"id": "\ud800", "messages": [{"role": "user", "content": "good"}]},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def hostile(body: dict, headers: dict) -> StubResponse | None:
        picked = HOSTILE.get(body["messages"][-1]["content"])
        return picked[0] if picked else None

    with OpenAIStub(respond=hostile) as stub:
        summary = run(regen_cfg(tmp_path, stub.url, max_tokens=MAX_TOKENS, concurrency=4))
    assert summary.failed == {"rejected": len(names), "malformed": 1} and summary.written == 1
    assert summary.not_attempted == 0 and not summary.complete and summary.exit_code == 1
    failed = failures(tmp_path)
    for i, name in enumerate(names):
        assert HOSTILE[name][1] in failed[i]["error"], (name, failed[i]["error"])
    assert "not valid Unicode" in failed[len(names) + 1]["error"]  # the lone surrogate in its id
    (good,) = map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    assert good["source_index"] == len(names) and good["messages"][-1]["content"] == "good | turn 0"
    assert meta(tmp_path)["status"] == "incomplete"


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_refusal_stops_the_run_at_once(tmp_path, status):
    questions(tmp_path / "in.jsonl", 40)
    with OpenAIStub(respond=lambda body, headers: StubResponse(status, {"error": "no"})) as stub:
        summary = run(regen_cfg(tmp_path, stub.url, concurrency=4, max_retries=3))
    assert len(stub.requests) <= 4  # the records already in flight; none retried, nothing after
    assert f"HTTP {status}" in summary.refused and summary.exit_code == EXIT_USER_ERROR
    assert summary.failed == {"rejected": 1} and summary.not_attempted == 39
    assert meta(tmp_path)["status"] == "stopped" and "refused" in meta(tmp_path)["stopped"]


def slow_stub() -> OpenAIStub:
    def slow(body: dict, headers: dict) -> None:
        time.sleep(0.2)

    return OpenAIStub(respond=slow)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_the_app_with_its_summary_and_exit_75(tmp_path, sig):
    questions(tmp_path / "in.jsonl", 60)
    with slow_stub() as stub:
        proc = app(tmp_path, stub.url, "concurrency=2")
        wait_for(lambda: lines(tmp_path / "out.jsonl") >= 3, timeout_s=120)
        t0 = time.perf_counter()
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
        print(f"\n{sig.name}: exit {proc.returncode} {time.perf_counter() - t0:.1f} s after the signal")
        assert proc.returncode == EXIT_STOPPED, stdout + stderr
        assert "Traceback" not in stdout + stderr and f"the run stopped: {sig.name} received" in stdout
        done = lines(tmp_path / "out.jsonl")
        m = meta(tmp_path)
        assert (
            m["status"] == "stopped"
            and m["counts"]["written"] == done
            and m["counts"]["not_attempted"] == 60 - done
        )
        again = run(regen_cfg(tmp_path, stub.url, concurrency=8))  # the same command finishes the output
    assert again.complete and again.skipped == done and lines(tmp_path / "out.jsonl") == 60


def test_sighup_in_process_cancels_the_requests_in_flight(tmp_path):
    questions(tmp_path / "in.jsonl", 60)
    with slow_stub() as stub:
        timer = threading.Thread(
            target=lambda: (
                wait_for(lambda: lines(tmp_path / "out.jsonl") >= 2),
                os.kill(os.getpid(), signal.SIGHUP),
            )
        )
        timer.start()
        summary = run(regen_cfg(tmp_path, stub.url, concurrency=4))
        timer.join()
    assert (
        summary.signal == "SIGHUP"
        and summary.exit_code == EXIT_STOPPED
        and summary.stopped == "SIGHUP received"
    )
    assert (
        summary.written == lines(tmp_path / "out.jsonl") < 60
        and summary.written + summary.not_attempted == 60
    )
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # the handler is restored


def test_turns_cut_at_max_tokens_are_marked_and_trained_without_their_end_token(tmp_path, tiny_target_dir):
    records = [
        {"messages": [{"role": "user", "content": "cut"}]},
        {"messages": [{"role": "user", "content": "whole"}]},
        {
            "messages": [
                {"role": "user", "content": "cut"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "whole"},
            ]
        },
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def cut_some(body: dict, headers: dict) -> StubResponse:
        q = body["messages"][-1]["content"]
        reason = "length" if q == "cut" else "stop"
        return StubResponse(
            200, completion({"role": "assistant", "content": f"answer to {q}"}, finish_reason=reason)
        )

    with OpenAIStub(respond=cut_some) as stub:
        summary = run(regen_cfg(tmp_path, stub.url, concurrency=1))
    assert summary.complete and summary.turns_cut == 2
    out = {r["source_index"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert out[0]["messages"][-1] == {
        "role": "assistant",
        "content": "answer to cut",
        "cut_at_max_tokens": True,
    }
    assert out[1]["messages"][-1] == {"role": "assistant", "content": "answer to whole"}
    assert [m.get("cut_at_max_tokens") for m in out[2]["messages"]] == [None, True, None, None]
    assert out[2]["finish_reasons"] == ["length", "stop"]

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    data = DataConfig(path=str(tmp_path / "out.jsonl"), cache_dir=str(tmp_path / "cache"), max_length=128)
    ds = build_or_load_dataset(data, tok, len(tok))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    by_source = {int(ds.sample_ids[k]): ds.sample(k) for k in range(len(ds))}

    def supervised(k: int) -> str:
        ids, mask = by_source[k]
        return tok.decode(ids[mask.bool()])

    assert supervised(0) == "answer to cut" and supervised(1) == "answer to whole<|im_end|>"
    assert supervised(2) == "answer to cutanswer to whole<|im_end|>"
    ids, mask = by_source[2]
    assert [int(m) for i, m in zip(ids, mask, strict=True) if i == end] == [
        0,
        0,
        0,
        1,
    ]  # user, cut, user, whole
