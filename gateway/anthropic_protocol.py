"""Anthropic Messages API request models (field names follow Anthropic's API). Unknown fields are
accepted and ignored; what the gateway cannot honour is a 400 naming the field. Requests turn into
the chat messages and sampling fields `CompletionService` already serves. This module imports
neither engines nor billing."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from gateway.errors import InvalidRequest
from gateway.protocol import StrictBool, StrictInt, _Model

MAX_STOP_SEQUENCES = 16  # each is searched for in the generated text; Anthropic sets no small limit


class TextBlock(_Model):
    type: str
    text: str | None = None


def blocks_text(blocks: str | list[TextBlock], param: str) -> str:
    """The text of a content string or of text blocks; any other block type is a 400 naming it."""
    if isinstance(blocks, str):
        return blocks
    pieces = []
    for j, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise InvalidRequest(
                f"content block type {block.type!r} is not supported; only 'text' blocks are",
                param=f"{param}[{j}].type",
            )
        pieces.append(block.text)
    return "".join(pieces)


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class MessagesRequest(_Model):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    max_tokens: StrictInt = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences", max_length=MAX_STOP_SEQUENCES)
    stream: StrictBool | None = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    # What CompletionService reads of every generation request; nothing of an Anthropic body is
    # forwarded to an OpenAI-shaped upstream.
    seed: ClassVar[None] = None
    raw_body: ClassVar[dict[str, Any]] = {}

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("stop sequences must not be empty")
        return value

    def stop_sequences(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def include_usage(self) -> bool:
        return False  # message_start and message_delta always carry usage

    def check_supported(self, passthrough: bool = False) -> None:
        if self.tools:
            raise InvalidRequest("tools are not supported on /v1/messages yet", param="tools")
        if self.tool_choice is not None:
            raise InvalidRequest("tool_choice is not supported on /v1/messages yet", param="tool_choice")
        if self.top_k:
            raise InvalidRequest("top_k is not supported", param="top_k")
        if self.messages[-1].role == "assistant":
            # The chat template would close the assistant turn and start a new one: not a continuation.
            raise InvalidRequest("a final assistant message (prefill) is not supported", param=f"messages[{len(self.messages) - 1}].role")

    def chat_messages(self) -> list[dict[str, str]]:
        return chat_messages(self.system, self.messages)


class CountTokensRequest(_Model):
    """`POST /v1/messages/count_tokens`: what a Messages request's prompt would be, without max_tokens."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Any] | None = None

    def check_supported(self, passthrough: bool = False) -> None:
        if self.tools:
            raise InvalidRequest("tools are not supported on /v1/messages yet", param="tools")

    def chat_messages(self) -> list[dict[str, str]]:
        return chat_messages(self.system, self.messages)


def chat_messages(system: str | list[TextBlock] | None, messages: list[InputMessage]) -> list[dict[str, str]]:
    """The request as chat messages for the model's template: the system prompt first."""
    out = []
    text = blocks_text(system, "system") if system is not None else ""
    if text:
        out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        out.append({"role": m.role, "content": blocks_text(m.content, f"messages[{i}].content")})
    return out
