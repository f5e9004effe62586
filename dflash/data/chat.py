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
"""

from __future__ import annotations

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
    """Check ``messages`` is a non-empty list of ``{"role": str in ROLES, "content": str}`` dicts.

    Returns it as a list (the dicts themselves, extra keys such as ``reasoning_content`` kept for
    the template). Raises :class:`MalformedConversation` naming the first problem.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MalformedConversation("'messages' must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise MalformedConversation(f"message {i} is a {type(msg).__name__}, not an object")
        role = msg.get("role")
        if role not in ROLES:
            raise MalformedConversation(f"message {i} has role {role!r}; expected one of {ROLES}")
        if not isinstance(msg.get("content"), str):
            raise MalformedConversation(
                f"message {i} ({role}) has content of type {type(msg.get('content')).__name__}, not str"
            )
        if not isinstance(msg.get(CUT_AT_MAX_TOKENS, False), bool):
            raise MalformedConversation(
                f"message {i} ({role}) has {CUT_AT_MAX_TOKENS}={msg[CUT_AT_MAX_TOKENS]!r}; expected true or false"
            )
    return list(messages)


def render(
    tokenizer: Any, messages: Sequence[dict], *, add_generation_prompt: bool = False, **kwargs: Any
) -> str:
    """The chat-template text of ``messages`` (no tokenization)."""
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
    if last is not None and pos >= 0:
        rest = last[pos + len(_PROBE) :].lstrip()
        for text in sorted(special_token_texts(tokenizer), key=len, reverse=True):
            if text and rest.startswith(text):
                end = text
                break
    return TemplateMarkers(header, extra, end)


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
    tokenizer: Any, messages: Sequence[dict], *, train_only_last_turn: bool = False, **template_kwargs: Any
) -> tuple[str, list[Span]]:
    """Render ``messages`` and return ``(text, spans)``: the :class:`Span` of each supervised
    assistant turn in ``text``, in order (only the last one with ``train_only_last_turn``). A span
    starts where the generation prompt ends (after the header and ``gen_extra``, see
    :class:`TemplateMarkers`) and ends with the content; it is open (``closed=False``) for a
    message marked ``cut_at_max_tokens``; empty assistant contents have no span.

    Raises :class:`MalformedConversation` on invalid messages or when an assistant content cannot
    be found in the rendered text.
    """
    messages = validate_messages(messages)
    text = render(tokenizer, messages, **template_kwargs)
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
            if not msg["content"].strip():
                continue
            span = _locate(text, msg["content"], cursor, marks.end, limit)
            if span is None:
                raise MalformedConversation(
                    f"assistant message {i} is not in the chat-template text (the template rewrote it)"
                )
            closed = msg.get(CUT_AT_MAX_TOKENS) is not True
            spans.append(Span(span[0] if start is None else start, span[1], closed))
            cursor = span[1]
        elif msg["content"].strip():
            span = _locate(text, msg["content"], cursor, None)
            if span is not None:  # templates may move or drop system prompts: just do not advance
                cursor = span[1]
    if train_only_last_turn:
        spans = spans[-1:]
    return text, spans


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
    tokenizer: Any, messages: list[dict], *, train_only_last_turn: bool = False, **template_kwargs: Any
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
        tokenizer, messages, train_only_last_turn=train_only_last_turn, **template_kwargs
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


def generation_prompt_ids(tokenizer: Any, messages: list[dict], **template_kwargs: Any) -> list[int]:
    """Chat-template ids of all of ``messages`` followed by the generation prompt: what a server
    that applies the template feeds the model to write the next assistant turn."""
    text = render(tokenizer, validate_messages(messages), add_generation_prompt=True, **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, messages: list[dict], **template_kwargs: Any) -> list[int]:
    """Chat-template ids of the conversation up to (excluding) the last assistant message, with
    ``add_generation_prompt=True``: what a server sees as the prompt (used by eval and the
    embedded corpus). ``template_kwargs`` go to ``apply_chat_template``."""
    return generation_prompt_ids(tokenizer, prompt_messages(messages), **template_kwargs)
