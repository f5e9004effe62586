"""A tiny OpenAI-compatible chat completions server for fast tests (no model): in a thread, on 127.0.0.1.

Its reply to a conversation is deterministic and shows what it was given:
``"<last user content> | turn <number of assistant messages so far>"``. Tests can make it fail
(``fail_next`` requests answer 503, ``reject`` contents answer 400) and read every request body.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def stub_reply(messages: list[dict]) -> str:
    last_user = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    return f"{last_user} | turn {sum(m['role'] == 'assistant' for m in messages)}"


class OpenAIStub:
    """``with OpenAIStub() as stub: stub.url`` is the base URL (``http://127.0.0.1:<port>/v1``)."""

    def __init__(self, reasoning: str | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_next = 0
        self.reject: set[str] = set()
        self.reasoning = reasoning
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub._lock:
                    stub.requests.append(body)
                    failing = stub.fail_next > 0
                    stub.fail_next -= failing
                last = body["messages"][-1]["content"]
                if failing or last in stub.reject:
                    code, out = (503, {"error": "busy"}) if failing else (400, {"error": "prompt rejected"})
                else:
                    message = {"role": "assistant", "content": stub_reply(body["messages"])}
                    if stub.reasoning:
                        message["reasoning_content"] = stub.reasoning
                    code, out = (
                        200,
                        {
                            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
                        },
                    )
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OpenAIStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
