"""A minimal client of the OpenAI-compatible chat completions API (vLLM, SGLang, ``transformers serve``).

One request per assistant turn: ``POST <endpoint>/chat/completions`` with the messages so far, the
sampling settings, ``chat_template_kwargs`` (vLLM, SGLang and ``transformers serve`` pass it to the
chat template) and ``extra_body``. Endpoints are used round robin; a retry goes to the next one, so
a dead replica costs retries, not records. ``OPENAI_API_KEY``, when set in the environment, is
sent as the bearer token.

What a server can do to a request, and what it costs (:class:`RequestFailed` ``kind``):
- ``request_error``: connection errors, HTTP 408/409/425/429 and 5xx, and no complete reply within
  ``timeout_s`` (a *total* deadline per attempt: a server that trickles bytes cannot hold a request
  longer), retried with exponential backoff and jitter;
- ``rejected``: other HTTP 4xx (a prompt too long for the model), and every reply that is not a
  usable chat completion (:func:`parse_reply`: bad JSON or shape, content that is not a string, a
  tool call, invalid Unicode, more tokens or text than ``max_tokens`` allows); not retried;
- ``refused``: HTTP 401, 403 and 404 (the key, the endpoint URL or the model name is wrong): every
  other request would get the same answer, so the caller stops the run.

A reply is read up to :func:`max_reply_bytes` (bounded by ``max_tokens``), so a server answering
with 50 MB costs a bounded read, not memory. Every error message has the environment's secrets
redacted (a server may echo the ``Authorization`` header).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
from typing import Any

import httpx

from dflash.config.secrets import redact
from dflash.data.regenerate.conversation import Reply

RETRY_STATUS = {408, 409, 425, 429}
REFUSED_STATUS = {
    401: "the server refused the credentials: set OPENAI_API_KEY to a key it accepts",
    403: "the server forbids this request with these credentials: check OPENAI_API_KEY and model=",
    404: "no such endpoint or model: check endpoint= (the base URL, ending in /v1) and model= "
    "(a name the server lists at <endpoint>/models)",
}
MAX_BACKOFF_S = 30.0
FINISH_REASONS = ("stop", "length")
MAX_CHARS_PER_TOKEN = 32
"""A reply with more characters (content + reasoning) than this many per token of ``max_tokens``
did not come from ``max_tokens`` tokens: no tokenizer packs that much real text into a token."""
_MAX_ERROR_CHARS = 500

logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the log


def max_reply_bytes(max_tokens: int) -> int:
    """Bytes of a reply body read at most: content and reasoning of ``MAX_CHARS_PER_TOKEN *
    max_tokens`` characters each, each character JSON-escaped to at most 6 bytes (``\\uXXXX``), plus
    1 MiB for the rest of the body."""
    return (1 << 20) + 2 * 6 * MAX_CHARS_PER_TOKEN * max_tokens


class RequestFailed(Exception):
    """A turn that could not be generated; ``kind`` is ``request_error``, ``rejected`` or
    ``refused`` (see the module docstring). The message has every secret redacted."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(redact(message))
        self.kind = kind

    @property
    def retryable(self) -> bool:
        """The record may succeed in a later run (transport or load)."""
        return self.kind == "request_error"

    @property
    def refused(self) -> bool:
        """Every request would fail the same way: stop the run."""
        return self.kind == "refused"


class BadReply(ValueError):
    """A response that is not a usable chat completion (the message says why)."""


def _text_field(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadReply(f"{name} is not a string ({type(value).__name__}: {str(value)[:100]})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in the JSON): no file can hold it
        raise BadReply(f"{name} is not valid Unicode ({exc.reason} at character {exc.start})") from None
    return value


def _completion_tokens(usage: Any) -> int:
    if usage is None:
        return 0
    if not isinstance(usage, dict):
        raise BadReply(f"usage is not an object ({type(usage).__name__}: {str(usage)[:100]})")
    n = usage.get("completion_tokens")
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise BadReply(f"usage.completion_tokens={n!r} is not a count")
    return n


def parse_reply(body: Any, max_tokens: int) -> Reply:
    """The :class:`Reply` of a decoded chat completion response body; raises :class:`BadReply`
    when it is not one a dataset can hold (see the module docstring). A missing ``content`` is an
    empty turn; a missing ``finish_reason`` counts as ``stop``."""
    choices = body.get("choices") if isinstance(body, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise BadReply(f"not a chat completion (choices[0].message is not an object): {str(body)[:300]}")
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    if message.get("tool_calls") or finish == "tool_calls":
        raise BadReply("the reply is a tool call, not text (regeneration sends no tools)")
    if finish is not None and finish not in FINISH_REASONS:
        raise BadReply(f"finish_reason={str(finish)[:100]!r}: not a whole or length-cut turn")
    content = _text_field(message.get("content"), "content") or ""
    reasoning = _text_field(message.get("reasoning_content"), "reasoning_content") or _text_field(
        message.get("reasoning"), "reasoning"
    )
    tokens = _completion_tokens(body.get("usage"))
    if tokens > max_tokens:
        raise BadReply(f"usage.completion_tokens={tokens} for max_tokens={max_tokens}")
    chars = len(content) + len(reasoning or "")
    if chars > MAX_CHARS_PER_TOKEN * max_tokens:
        raise BadReply(
            f"{chars} characters for max_tokens={max_tokens} (more than {MAX_CHARS_PER_TOKEN} per token): "
            "the server did not apply max_tokens"
        )
    return Reply(
        content=content, reasoning=reasoning or None, finish_reason=finish or "stop", completion_tokens=tokens
    )


def decode_body(data: bytes) -> Any:
    """The JSON value of a response body; raises :class:`BadReply` (not JSON, or nested too deep)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadReply(f"the body is not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None


class _TooLarge(Exception):
    pass


class ChatClient:
    """``await complete(messages) -> Reply`` against one or more servers (see the module docstring).

    ``sampling`` holds the request fields (temperature, max_tokens, top_p, seed, ...;
    ``max_tokens`` is required: it bounds the replies); use as an async context manager (one
    connection pool for all requests).
    """

    def __init__(
        self,
        endpoints: list[str],
        model: str,
        sampling: dict[str, Any],
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
        extra_body: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 8,
        backoff_s: float = 1.0,
        max_connections: int = 64,
    ) -> None:
        self._urls = itertools.cycle([f"{e.rstrip('/')}/chat/completions" for e in endpoints])
        self._body = {"model": model, **sampling, **(extra_body or {})}
        if chat_template_kwargs:
            self._body["chat_template_kwargs"] = dict(chat_template_kwargs)
        self.max_tokens = int(sampling["max_tokens"])
        self.max_bytes = max_reply_bytes(self.max_tokens)
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        headers = (
            {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
            if os.environ.get("OPENAI_API_KEY")
            else {}
        )
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self.requests = 0
        """Successful requests so far."""

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def _post(self, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """(status, body) of one attempt, within the total deadline; the body read stops at
        ``max_bytes`` (:class:`_TooLarge`)."""
        async with asyncio.timeout(self.timeout_s), self._client.stream("POST", url, json=body) as resp:
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > self.max_bytes:
                    raise _TooLarge
                chunks.append(chunk)
            return resp.status_code, b"".join(chunks)

    async def complete(self, messages: list[dict]) -> Reply:
        """The next assistant turn after ``messages``; raises :class:`RequestFailed`."""
        body = {**self._body, "messages": messages}
        error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
                await asyncio.sleep(delay * (0.5 + random.random()))
            url = next(self._urls)
            try:
                status, data = await self._post(url, body)
            except TimeoutError:
                error = f"{url}: no complete reply within request_timeout_s={self.timeout_s:g}"
                continue
            except httpx.HTTPError as exc:  # connection refused or reset, protocol error
                error = f"{url}: {type(exc).__name__}: {exc}"
                continue
            except _TooLarge:
                raise RequestFailed(
                    f"{url}: the reply is over {self.max_bytes} bytes, more than max_tokens={self.max_tokens} "
                    "tokens can take",
                    kind="rejected",
                ) from None
            if status == 200:
                try:
                    reply = parse_reply(decode_body(data), self.max_tokens)
                except BadReply as exc:
                    raise RequestFailed(f"{url}: bad reply: {exc}", kind="rejected") from None
                self.requests += 1
                return reply
            text = data.decode("utf-8", "replace")[:_MAX_ERROR_CHARS]
            error = f"{url}: HTTP {status}: {text}"
            if status in REFUSED_STATUS:
                raise RequestFailed(f"{error} ({REFUSED_STATUS[status]})", kind="refused")
            if status not in RETRY_STATUS and status < 500:
                raise RequestFailed(error, kind="rejected")
        raise RequestFailed(
            f"gave up after {self.max_retries + 1} attempts; last: {error}", kind="request_error"
        )
