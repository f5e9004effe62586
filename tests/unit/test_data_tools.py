"""Agentic data (issue 32, item 7): tool calls and tool results are trained as the target's chat
template renders them: the assistant's tool-call turns supervised (in the template's own call
syntax, with their end-of-turn token), tool results never; from chat JSONL in the OpenAI format
(``content: null``), ShareGPT (``function_call`` / ``observation``) and ``datasets`` rows alike;
the mask viewer shows them; a record the template cannot render is skipped with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_templates import LLAMA31_TEMPLATE, QWEN3_TOOLS_TEMPLATE, tool_tokenizer
from transformers import AutoTokenizer

from dflash.config import DataConfig
from dflash.data.cache import build_or_load_dataset
from dflash.data.chat import MalformedConversation, prompt_ids, tokenize_conversation
from dflash.data.display import CLOSE, OPEN, show_samples
from dflash.data.regenerate.conversation import Regeneration
from dflash.data.sources import parse_conversation
from dflash.eval.loading import prompt_from_record

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the docs",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            },
        },
    },
]


def agentic(i: int, *, two_calls: bool = False) -> dict:
    """An OpenAI-format chat record: a tool call with null content, its result, the answer."""
    calls = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": json.dumps({"city": f"Paris{i}"}, separators=(",", ":")),
            },
        }
    ]
    if two_calls:
        calls.append(
            {
                "id": f"call_{i}b",
                "type": "function",
                "function": {
                    "name": "search_docs",
                    "arguments": json.dumps({"query": "umbrella", "limit": 2}),
                },
            }
        )
    results = [
        {"role": "tool", "tool_call_id": c["id"], "content": f"RESULT{i}{k} 18 C"}
        for k, c in enumerate(calls)
    ]
    return {
        "messages": [
            {"role": "user", "content": f"What is the weather in Paris{i}?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            *results,
            {"role": "assistant", "content": f"It is 18 C in Paris{i}."},
        ],
        "tools": TOOLS,
    }


def plain(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"Continue item {i}:\nimport os"},
            {"role": "assistant", "content": f"def f{i}(x):\n    return x + {i}"},
        ]
    }


def supervised_runs(tok, ids, mask) -> list[str]:
    runs, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def served_ids(tok, record: dict, **kw) -> list[int]:
    """What a server renders: vLLM parses each call's JSON arguments into an object and hands the
    template ``content: ""`` for a null content; then ``apply_chat_template`` with the tools."""
    msgs = []
    for m in record["messages"]:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        msgs.append(m)
    text = tok.apply_chat_template(msgs, tools=record.get("tools"), tokenize=False, **kw)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def qwen3(tiny_target_dir):
    return tool_tokenizer(tiny_target_dir, QWEN3_TOOLS_TEMPLATE)


@pytest.fixture
def llama31(tiny_target_dir):
    return tool_tokenizer(tiny_target_dir, LLAMA31_TEMPLATE)


def test_openai_tool_calls_are_supervised_as_qwen3_renders_them(qwen3):
    """The issue's record (assistant ``tool_calls`` with ``content: null``, a ``role: tool``
    result) used to be skipped as "content of type NoneType, not str". Now: the ids are exactly
    what a server renders for the conversation (tools in the system prompt, the call's arguments
    re-serialised by the template), the tool-call turn is supervised up to and including its
    <|im_end|>, and neither the tool definitions nor the tool result are."""
    record = agentic(3, two_calls=True)
    conv = parse_conversation(record)
    for kw in ({}, {"enable_thinking": False}):
        ids, mask = tokenize_conversation(qwen3, conv.messages, tools=conv.tools, **kw)
        assert ids == served_ids(qwen3, record, **kw)
        runs = supervised_runs(qwen3, ids, mask)
        call = (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris3"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search_docs", "arguments": {"query": "umbrella", "limit": 2}}\n'
            "</tool_call><|im_end|>"
        )
        answer = "It is 18 C in Paris3.<|im_end|>"
        assert runs == [call, answer if kw else "<think>\n\n</think>\n\n" + answer]
        assert not any("RESULT" in r or "<tool_response>" in r or "# Tools" in r for r in runs)
        text = qwen3.decode(ids)
        assert "RESULT30 18 C" in text and "RESULT31 18 C" in text and '"name": "search_docs"' in text
        # the prompt of the final answer (what eval decodes from) holds the tool results, unsupervised
        p = prompt_ids(qwen3, conv.messages, tools=conv.tools, **kw)
        assert ids[: len(p)] == p and "<tool_response>\nRESULT31 18 C" in qwen3.decode(p)


def test_a_call_with_text_and_the_llama31_template(llama31):
    """Llama 3.1 writes one ``{"name", "parameters"}`` call per turn, closed by <|eot_id|>, and
    drops the turn's text; results go in an ipython turn (unsupervised). Two calls in one turn
    make its template raise: that record cannot be rendered, and says so."""
    record = agentic(5)
    record["messages"][1]["content"] = "Let me look that up."
    conv = parse_conversation(record)
    ids, mask = tokenize_conversation(llama31, conv.messages, tools=conv.tools)
    assert ids == served_ids(llama31, record)
    assert supervised_runs(llama31, ids, mask) == [
        '{"name": "get_weather", "parameters": {"city": "Paris5"}}<|eot_id|>',
        "It is 18 C in Paris5.<|eot_id|>",
    ]
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"RESULT50 18 C"<|eot_id|>' in llama31.decode(ids)
    two = parse_conversation(agentic(6, two_calls=True))
    with pytest.raises(Exception, match="only supports single tool-calls"):
        tokenize_conversation(llama31, two.messages, tools=two.tools)


def test_a_template_without_tool_calls_is_a_named_skip(tiny_target_dir, tmp_path):
    """The tiny target's ChatML template has no tool branch: a tool-call record cannot be trained
    as the target would write it, so it is skipped, counted, and the reason says what to fix; a
    mostly agentic file then stops at data.max_skip_fraction with that fix."""
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    conv = parse_conversation(agentic(1))
    with pytest.raises(MalformedConversation, match="the chat template does not render tool calls"):
        tokenize_conversation(tok, conv.messages, tools=conv.tools)
    src = write(tmp_path / "agentic.jsonl", [agentic(i) if i % 5 else plain(i) for i in range(38)])
    with pytest.raises(ValueError, match="max_skip_fraction") as err:
        build(tmp_path, tok, src)
    msg = str(err.value)
    assert "malformed=" in msg and "does not render tool calls" in msg and "target.tokenizer" in msg


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def build(tmp_path: Path, tok, path, **kw):
    cfg = DataConfig(
        path=path,
        cache_dir=str(tmp_path / "cache"),
        max_length=512,
        max_skip_fraction=0.1,
        num_eval_prompts=0,
        **kw,
    )
    return build_or_load_dataset(cfg, tok, len(tok))


def sharegpt(record: dict) -> dict:
    """The record in LLaMA-Factory's ShareGPT form: function_call / observation turns, tools as JSON."""
    conv = []
    for m in record["messages"]:
        if m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in m["tool_calls"]
            ]
            conv.append({"from": "function_call", "value": json.dumps(calls if len(calls) > 1 else calls[0])})
        else:
            conv.append(
                {
                    "from": {"user": "human", "assistant": "gpt", "tool": "observation"}[m["role"]],
                    "value": m["content"],
                }
            )
    return {"conversations": conv, "tools": json.dumps([t["function"] for t in record["tools"]])}


def test_the_issue_file_trains_from_chat_jsonl_sharegpt_and_datasets_rows(qwen3, tmp_path):
    """The issue's file, 30 agentic records of 38, with Qwen3's template: nothing skipped (before:
    30 skipped, over data.max_skip_fraction); the same file as ShareGPT and as parquet rows gives
    the very same samples (parquet unifies the calls' argument names across rows, nulls that are
    dropped again); the mask viewer shows the calls supervised and the results not."""
    rows = [agentic(i, two_calls=i % 3 == 0) if i % 5 else plain(i) for i in range(38)]
    assert sum("tools" in r for r in rows) == 30
    chat = build(tmp_path / "chat", qwen3, write(tmp_path / "chat.jsonl", rows))
    assert len(chat) == 38 and chat.num_skipped == 0
    shared = build(
        tmp_path / "sg",
        qwen3,
        write(tmp_path / "sg.jsonl", [sharegpt(r) if "tools" in r else r for r in rows]),
    )
    datasets = pytest.importorskip("datasets")
    parquet = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([{**r, "tools": r.get("tools", [])} for r in rows]).to_parquet(str(parquet))
    rowwise = build(tmp_path / "pq", qwen3, str(parquet))
    for other in (shared, rowwise):
        assert other.num_skipped == 0
        assert (
            other.tokens.tolist() == chat.tokens.tolist()
            and other.loss_mask.tolist() == chat.loss_mask.tolist()
        )
    shown = show_samples(chat, qwen3, 2, color=False)
    call = f'{OPEN}<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris1"}}}}\n</tool_call><|im_end|>{CLOSE}'
    assert call in shown
    assert "<tool_response>\nRESULT10 18 C\n</tool_response>" in shown
    assert f"{OPEN}<tool_response>" not in shown and "RESULT10 18 C\n</tool_response>" + CLOSE not in shown


def test_bad_tool_calls_are_malformed_with_the_reason():
    bad = agentic(0)
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    with pytest.raises(MalformedConversation, match="get_weather.*arguments that are not JSON"):
        parse_conversation(bad)
    bad = agentic(0)
    bad["messages"][1]["tool_calls"] = []
    with pytest.raises(
        MalformedConversation, match=r"content of type NoneType, not str \(null only in an assistant"
    ):
        parse_conversation(bad)
    bad = agentic(0)
    bad["messages"][2]["tool_calls"] = bad["messages"][1]["tool_calls"]
    with pytest.raises(MalformedConversation, match="only assistant messages call tools"):
        parse_conversation(bad)


def test_eval_prompts_carry_the_tools_and_regenerate_refuses_tool_calls(qwen3):
    """An eval prompt of an agentic record is what a server would see (tool definitions included);
    regenerate, which runs no tools, refuses such a record by name instead of crashing on it."""
    record = agentic(2)
    ids = prompt_from_record(record, qwen3, {})
    assert "# Tools" in qwen3.decode(ids) and qwen3.decode(ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(MalformedConversation, match="regenerate does not run tools"):
        Regeneration(parse_conversation(record).messages)
