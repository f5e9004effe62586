"""A minimal client of the OpenAI-compatible chat completions API (vLLM, SGLang, ``transformers serve``).

One request per assistant turn: ``POST <endpoint>/chat/completions`` with the messages so far, the
sampling settings, ``chat_template_kwargs`` (vLLM, SGLang and ``transformers serve`` pass it to the
chat template) and ``extra_body``. Endpoints are used round robin; a retry goes to the next one, so
a dead replica costs retries, not records. Connection errors, timeouts, HTTP 408/409/425/429 and
5xx are retried with exponential backoff and jitter; other HTTP errors (a prompt too long for the
model, an unknown model name) fail the turn at once with the server's message. ``OPENAI_API_KEY``,
when set in the environment, is sent as the bearer token.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
from typing import Any

import httpx

from dflash.data.regenerate.conversation import Reply

RETRY_STATUS = {408, 409, 425, 429}
MAX_BACKOFF_S = 30.0


class RequestFailed(Exception):
    """A turn that could not be generated; ``retryable`` when it failed on the transport or the
    server's load (the record may succeed in a later run)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def parse_reply(body: dict[str, Any]) -> Reply:
    """The :class:`Reply` of a chat completion response body (raises ValueError when malformed)."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"not a chat completion: {str(body)[:300]}") from None
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    usage = body.get("usage") or {}
    return Reply(
        content=message.get("content") or "",
        reasoning=reasoning if isinstance(reasoning, str) and reasoning else None,
        finish_reason=str(choice.get("finish_reason") or "stop"),
        completion_tokens=int(usage.get("completion_tokens") or 0),
    )


class ChatClient:
    """``await complete(messages) -> Reply`` against one or more servers (see the module docstring).

    ``sampling`` holds the request fields (temperature, max_tokens, top_p, seed, ...); use as an
    async context manager (one connection pool for all requests).
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
        self.max_retries, self.backoff_s = max_retries, backoff_s
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
                resp = await self._client.post(url, json=body)
            except httpx.HTTPError as exc:  # connection refused or reset, timeout, protocol error
                error = f"{url}: {type(exc).__name__}: {exc}"
                continue
            if resp.status_code == 200:
                try:
                    reply = parse_reply(resp.json())
                except ValueError as exc:
                    raise RequestFailed(f"{url}: {exc}", retryable=False) from None
                self.requests += 1
                return reply
            error = f"{url}: HTTP {resp.status_code}: {resp.text[:500]}"
            if resp.status_code not in RETRY_STATUS and resp.status_code < 500:
                raise RequestFailed(error, retryable=False)
        raise RequestFailed(f"gave up after {self.max_retries + 1} attempts; last: {error}", retryable=True)
