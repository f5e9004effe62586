"""python -m dflash.data.regenerate against a stub OpenAI server: turn by turn, exact accounting on
malformed records, resume after a torn line, retries, refused setting changes, the training-side
chat_template_kwargs check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai_stub import OpenAIStub, stub_reply
from transformers import AutoTokenizer

from dflash.config import ChatTemplateConfig, DataConfig
from dflash.data.cache import build_or_load_dataset
from dflash.data.regenerate.app import run
from dflash.data.regenerate.config import RegenerateConfig
from dflash.files import file_lock


def conv(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


GOOD = [
    {"id": "a", "messages": conv(("system", "be brief"), ("user", "u1"), ("assistant", "old1"))},
    {"messages": conv(("user", "u2"), ("assistant", "old"), ("user", "u3"), ("assistant", "old"))},
    {"conversations": [{"from": "human", "value": "u4"}, {"from": "gpt", "value": "x"}], "id": 7},
    {"messages": conv(("user", "u5"))},  # ends with a user turn: its answer is generated
]
MALFORMED = [
    "{ not json",
    json.dumps({"text": "no messages"}),
    json.dumps({"messages": conv(("assistant", "first"), ("user", "q"))}),  # no user before it
    json.dumps({"messages": conv(("system", "only a system prompt"))}),  # nothing to generate
    json.dumps({"messages": conv(("user", "lone \ud800 surrogate"))}),  # cannot be sent or written
]


def write_input(path: Path) -> list[str]:
    lines = [json.dumps(r) for r in GOOD]
    for k, bad in enumerate(MALFORMED):
        lines.insert(1 + 2 * k, bad)
    path.write_text("\n".join(lines) + "\n")
    return lines


def regen_cfg(tmp_path: Path, url: str, **kw) -> RegenerateConfig:
    kw.setdefault("concurrency", 3)
    if "chat_template_kwargs" in kw:
        kw["data"] = ChatTemplateConfig(chat_template_kwargs=kw.pop("chat_template_kwargs"))
    kw.setdefault("retry_backoff_s", 0.01)
    return RegenerateConfig(
        input=str(tmp_path / "in.jsonl"),
        output=str(tmp_path / "out.jsonl"),
        model="stub",
        endpoint=url,
        progress_bar=False,
        **kw,
    )


def read_out(path: Path) -> dict[int, dict]:
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    by_index = {r["source_index"]: r for r in recs}
    assert len(by_index) == len(recs), "a record appears twice"
    return by_index


def test_turn_by_turn_and_exact_accounting(tmp_path):
    lines = write_input(tmp_path / "in.jsonl")
    with OpenAIStub() as stub:
        summary = run(regen_cfg(tmp_path, stub.url, chat_template_kwargs={"enable_thinking": False}))
    assert summary.records == len(lines) == 9 and summary.skipped == 0
    assert summary.written == 4 and summary.failed == {"malformed": 5} and summary.complete is False
    assert summary.written + summary.num_failed + summary.skipped == summary.records
    out = read_out(tmp_path / "out.jsonl")
    by_id = {r["id"]: r for r in out.values()}
    # system and user turns kept; each assistant turn regenerated from the regenerated history
    assert by_id["a"]["messages"] == conv(
        ("system", "be brief"), ("user", "u1"), ("assistant", "u1 | turn 0")
    )
    two = next(r for r in out.values() if r["messages"][0]["content"] == "u2")
    assert two["messages"] == conv(
        ("user", "u2"), ("assistant", "u2 | turn 0"), ("user", "u3"), ("assistant", "u3 | turn 1")
    )
    assert two["id"] == two["source_index"] and two["finish_reasons"] == ["stop", "stop"]
    assert by_id[7]["messages"] == conv(("user", "u4"), ("assistant", "u4 | turn 0"))  # ShareGPT, own id kept
    five = next(r for r in out.values() if r["messages"][0]["content"] == "u5")
    assert five["messages"][-1] == {"role": "assistant", "content": "u5 | turn 0"}
    # the request carried the earlier regenerated turn, the sampling settings and the template kwargs
    later = next(b for b in stub.requests if b["messages"][-1]["content"] == "u3")
    assert later["messages"][1] == {"role": "assistant", "content": "u2 | turn 0"}
    assert later["temperature"] == 0.0 and later["max_tokens"] == 2048 and later["model"] == "stub"
    assert later["chat_template_kwargs"] == {"enable_thinking": False}
    failed = [json.loads(x) for x in (tmp_path / "out.jsonl.failed.jsonl").read_text().splitlines()]
    assert sorted(f["source_index"] for f in failed) == [1, 3, 5, 7, 8]
    assert {f["reason"] for f in failed} == {"malformed"} and all(":" in f["where"] for f in failed)
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert meta["chat_template_kwargs"] == {"enable_thinking": False} and meta["model"] == "stub"
    assert (
        meta["endpoints"] == [stub.url] and meta["counts"]["written"] == 4 and meta["records_in_output"] == 4
    )
    assert meta["settings"]["temperature"] == 0.0 and meta["status"] == "incomplete"


def test_resume_after_a_torn_line_never_duplicates(tmp_path):
    write_input(tmp_path / "in.jsonl")
    out_path = tmp_path / "out.jsonl"
    with OpenAIStub() as stub:
        first = run(regen_cfg(tmp_path, stub.url, num_records=3))
        assert (first.written, first.num_failed, first.records) == (2, 1, 3)
        kept = out_path.read_text().splitlines()
        # a crash while appending the last record tore its line: only part of it reached the disk
        out_path.write_text("\n".join(kept[:-1]) + "\n" + kept[-1][: len(kept[-1]) // 2])
        n_requests = len(stub.requests)
        second = run(regen_cfg(tmp_path, stub.url))
        assert second.skipped == 1 and second.written == 3 and second.failed == {"malformed": 5}
        assert second.written + second.num_failed + second.skipped == second.records == 9
        out = read_out(out_path)
        assert sorted(out) == [0, 2, 4, 6] and len(out_path.read_text().splitlines()) == 4
        torn = json.loads(kept[-1])
        assert out[torn["source_index"]] == torn  # the torn record was redone, identically
        third = run(regen_cfg(tmp_path, stub.url))
        assert (third.skipped, third.written, third.records) == (4, 0, 9)
        # the second run sent the torn record's turns and those of records 4 and 6; the third none
        assert len(stub.requests) == n_requests + len(torn["finish_reasons"]) + 2
    assert read_out(out_path) == out


def test_retries_rejections_and_reasoning(tmp_path):
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"messages": conv(("user", u))}) + "\n" for u in ("q1", "too long", "q3"))
    )
    with OpenAIStub(reasoning="thought") as stub:
        stub.fail_next = 2  # two 503 answers, then the retries succeed
        stub.reject.add("too long")  # HTTP 400: fails at once, no retry
        summary = run(regen_cfg(tmp_path, stub.url, concurrency=1))
        assert summary.failed == {"rejected": 1} and summary.written == 2
        assert sum(b["messages"][-1]["content"] == "too long" for b in stub.requests) == 1
    out = read_out(tmp_path / "out.jsonl")
    assert out[0]["messages"][-1] == {
        "role": "assistant",
        "content": "q1 | turn 0",
        "reasoning_content": "thought",
    }
    (tmp_path / "out.jsonl").unlink()
    with OpenAIStub(reasoning="thought") as stub:
        run(regen_cfg(tmp_path, stub.url, keep_reasoning=False))
    assert "reasoning_content" not in read_out(tmp_path / "out.jsonl")[0]["messages"][-1]


def test_a_dead_server_stops_the_run_and_a_rerun_finishes_it(tmp_path):
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"messages": conv(("user", f"q{i}"))}) + "\n" for i in range(12))
    )
    with OpenAIStub() as stub:
        dead = stub.url
    summary = run(regen_cfg(tmp_path, dead, max_retries=1, max_consecutive_failures=3, concurrency=1))
    assert summary.written == 0 and summary.failed == {"request_error": 3} and summary.not_attempted == 9
    assert "request errors" in summary.stopped and "ConnectError" in summary.stopped
    with OpenAIStub() as stub:
        again = run(regen_cfg(tmp_path, stub.url))
    assert (
        again.complete and again.written == 12 and sorted(read_out(tmp_path / "out.jsonl")) == list(range(12))
    )


def test_other_settings_are_refused_and_config_errors_name_the_field(tmp_path):
    write_input(tmp_path / "in.jsonl")
    with OpenAIStub() as stub:
        run(regen_cfg(tmp_path, stub.url, num_records=2))
        with pytest.raises(ValueError, match=r"temperature: 0.0 in the file, 0.7 now.*output=<a new file>"):
            run(regen_cfg(tmp_path, stub.url, temperature=0.7, seed=1))
    bad = RegenerateConfig(input="x.jsonl", output="y.jsonl", model="m", concurrency=0)
    with pytest.raises(ValueError) as err:
        run(bad)
    assert "endpoint=http://HOST:PORT/v1" in str(err.value) and "concurrency=0: must be >= 1" in str(
        err.value
    )


def test_a_second_run_on_the_same_output_is_refused(tmp_path):
    write_input(tmp_path / "in.jsonl")
    with file_lock(tmp_path / ".out.jsonl.lock"), pytest.raises(ValueError, match="another regenerate run"):
        run(regen_cfg(tmp_path, "http://127.0.0.1:9/v1"))
    assert not (tmp_path / "out.jsonl").exists()


def test_training_refuses_other_chat_template_kwargs(tmp_path, tiny_target_dir):
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"messages": conv(("user", f"q{i}"))}) + "\n" for i in range(4))
    )
    with OpenAIStub() as stub:
        run(regen_cfg(tmp_path, stub.url, chat_template_kwargs={"enable_thinking": False}))
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    data = DataConfig(path=str(tmp_path / "out.jsonl"), cache_dir=str(tmp_path / "cache"), max_length=64)
    with pytest.raises(ValueError) as err:
        build_or_load_dataset(data, tok, len(tok))
    assert "data.chat_template_kwargs={} but data.path=" in str(err.value)
    assert "set data.chat_template_kwargs={enable_thinking:false}" in str(err.value)
    data.chat_template_kwargs = {"enable_thinking": False}
    ds = build_or_load_dataset(data, tok, len(tok))
    assert len(ds) == 4  # lines in completion order: each sample is the stub's answer to its own prompt
    for k in range(4):
        text = tok.decode(ds.sample(k)[0])
        user = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert text.endswith(stub_reply(conv(("user", user))) + "<|im_end|>\n")
