"""Chat conversations -> token ids + assistant loss mask, through the tokenizer's own chat template.

The conversation is rendered once with ``apply_chat_template(tokenize=False)`` and the rendered text
is tokenized with ``add_special_tokens=False`` (the template already writes BOS where it wants one),
which is exactly what ``apply_chat_template(tokenize=True)`` does. Each assistant message's content
is then located in the rendered text (char offsets) and mapped to tokens with the offset mapping,
so the approach works for any template (ChatML, Qwen3, Llama-3, ...) without per-template regexes,
including templates that rewrite earlier assistant turns (Qwen3 drops their ``<think>`` part).

Loss mask = 1 on what the target writes in an assistant turn: from the end of the generation prompt
(the assistant header, plus what ``add_generation_prompt`` appends after it, such as Qwen3's empty
``<think>\n\n</think>\n\n`` with ``enable_thinking=False``) to the end of the content, plus the
end-of-turn special token that closes it (``<|im_end|>``, ``<|eot_id|>``: the drafter must learn to
predict it) unless the message is marked ``"cut_at_max_tokens": true`` (a turn cut at a token limit:
the template closes it with an end-of-turn token the target never wrote there); 0 on system/user/tool turns, role headers and template boilerplate. So a rendered
``<think>`` block is supervised when the model writes it (thinking mode) and is prompt when the
generation prompt already holds it (non-thinking mode), exactly as at serving time; the same
``template_kwargs`` must therefore be used here, in regeneration and when serving.

Tool calls (agentic data) are trained as the template renders them. An assistant message may call
tools in the OpenAI format (``"tool_calls": [{"type": "function", "function": {"name": ...,
"arguments": "<JSON>"}}]``, ``"content": null`` allowed); ``role: tool`` messages carry the
results, and a record's ``tools`` (the definitions a request sends) go to the template. Before
rendering, the messages are put in the form a server hands the template (vLLM's chat path): null
content as ``""``, each call's JSON ``arguments`` parsed into an object. A tool-call turn is
supervised from the end of the generation prompt to the end-of-turn token that closes it (the
tool-call text the target writes, in the template's own syntax: Qwen3's ``<tool_call>`` JSON,
Llama 3.1's ``{"name": ..., "parameters": ...}``, ...); tool results, wherever the template puts
them (a ``tool`` turn, Qwen3's ``<tool_response>`` inside a user turn), are prompt. A template that
does not render a call (no tool branch: the call's name is not in its text) or raises on it (Llama
3.1: one call per turn) makes the conversation a :class:`MalformedConversation` naming why.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
CUT_AT_MAX_TOKENS = "cut_at_max_tokens"
"""Key of an assistant message: ``true`` when the turn was cut at a token limit (finish reason
``length``, written by ``dflash.data.regenerate``); its end-of-turn token is not supervised."""
_PROBE = "Zq7Xprobe"


class MalformedConversation(ValueError):
    """A conversation that cannot be trained on: bad structure, role or content, or a template
    that does not render an assistant message's content."""


def validate_messages(messages: Any) -> list[dict]:
    """Check ``messages`` is a non-empty list of ``{"role": str in ROLES, "content": str}`` dicts,
    where an assistant message with ``tool_calls`` may have a null or missing content.

    Returns the list in the form templates get (:func:`template_form`): the dicts themselves
    (extra keys such as ``reasoning_content`` kept for the template), except that a message with
    tool calls or a null content is a normalised copy. Raises :class:`MalformedConversation`
    naming the first problem.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MalformedConversation("'messages' must be a non-empty list")
    out: list[dict] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise MalformedConversation(f"message {i} is a {type(msg).__name__}, not an object")
        role = msg.get("role")
        if role not in ROLES:
            raise MalformedConversation(f"message {i} has role {role!r}; expected one of {ROLES}")
        calls = tool_calls_of(i, msg)
        content = msg.get("content")
        if not isinstance(content, str) and not (calls and content is None):
            why = " (null only in an assistant message with tool_calls)" if content is None else ""
            raise MalformedConversation(
                f"message {i} ({role}) has content of type {type(content).__name__}, not str{why}"
            )
        if not isinstance(msg.get(CUT_AT_MAX_TOKENS, False), bool):
            raise MalformedConversation(
                f"message {i} ({role}) has {CUT_AT_MAX_TOKENS}={msg[CUT_AT_MAX_TOKENS]!r}; expected true or false"
            )
        out.append(template_form(msg, calls) if calls or content is None or "tool_calls" in msg else msg)
    return out


def tool_calls_of(i: int, msg: dict) -> list[dict]:
    """The tool calls of message ``i`` as ``[{"name": str, "arguments": object}]`` (the OpenAI
    ``{"function": {...}}`` wrapper or a flat call; ``arguments`` a JSON string or an object) and
    their ``id``s; [] without any. Raises :class:`MalformedConversation` on a call that is not one."""
    calls = msg.get("tool_calls")
    if calls is None or calls == []:
        return []
    if msg.get("role") != "assistant":
        raise MalformedConversation(
            f"message {i} ({msg.get('role')}) has tool_calls; only assistant messages call tools"
        )
    if not isinstance(calls, list):
        raise MalformedConversation(f"message {i} has tool_calls of type {type(calls).__name__}, not a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise MalformedConversation(
                f"message {i} tool call {j} has no function name; expected "
                '{"type": "function", "function": {"name": ..., "arguments": ...}}'
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise MalformedConversation(
                    f"message {i} tool call {j} ({fn['name']}) has arguments that are not JSON ({exc})"
                ) from None
        out.append(
            {"name": fn["name"], "arguments": args, "id": call.get("id") if isinstance(call, dict) else None}
        )
    return out


def template_form(msg: dict, calls: list[dict]) -> dict:
    """``msg`` as a server hands it to a chat template (vLLM's chat path): null content as ``""``
    and each call ``{"type": "function", "function": {"name", "arguments": <object>}}`` (its ``id``
    kept), so ``| tojson`` and ``arguments is mapping`` in templates see what serving sees."""
    out = {k: v for k, v in msg.items() if k != "tool_calls"}
    out["content"] = msg.get("content") or ""
    if calls:  # an empty list is dropped: templates test ``'tool_calls' in message``
        out["tool_calls"] = [
            {
                **({"id": c["id"]} if c["id"] is not None else {}),
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in calls
        ]
    return out


def render(
    tokenizer: Any,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    **kwargs: Any,
) -> str:
    """The chat-template text of ``messages`` (no tokenization); ``tools``: the tool definitions
    of the conversation (a record's ``tools``), passed to the template when given."""
    if tools:
        kwargs = {**kwargs, "tools": tools}
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
    return text


def special_token_texts(tokenizer: Any) -> dict[str, int]:
    """Text -> id of every added token flagged special (``<|im_end|>``, ``<|eot_id|>``, ...)."""
    return {tok.content: i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}


@dataclass(frozen=True)
class TemplateMarkers:
    """What a chat template writes around assistant contents, found by rendering probes."""

    header: str | None
    """Opens every assistant turn (``<|im_start|>assistant\n``); None when not found."""
    gen_extra: str
    """What the generation prompt adds after ``header`` (Qwen3's empty think block with thinking
    off); the model does not write it, so it is never supervised."""
    end: str | None
    """The special token that closes an assistant content (only whitespace between)."""
    tool_end: str | None = None
    """The first special token after a rendered tool call (what closes a tool-call turn); None
    when the template does not render a probe call (no tool branch, or it raises on one)."""


class Span(NamedTuple):
    """The characters ``[start, end)`` of a supervised assistant turn in the rendered text."""

    start: int
    end: int
    closed: bool = True
    """The target ended the turn itself: the end-of-turn token after ``end`` is supervised too
    (False for a turn marked ``cut_at_max_tokens``)."""


_MARKERS: dict[tuple[int, int, str, str], TemplateMarkers] = {}


def template_markers(tokenizer: Any, **kwargs: Any) -> TemplateMarkers:
    """Cached :func:`_template_markers` (keyed on the tokenizer object, its template and kwargs)."""
    key = (id(tokenizer), len(tokenizer), str(tokenizer.chat_template), repr(sorted(kwargs.items())))
    if key not in _MARKERS:
        _MARKERS[key] = _template_markers(tokenizer, **kwargs)
    return _MARKERS[key]


def _common_prefix(*texts: str) -> str:
    n = 0
    while all(n < len(t) for t in texts) and len({t[n] for t in texts}) == 1:
        n += 1
    return texts[0][:n]


def _template_markers(tokenizer: Any, **kwargs: Any) -> TemplateMarkers:
    """The markers of the template, found by rendering probes.

    The generation prompt G (what ``add_generation_prompt`` appends after a user turn) is compared
    with what precedes an assistant content as the last turn and as an earlier turn; their common
    prefix is the header, the rest of G is ``gen_extra``. Templates that do not expose a marker
    that way get None; callers then fall back to a plain content search.
    """
    user = [{"role": "user", "content": "Hi"}]
    probe = [{"role": "assistant", "content": _PROBE}]

    def attempt(messages: list[dict], **extra: Any) -> str | None:
        try:
            return render(tokenizer, messages, **extra, **kwargs)
        except Exception:  # noqa: BLE001 - a template that rejects a probe just gives no marker
            return None

    bare, gen = attempt(user), attempt(user, add_generation_prompt=True)
    last, mid = attempt(user + probe), attempt(user + probe + user)
    header, extra = None, ""
    if bare is not None and gen is not None and gen.startswith(bare) and gen[len(bare) :].strip():
        g = gen[len(bare) :]
        renders = [r for r in (last, mid) if r is not None and r.startswith(bare) and _PROBE in r]
        before = [r[len(bare) : r.find(_PROBE)] for r in renders]
        h = _common_prefix(g, *before)
        if h.strip():
            header, extra = h, g[len(h) :]
    end = None
    pos = last.rfind(_PROBE) if last is not None else -1
    specials = sorted((t for t in special_token_texts(tokenizer) if t), key=len, reverse=True)
    if last is not None and pos >= 0:
        rest = last[pos + len(_PROBE) :].lstrip()
        end = next((text for text in specials if rest.startswith(text)), None)
    call = {"type": "function", "function": {"name": _PROBE, "arguments": {"q": "x"}}}
    called = attempt(user + [{"role": "assistant", "content": "", "tool_calls": [call]}])
    tool_end = None
    if called is not None and _PROBE in called:
        after = called.rfind(_PROBE) + len(_PROBE)
        found = [(called.find(t, after), -len(t), t) for t in specials if called.find(t, after) >= 0]
        tool_end = min(found)[2] if found else None
    return TemplateMarkers(header, extra, end, tool_end)


def _candidates(content: str) -> list[str]:
    """Forms an assistant content may take in the rendered text, most specific first.

    The content itself, stripped (Llama-3 trims), and the part after ``</think>`` (Qwen3 renders
    only that for assistant turns before the last user query).
    """
    out = [content, content.strip()]
    if "</think>" in content:
        answer = content.split("</think>")[-1]
        out += [answer.lstrip("\n"), answer.strip()]
    seen: list[str] = []
    for c in out:
        if c and c not in seen:
            seen.append(c)
    return seen


def _locate(
    text: str, content: str, start: int, end_marker: str | None, limit: int | None = None
) -> tuple[int, int] | None:
    """Char span of ``content`` in ``text[start:limit]``; prefer an occurrence that is closed by
    ``end_marker`` (whitespace between allowed), so that a short content such as "think" is not
    found inside template boilerplate. Plain ``str.find``: no regex compile."""
    cands = _candidates(content)
    limit = len(text) if limit is None else limit
    if end_marker:
        for c in cands:
            pos = text.find(c, start, limit)
            while pos >= 0:
                after = pos + len(c)
                if text.startswith(end_marker, after) or text[after : after + 64].lstrip().startswith(
                    end_marker
                ):
                    return pos, after
                pos = text.find(c, pos + 1, limit)
    for c in cands:
        pos = text.find(c, start, limit)
        if pos >= 0:
            return pos, pos + len(c)
    return None


def assistant_spans(
    tokenizer: Any,
    messages: Sequence[dict],
    *,
    tools: list[dict] | None = None,
    train_only_last_turn: bool = False,
    **template_kwargs: Any,
) -> tuple[str, list[Span]]:
    """Render ``messages`` (with the conversation's ``tools``) and return ``(text, spans)``: the
    :class:`Span` of each supervised assistant turn in ``text``, in order (only the last one with
    ``train_only_last_turn``). A span starts where the generation prompt ends (after the header
    and ``gen_extra``, see :class:`TemplateMarkers`) and ends with the content, or for a turn with
    tool calls at the special token that closes it; it is open (``closed=False``) for a message
    marked ``cut_at_max_tokens``; empty assistant contents without tool calls have no span.

    Raises :class:`MalformedConversation` on invalid messages, when an assistant content cannot
    be found in the rendered text, or when the template does not render a tool call.
    """
    messages = validate_messages(messages)
    text = render(tokenizer, messages, tools=tools, **template_kwargs)
    marks = template_markers(tokenizer, **template_kwargs)
    spans: list[Span] = []
    cursor = 0
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            limit, start = None, None
            if marks.header:
                pos = text.find(marks.header, cursor)
                if pos >= 0:
                    start = cursor = pos + len(marks.header)
                    if marks.gen_extra and text.startswith(marks.gen_extra, start):
                        start = cursor = start + len(marks.gen_extra)
                    nxt = text.find(marks.header, cursor)  # the content ends before the next assistant turn
                    limit = nxt if nxt >= 0 else None
            closed = msg.get(CUT_AT_MAX_TOKENS) is not True
            if msg.get("tool_calls"):
                end = _tool_call_turn_end(text, i, msg, marks, start, limit)
                spans.append(Span(start if start is not None else end, end, closed))
                cursor = end
                continue
            if not msg["content"].strip():
                continue
            span = _locate(text, msg["content"], cursor, marks.end, limit)
            if span is None:
                raise MalformedConversation(
                    f"assistant message {i} is not in the chat-template text (the template rewrote it)"
                )
            spans.append(Span(span[0] if start is None else start, span[1], closed))
            cursor = span[1]
        elif msg["content"].strip():
            span = _locate(text, msg["content"], cursor, None)
            if span is not None:  # templates may move or drop system prompts: just do not advance
                cursor = span[1]
    if train_only_last_turn:
        spans = spans[-1:]
    return text, spans


def _tool_call_turn_end(
    text: str, i: int, msg: dict, marks: TemplateMarkers, start: int | None, limit: int | None
) -> int:
    """Where assistant message ``i`` (with tool calls, starting at ``start``) ends in ``text``: at
    the special token that closes a tool-call turn, after every call's name in order. Raises
    :class:`MalformedConversation` when the template does not render the calls."""
    if marks.tool_end is None or start is None:
        raise MalformedConversation(
            f"assistant message {i} calls tools but the chat template does not render tool calls "
            "(target.tokenizer's template has no tool-call branch); give the target's own chat template"
        )
    limit = len(text) if limit is None else limit
    pos = start
    for call in msg["tool_calls"]:
        name = call["function"]["name"]
        found = text.find(name, pos, limit)
        if found < 0:
            raise MalformedConversation(
                f"assistant message {i}: the chat template does not render its tool call {name!r} "
                "(target.tokenizer's template dropped it)"
            )
        pos = found + len(name)
    end = text.find(marks.tool_end, pos, limit)
    if end < 0:
        raise MalformedConversation(
            f"assistant message {i}: no {marks.tool_end!r} closes its tool calls in the chat-template text"
        )
    return end


def mask_from_offsets(
    offsets: Sequence[tuple[int, int]] | np.ndarray,
    ids: Sequence[int] | np.ndarray,
    spans: Sequence[Span],
    special_ids: set[int],
    text: str,
) -> np.ndarray:
    """Loss mask, uint8 [len(ids)]: 1 on tokens overlapping a span (zero-width tokens excluded)
    and on the special token that closes each closed span (when only whitespace separates them).

    ``offsets[t] = (start, end)`` is token t's char range in ``text``; spans are sorted char ranges.
    Vectorized per span (two binary searches), so a long sample costs O(len(spans) log L).
    """
    n = len(ids)
    mask = np.zeros(n, dtype=np.uint8)
    if n == 0 or not spans:
        return mask
    off = np.asarray(offsets, dtype=np.int64).reshape(n, 2)
    starts, ends = off[:, 0], np.maximum.accumulate(off[:, 1])
    nonempty = (off[:, 1] > off[:, 0]).astype(np.uint8)
    for s, e, closed in spans:
        t0 = int(np.searchsorted(ends, s, side="right"))  # first token ending after s
        t1 = int(np.searchsorted(starts, e, side="left"))  # first token starting at/after e
        mask[t0:t1] = nonempty[t0:t1]
        if not closed:
            continue
        # the end-of-turn token: the next special token, only whitespace before it
        u = t1
        while u < n and int(ids[u]) not in special_ids and not text[off[u, 0] : off[u, 1]].strip():
            u += 1
        if u < n and int(ids[u]) in special_ids and not text[e : off[u, 0]].strip():
            mask[u] = 1
    return mask


def encode_with_offsets(
    tokenizer: Any, texts: list[str]
) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Batch-tokenize rendered texts (``add_special_tokens=False``): (ids, char offsets) per text."""
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], enc["offset_mapping"]


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    train_only_last_turn: bool = False,
    **template_kwargs: Any,
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (same length) of one conversation.

    ids = tokenization of the chat-template text (``add_special_tokens=False``); mask = 1 on each
    assistant message's content tokens and the end-of-turn token closing it (not for a message
    marked ``cut_at_max_tokens``), 0 on everything else
    (system/user/tool turns, role headers, template boilerplate). ``train_only_last_turn`` keeps
    only the last assistant message. ``template_kwargs`` go to ``apply_chat_template``
    (e.g. ``enable_thinking=False``). Raises :class:`MalformedConversation` (a ``ValueError``).
    """
    text, spans = assistant_spans(
        tokenizer, messages, tools=tools, train_only_last_turn=train_only_last_turn, **template_kwargs
    )
    (ids,), (offsets,) = encode_with_offsets(tokenizer, [text])
    mask = mask_from_offsets(offsets, ids, spans, set(special_token_texts(tokenizer).values()), text)
    return list(ids), mask.tolist()


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The messages before the last assistant message (all of them when there is none)."""
    messages = validate_messages(messages)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    if last == 0:
        raise MalformedConversation("the conversation starts with its only assistant message: no prompt")
    return messages[:last]


def generation_prompt_ids(
    tokenizer: Any, messages: list[dict], *, tools: list[dict] | None = None, **template_kwargs: Any
) -> list[int]:
    """Chat-template ids of all of ``messages`` (and ``tools``) followed by the generation prompt:
    what a server that applies the template feeds the model to write the next assistant turn."""
    text = render(
        tokenizer, validate_messages(messages), add_generation_prompt=True, tools=tools, **template_kwargs
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(
    tokenizer: Any, messages: list[dict], *, tools: list[dict] | None = None, **template_kwargs: Any
) -> list[int]:
    """Chat-template ids of the conversation up to (excluding) the last assistant message, with
    ``add_generation_prompt=True``: what a server sees as the prompt (used by eval and the
    embedded corpus). ``template_kwargs`` go to ``apply_chat_template``."""
    return generation_prompt_ids(tokenizer, prompt_messages(messages), tools=tools, **template_kwargs)
