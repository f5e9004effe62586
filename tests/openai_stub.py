"""A tiny OpenAI-compatible chat completions server for fast tests (no model): in a thread, on 127.0.0.1.

Its reply to a conversation is deterministic and shows what it was given:
``"<last user content> | turn <number of assistant messages so far>"``. Tests can make it fail
(``fail_next`` requests answer 503, ``reject`` contents answer 400), read every request body and
its headers, and script hostile behaviour with ``respond``: a function of (request body, request
headers) that returns a :class:`StubResponse` (any status, any bytes, sent one byte at a time with
``trickle_s`` between bytes) or None for the normal reply.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def stub_reply(messages: list[dict]) -> str:
    last_user = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    return f"{last_user} | turn {sum(m['role'] == 'assistant' for m in messages)}"


def completion(message: Any, *, finish_reason: Any = "stop", usage: Any = None) -> dict[str, Any]:
    """A chat completion response body around ``message`` (any JSON value, to craft bad shapes)."""
    usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4} if usage is None else usage
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish_reason}], "usage": usage}


@dataclass
class StubResponse:
    """What the stub sends: ``body`` as JSON (a dict or list) or as raw bytes/text."""

    status: int = 200
    body: Any = None
    trickle_s: float = 0.0
    """Seconds between bytes of the body (0: all at once)."""
    content_length: bool = True
    """Send a Content-Length header (else the connection is closed after the body)."""

    def data(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        if isinstance(self.body, str):
            return self.body.encode("utf-8", "surrogatepass")
        return json.dumps(self.body).encode()


Respond = Callable[[dict[str, Any], dict[str, str]], "StubResponse | None"]


class OpenAIStub:
    """``with OpenAIStub() as stub: stub.url`` is the base URL (``http://127.0.0.1:<port>/v1``)."""

    def __init__(self, reasoning: str | None = None, respond: Respond | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.fail_next = 0
        self.reject: set[str] = set()
        self.reasoning = reasoning
        self.respond = respond
        self._lock = threading.Lock()
        self._closed = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                headers = {k: v for k, v in self.headers.items()}
                with stub._lock:
                    stub.requests.append(body)
                    stub.headers.append(headers)
                    failing = stub.fail_next > 0
                    stub.fail_next -= failing
                scripted = stub.respond(body, headers) if stub.respond is not None else None
                try:
                    self._send(scripted or stub._default(body, failing))
                except (BrokenPipeError, ConnectionResetError):  # the client gave up: fine
                    pass

            def _send(self, out: StubResponse) -> None:
                data = out.data()
                self.send_response(out.status)
                self.send_header("Content-Type", "application/json")
                if out.content_length:
                    self.send_header("Content-Length", str(len(data)))
                else:
                    self.close_connection = True
                self.end_headers()
                if not out.trickle_s:
                    self.wfile.write(data)
                    return
                for i in range(len(data)):
                    if stub._closed.wait(out.trickle_s):
                        return
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _default(self, body: dict[str, Any], failing: bool) -> StubResponse:
        last = body["messages"][-1]["content"]
        if failing:
            return StubResponse(503, {"error": "busy"})
        if last in self.reject:
            return StubResponse(400, {"error": "prompt rejected"})
        message = {"role": "assistant", "content": stub_reply(body["messages"])}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        return StubResponse(200, completion(message))

    def __enter__(self) -> OpenAIStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll ``predicate`` every 20 ms until it holds; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not true after {timeout_s} s"
        time.sleep(0.02)
