"""Anthropic Messages API request models (field names follow Anthropic's API). Unknown fields are
accepted and ignored; what the gateway cannot honour is a 400 naming the field. A request becomes
the body of the equivalent chat completion (`chat_body`): the system prompt and messages as chat
messages (an assistant's `tool_use` blocks as its `tool_calls`, a user's `tool_result` blocks as
`tool` messages), `tools` as chat function tools, `tool_choice` as chat's. What the engines take of
a chat completion they take of this request, and what they refuse the same way. This module imports
neither engines nor billing."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from gateway.http.errors import InvalidRequest
from gateway.api.openai.protocol import StrictBool, StrictInt, _Model

MAX_STOP_SEQUENCES = 16  # each is searched for in the generated text; Anthropic sets no small limit
MAX_CACHE_BREAKPOINTS = 4  # Anthropic's limit on blocks with cache_control in one request
ERROR_MARK = "Error: "  # what a tool_result with is_error=true starts with in the tool message the model reads


def cache_control(value: Any, param: str) -> bool:
    """Whether `value` (a block's, a tool's or the request's `cache_control`) marks a breakpoint:
    null is none; else it must be Anthropic's `{"type": "ephemeral", "ttl"?: "5m" | "1h"}` (a 400
    naming the field otherwise). There is no prompt cache to control here: it is accepted and ignored."""
    if value is None:
        return False
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param}: must be an object like {{\"type\": \"ephemeral\"}}", param=param)
    if value.get("type") != "ephemeral":
        raise InvalidRequest(f"{param}.type: Input should be 'ephemeral'", param=f"{param}.type")
    if "ttl" in value and value["ttl"] not in ("5m", "1h"):
        raise InvalidRequest(f"{param}.ttl: Input should be '5m' or '1h'", param=f"{param}.ttl")
    unknown = sorted(set(value) - {"type", "ttl"})
    if unknown:
        raise InvalidRequest(f"{param}.{unknown[0]}: Extra inputs are not permitted", param=f"{param}.{unknown[0]}")
    return True


def _ttl(value: dict[str, Any]) -> str:
    """A checked cache_control's TTL: 5 minutes unless it says otherwise."""
    return value.get("ttl", "5m")


class ContentBlock(_Model):
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: Any = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Any] | None = None  # tool_result
    is_error: StrictBool | None = None  # tool_result: the tool failed; its result reaches the model marked so (ERROR_MARK)
    cache_control: Any = None  # any block: a prompt-cache breakpoint, checked (cache_control) and otherwise ignored


TextBlock = ContentBlock  # what `system` takes (text blocks)


def blocks_text(blocks: str | list[ContentBlock], param: str) -> str:
    """The text of a content string or of text blocks; any other block type is a 400 naming it."""
    if isinstance(blocks, str):
        return blocks
    pieces = []
    for j, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise InvalidRequest(f"content block type {block.type!r} is not supported here; only 'text' blocks are",
                                 param=f"{param}[{j}].type")
        pieces.append(block.text)
    return "".join(pieces)


def _result_text(content: Any, param: str) -> str:
    """A tool_result's content: a string or text blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    pieces = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise InvalidRequest(f"tool_result content block type {kind!r} is not supported; only 'text' blocks are",
                                 param=f"{param}[{k}].type")
        pieces.append(part["text"])
    return "".join(pieces)


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def chat_messages(self, i: int) -> list[dict[str, Any]]:
        """This message as chat messages: an assistant turn with its tool calls, or a user turn's
        tool results (`tool` messages, first, as Anthropic requires them first) and its text."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        param = f"messages[{i}].content"
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(self.content):
            if block.type == "text":
                if not isinstance(block.text, str):
                    raise InvalidRequest("a text block needs its text (a string)", param=f"{param}[{j}].text")
                texts.append(block.text)
            elif block.type == "tool_use" and self.role == "assistant":
                if not block.id or not block.name or not isinstance(block.input, dict):
                    raise InvalidRequest("a tool_use block needs an id, a name and an input object", param=f"{param}[{j}]")
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
            elif block.type == "tool_result" and self.role == "user":
                if not block.tool_use_id:
                    raise InvalidRequest("a tool_result block needs its tool_use_id", param=f"{param}[{j}].tool_use_id")
                text = _result_text(block.content, f"{param}[{j}].content")
                if block.is_error:  # the chat tool message has no error flag: the model reads it in the text
                    text = ERROR_MARK + text if text else ERROR_MARK.rstrip(": ")
                results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
            else:
                allowed = "'text' and 'tool_use'" if self.role == "assistant" else "'text' and 'tool_result'"
                raise InvalidRequest(f"content block type {block.type!r} is not supported in a {self.role} message; only {allowed} blocks are",
                                     param=f"{param}[{j}].type")
        if self.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
            if calls:
                message["tool_calls"] = calls
            return [message]
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def chat_messages(system: str | list[ContentBlock] | None, messages: list[InputMessage]) -> list[dict[str, Any]]:
    """The request as chat messages for the model's template: the system prompt first. Every
    tool_result answers a tool_use made before it."""
    out: list[dict[str, Any]] = []
    text = blocks_text(system, "system") if system is not None else ""
    if text:
        out.append({"role": "system", "content": text})
    called: set[str] = set()
    unanswered: list[str] = []  # the tool_use ids of the message before, which this one must answer
    for i, m in enumerate(messages):
        if not m.content:
            raise InvalidRequest(f"messages[{i}]: all messages must have non-empty content except for the optional "
                                 "final assistant message", param=f"messages[{i}].content")
        blocks = () if isinstance(m.content, str) else m.content
        for j, block in enumerate(blocks):
            if block.type == "text" and block.text == "":
                raise InvalidRequest(f"messages[{i}].content[{j}].text: text content blocks must be non-empty",
                                     param=f"messages[{i}].content[{j}].text")
            if block.type == "text" and block.text is not None and not block.text.strip():
                raise InvalidRequest(f"messages[{i}].content[{j}].text: text content blocks must contain non-whitespace text",
                                     param=f"messages[{i}].content[{j}].text")
        missing = [u for u in unanswered if u not in {b.tool_use_id for b in blocks if b.type == "tool_result"}]
        if missing:
            raise InvalidRequest(f"messages[{i}]: `tool_use` ids were found without `tool_result` blocks immediately after: "
                                 f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` block "
                                 "in the next message.", param=f"messages[{i}].content")
        unanswered = [b.id for b in blocks if b.type == "tool_use" and b.id]
        for message in m.chat_messages(i):
            called.update(c["id"] for c in message.get("tool_calls") or ())
            if message["role"] == "tool" and message["tool_call_id"] not in called:
                raise InvalidRequest(f"tool_result block(s) reference the tool_use id {message['tool_call_id']!r}, "
                                     "which no earlier assistant message has", param=f"messages[{i}].content")
            out.append(message)
    return out


def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Client tools ({name, description, input_schema}) as chat function tools; Anthropic's
    server and built-in tools (web search, bash, text editor, computer use, ...) are a 400."""
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{i}] must be an object", param=f"tools[{i}]")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise InvalidRequest(f"tools[{i}].type {kind!r} is not supported: only client tools (name, description, input_schema) are",
                                 param=f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidRequest(f"tools[{i}].name must be a non-empty string", param=f"tools[{i}].name")
        if not isinstance(tool.get("input_schema"), dict):
            raise InvalidRequest(f"tools[{i}].input_schema must be a JSON schema object", param=f"tools[{i}].input_schema")
        function: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any, tools: list[Any] | None) -> Any:
    """Anthropic's tool_choice as chat's: auto -> auto, any -> required, tool -> that function, none -> none."""
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind in ("any", "tool") and not tools:
        raise InvalidRequest(f"tool_choice {kind!r} needs tools", param="tool_choice")
    if kind == "any":
        return "required"
    if kind == "tool":
        name = choice.get("name")
        if not any(isinstance(t, dict) and t.get("name") == name for t in tools or ()):
            raise InvalidRequest(f"tool_choice names the tool {name!r}, which is not in tools", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise InvalidRequest("tool_choice.type must be one of 'auto', 'any', 'tool', 'none'", param="tool_choice.type")


class _ToolsAndMessages(_Model):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    cache_control: Any = None  # automatic caching: the last cacheable block's breakpoint (checked, ignored)

    thinking: Any = None

    def cache_breakpoints(self) -> int:
        """The request's cache breakpoints, each checked (`cache_control`): the blocks that carry one
        (system, message and tool_result content blocks, tools) and the request's own (automatic
        caching). Anthropic's prompt-caching guide, "Combining with block-level caching": the automatic
        breakpoint goes on the last cacheable block (tools, system, then messages: the last message's
        last block here, every one of which is cacheable) and "uses one of the 4 available breakpoint
        slots"; a last block already marked with the same TTL makes it a no-op (no slot), with another
        TTL it is a 400, and with 4 block-level breakpoints already there it is a 400 ("no slots left
        for automatic caching"). More than 4 is Anthropic's 400."""
        automatic = cache_control(self.cache_control, "cache_control")
        marked: list[tuple[Any, str]] = []
        if isinstance(self.system, list):
            marked += [(b.cache_control, f"system[{j}].cache_control") for j, b in enumerate(self.system)]
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.content if isinstance(m.content, list) else ()):
                marked.append((b.cache_control, f"messages[{i}].content[{j}].cache_control"))
                parts = b.content if b.type == "tool_result" and isinstance(b.content, list) else ()
                marked += [(p.get("cache_control"), f"messages[{i}].content[{j}].content[{k}].cache_control")
                           for k, p in enumerate(parts) if isinstance(p, dict)]
        marked += [(t.get("cache_control"), f"tools[{i}].cache_control") for i, t in enumerate(self.tools or ()) if isinstance(t, dict)]
        found = sum(cache_control(value, param) for value, param in marked)
        slot = False  # the automatic breakpoint takes a slot of its own
        if automatic:
            i, last = len(self.messages) - 1, self.messages[-1].content
            mark = last[-1].cache_control if isinstance(last, list) and last else None  # a string is one unmarked text block
            if mark is not None and _ttl(mark) != _ttl(self.cache_control):
                raise InvalidRequest(f"cache_control: the automatic cache breakpoint (ttl {_ttl(self.cache_control)!r}) falls on "
                                     f"messages[{i}].content[{len(last) - 1}], whose cache_control has another ttl "
                                     f"({_ttl(mark)!r})", param="cache_control")
            slot = mark is None
            found += slot
        if found > MAX_CACHE_BREAKPOINTS:
            taken = " (the request's cache_control, automatic caching, takes one: no slot is left for it)" if slot else ""
            raise InvalidRequest(f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. Found {found}.{taken}",
                                 param="cache_control")
        return found

    def check_supported(self, passthrough: bool = False) -> None:
        """What a Messages request refuses of its prompt, which count_tokens refuses the same way."""
        thinking = self.thinking.get("type") if isinstance(self.thinking, dict) else self.thinking
        if thinking not in (None, "disabled", "adaptive"):  # adaptive: the model decides, and this one does not think
            raise InvalidRequest("extended thinking is not supported by this model; leave thinking out or send "
                                 "{\"type\": \"disabled\"}", param="thinking")
        if self.messages[-1].role == "assistant":
            # The chat template would close the assistant turn and start a new one: not a continuation.
            raise InvalidRequest("a final assistant message (prefill) is not supported", param=f"messages[{len(self.messages) - 1}].role")
        if self.tools:
            chat_tools(self.tools)
        chat_tool_choice(self.tool_choice, self.tools)
        self.chat_messages()
        self.cache_breakpoints()

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_messages(self.system, self.messages)

    def chat_body(self) -> dict[str, Any]:
        """The equivalent chat completion (without its sampling fields)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages()}
        if self.tools:
            body["tools"] = chat_tools(self.tools)
        choice = chat_tool_choice(self.tool_choice, self.tools)
        if choice is not None:
            body["tool_choice"] = choice
        if isinstance(self.tool_choice, dict) and self.tool_choice.get("disable_parallel_tool_use") is True:
            body["parallel_tool_calls"] = False  # at most one call
        return body


class Metadata(_Model):
    """Anthropic's request metadata: only `user_id` (an opaque string, at most 256 characters)."""

    model_config = ConfigDict(extra="forbid")
    user_id: str | None = Field(default=None, max_length=256)


class MessagesRequest(_ToolsAndMessages):
    max_tokens: StrictInt = Field(ge=1)
    stop: list[str] | None = Field(default=None, alias="stop_sequences", max_length=MAX_STOP_SEQUENCES)
    stream: StrictBool | None = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    output_config: Any = None
    # Priority capacity if there is some ("auto") or standard only: there is none here, so every
    # request runs at the standard tier (a batch's line at the batch tier) and usage.service_tier says so.
    service_tier: Literal["auto", "standard_only"] | None = None
    _chat: dict[str, Any] = PrivateAttr(default_factory=dict)

    # What CompletionService reads of every generation request.
    seed: ClassVar[None] = None

    @property
    def raw_body(self) -> dict[str, Any]:
        """What the engine gets as the client's body: the equivalent chat completion's."""
        return self._chat

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("stop sequences must not be empty")
        if value is not None and any(not s.strip() for s in value):
            raise ValueError("each stop sequence must contain non-whitespace")
        return value

    def stop_sequences(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def include_usage(self) -> bool:
        return False  # message_start and message_delta always carry usage

    def check_supported(self, passthrough: bool = False) -> None:
        if self.top_k:
            raise InvalidRequest("top_k is not supported", param="top_k")
        self.response_format()
        super().check_supported(passthrough)

    def response_format(self) -> dict[str, Any] | None:
        """output_config's JSON schema (Anthropic's structured outputs) as chat's response_format;
        its `effort` concerns thinking, which this model does not do."""
        config = self.output_config
        if config is None:
            return None
        if not isinstance(config, dict) or not set(config) <= {"format", "effort"}:
            raise InvalidRequest("output_config must be an object with format and effort", param="output_config")
        if config.get("effort") not in (None, "low", "medium", "high", "xhigh", "max"):
            raise InvalidRequest("output_config.effort must be one of low, medium, high, xhigh, max", param="output_config.effort")
        fmt = config.get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}", param="output_config.format")
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}

    def chat_body(self) -> dict[str, Any]:
        body = super().chat_body()
        body.update(max_tokens=self.max_tokens, stream=bool(self.stream))
        fmt = self.response_format()
        if fmt is not None:
            body["response_format"] = fmt
        optional = {"temperature": self.temperature, "top_p": self.top_p, "stop": list(self.stop) if self.stop else None}
        body.update((k, v) for k, v in optional.items() if v is not None)
        self._chat = body
        return body


class CountTokensRequest(_ToolsAndMessages):
    """`POST /v1/messages/count_tokens`: what a Messages request's prompt would be, without max_tokens."""
