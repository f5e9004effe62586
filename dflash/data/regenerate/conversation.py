"""One record's turn-by-turn regeneration, independent of how a turn is generated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash.data.chat import CUT_AT_MAX_TOKENS, MalformedConversation


@dataclass(frozen=True)
class Reply:
    """One generated assistant turn."""

    content: str
    reasoning: str | None = None
    """Reasoning the server returned separately (``reasoning_content``/``reasoning``), if any."""
    finish_reason: str = "stop"
    """``stop`` (end of turn), ``length`` (cut at max_tokens), or what the server says."""
    completion_tokens: int = 0


@dataclass
class Regeneration:
    """The regeneration of one conversation: :attr:`prompt` is the conversation to answer next
    (None when done); :meth:`answer` records the reply and moves on.

    Every assistant message of ``source`` is replaced, in order, by a reply generated from the
    messages before it with the earlier assistant turns already replaced; a conversation that ends
    with a user message gets a reply appended. Other messages are kept as they are. A reply cut at
    ``max_tokens`` (finish reason ``length``) is marked ``"cut_at_max_tokens": true``: the target
    never wrote its end-of-turn token, so training does not supervise it.
    """

    source: list[dict]
    keep_reasoning: bool = True
    conversation: list[dict] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    _pos: int = 0

    def __post_init__(self) -> None:
        for i, msg in enumerate(self.source):
            if msg.get("tool_calls"):  # its results came from tools that are not run here
                raise MalformedConversation(
                    f"message {i} calls tools: regenerate does not run tools, so a conversation with tool "
                    "calls cannot be regenerated turn by turn; train on it as it is (data.path)"
                )
            try:
                msg["content"].encode("utf-8")
            except UnicodeEncodeError as exc:  # e.g. a lone surrogate: no server or JSON line can carry it
                raise MalformedConversation(f"message {i} is not valid Unicode ({exc.reason})") from None
        self._copy_until_assistant()
        if self.prompt is None and not self.replies:
            raise MalformedConversation("no assistant turn and no final user turn: nothing to generate")

    def _copy_until_assistant(self) -> None:
        while self._pos < len(self.source) and self.source[self._pos]["role"] != "assistant":
            self.conversation.append(self.source[self._pos])
            self._pos += 1

    @property
    def prompt(self) -> list[dict] | None:
        """The messages the next assistant turn answers, as sent to a server (role and content
        only: templates drop the reasoning of earlier turns anyway), or None when done."""
        at_assistant = self._pos < len(self.source)
        ends_with_user = bool(self.conversation) and self.conversation[-1]["role"] == "user"
        if not (at_assistant or ends_with_user):
            return None
        if not any(m["role"] == "user" for m in self.conversation):
            raise MalformedConversation(f"assistant message {self._pos} has no user message before it")
        return [{"role": m["role"], "content": m["content"]} for m in self.conversation]

    def answer(self, reply: Reply) -> None:
        """Append ``reply`` as the next assistant turn (replacing the source's, if any)."""
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if self.keep_reasoning and reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.finish_reason == "length":
            message[CUT_AT_MAX_TOKENS] = True
        self.conversation.append(message)
        self.replies.append(reply)
        if self._pos < len(self.source):
            self._pos += 1
        self._copy_until_assistant()
