"""OpenAI Responses API request model (`POST /v1/responses`; field names follow OpenAI's API).

Unknown fields are accepted and ignored; what the embedded engines cannot honour yet (tools,
`text.format` json_schema/json_object, background mode, prompt templates, conversations) is a 400
naming the field. The request turns into the chat messages and sampling fields `CompletionService`
already serves. This module imports neither engines nor billing."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator

from gateway.errors import InvalidRequest
from gateway.protocol import StrictBool, StrictInt, _Model

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")  # output_text: an earlier response's output passed back


def input_messages(value: str | list[Any]) -> list[dict[str, str]]:
    """`input` as chat messages ({role, content}); anything but text messages is a 400 naming it."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object (a message item)", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind != "message":
            raise InvalidRequest(
                f"input item type {kind!r} is not supported; only 'message' items with text content are", param=f"input[{i}].type"
            )
        role = item.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"input[{i}].role must be one of {', '.join(ROLES)}", param=f"input[{i}].role")
        content = item.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            pieces = []
            for j, part in enumerate(content):
                ptype = part.get("type") if isinstance(part, dict) else None
                if ptype not in TEXT_PARTS or not isinstance(part.get("text"), str):
                    raise InvalidRequest(
                        f"content part type {ptype!r} is not supported; only 'input_text' parts are",
                        param=f"input[{i}].content[{j}].type",
                    )
                pieces.append(part["text"])
            text = "".join(pieces)
        else:
            raise InvalidRequest(f"input[{i}].content must be a string or a list of input_text parts", param=f"input[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out


class ResponsesRequest(_Model):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stream: StrictBool | None = False
    metadata: dict[str, str] | None = None
    store: StrictBool | None = True
    previous_response_id: str | None = None
    user: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    text: dict[str, Any] | None = None
    background: StrictBool | None = None
    prompt: Any = None
    conversation: Any = None
    top_logprobs: StrictInt | None = None

    # What CompletionService reads of every generation request; nothing of a Responses body is
    # forwarded to an OpenAI-shaped upstream.
    seed: ClassVar[None] = None
    raw_body: ClassVar[dict[str, Any]] = {}

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if len(value) > 16:
                raise ValueError("at most 16 metadata pairs are allowed")
            if any(len(k) > 64 or len(v) > 512 for k, v in value.items()):
                raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return value

    def stop_sequences(self) -> tuple[str, ...]:
        return ()

    def include_usage(self) -> bool:
        return False  # response.completed always carries usage

    def check_supported(self, passthrough: bool = False) -> None:
        if isinstance(self.input, list) and not self.input:
            raise InvalidRequest("input must not be empty", param="input")
        if self.tools:
            raise InvalidRequest("tools are not supported on /v1/responses yet", param="tools", code="unsupported_parameter")
        if self.tool_choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice is not supported on /v1/responses yet", param="tool_choice", code="unsupported_parameter")
        fmt = (self.text or {}).get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise InvalidRequest(
                f"text.format {kind!r} is not supported by this model yet; only 'text' is", param="text.format", code="unsupported_parameter"
            )
        if self.background:
            raise InvalidRequest("background mode is not supported", param="background", code="unsupported_parameter")
        if self.prompt is not None:
            raise InvalidRequest("prompt templates are not supported", param="prompt", code="unsupported_parameter")
        if self.conversation is not None:
            raise InvalidRequest("conversations are not supported; use previous_response_id", param="conversation", code="unsupported_parameter")
        if self.top_logprobs:
            raise InvalidRequest("logprobs are not supported", param="top_logprobs", code="unsupported_parameter")
        input_messages(self.input)  # every item is a text message, or a 400 naming it

    def input_messages(self) -> list[dict[str, str]]:
        return input_messages(self.input)

    def chat_messages(self, history: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
        """What the model sees: this request's instructions, the earlier turns, then its input."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return out + list(history or ()) + self.input_messages()
