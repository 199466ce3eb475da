"""OpenAI Responses API request model (`POST /v1/responses`; field names follow OpenAI's API).

Unknown fields are accepted and ignored. A request becomes the body of the equivalent chat
completion (`chat_body`): its instructions, earlier turns and input as chat messages (a
`function_call` item becomes an assistant message's `tool_calls`, a `function_call_output` a `tool`
message), function tools as chat tools, `tool_choice`, and `text.format` as `response_format`. What
the engines take of a chat completion they take of this request, and what they refuse the same way.
What the Responses API has and chat has not (built-in tools such as web search, background mode,
prompt templates, conversations) is a 400 naming the field. This module imports neither engines nor
billing."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator

from gateway.http.errors import InvalidRequest
from gateway.api.openai.protocol import StrictBool, StrictInt, _Model

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")  # output_text: an earlier response's output passed back
TOOL_CHOICES = ("auto", "none", "required")
MIN_OUTPUT_TOKENS = 16  # the Responses API refuses a smaller max_output_tokens (chat's max_tokens takes 1)
# What `include` may ask for (the SDK's ResponseIncludable): the logprobs are not given (as top_logprobs);
# the rest belong to tools and inputs this gateway refuses, or to reasoning it has none of: nothing to add.
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              "reasoning.encrypted_content", "message.output_text.logprobs")


def _text(content: Any, param: str) -> str:
    """A message's (or a function call output's) text: a string or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{param} must be a string or a list of input_text parts", param=param)
    pieces = []
    for j, part in enumerate(content):
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype not in TEXT_PARTS:
            raise InvalidRequest(f"content part type {ptype!r} is not supported; only 'input_text' parts are", param=f"{param}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{param}[{j}].text must be a string", param=f"{param}[{j}].text", code="missing_required_parameter")
        pieces.append(part["text"])
    return "".join(pieces)


def _string(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (name != "arguments" and not value):
        raise InvalidRequest(f"input[{i}].{name} must be a non-empty string" if name != "arguments" else
                             f"input[{i}].arguments must be a string (the call's JSON arguments)", param=f"input[{i}].{name}")
    return value


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """`input` as chat messages: message items as {role, content}, function calls as an assistant
    message's `tool_calls` (consecutive calls, and an assistant message just before them, make one
    turn), function call outputs as `tool` messages. Any other item is a 400 naming it."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object (a message item)", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequest(f"input[{i}].role must be one of {', '.join(ROLES)}", param=f"input[{i}].role")
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": _text(item.get("output"), f"input[{i}].output")})
        else:
            raise InvalidRequest(
                f"input item type {kind!r} is not supported; only 'message', 'function_call' and 'function_call_output' items are",
                param=f"input[{i}].type",
            )
    return out


def check_call_outputs(messages: list[dict[str, Any]], value: str | list[Any]) -> None:
    """Every function_call_output answers a function call made before it (in this input or an
    earlier turn), as OpenAI requires."""
    if isinstance(value, str):
        return
    called = {c["id"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or ()}
    for i, item in enumerate(value):
        if isinstance(item, dict) and item.get("type") == "function_call_output" and item.get("call_id") not in called:
            raise InvalidRequest(f"No tool call found for function call output with call_id {item.get('call_id')!r}.",
                                 param=f"input[{i}].call_id")


def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Function tools in chat's shape; any other tool type (web_search, file_search, computer use,
    MCP, ...) is a 400 naming it."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequest(
                f"tools[{i}] has type {kind!r}: only function tools are supported (built-in tools such as web_search, "
                "file_search, code_interpreter, computer_use and mcp are not)", param="tools", code="unsupported_parameter")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tools[{i}].name must be a non-empty string", param=f"tools[{i}].name")
        function: dict[str, Any] = {"name": name}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequest(f"tools[{i}].parameters must be a JSON schema object", param=f"tools[{i}].parameters")
        if parameters is not None:
            function["parameters"] = parameters
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def response_format(fmt: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise InvalidRequest("text.format.name must be a non-empty string", param="text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format.schema must be a JSON schema object", param="text.format.schema")
        schema: dict[str, Any] = {"name": fmt["name"], "schema": fmt["schema"]}
        for name, kind_of in (("strict", bool), ("description", str)):
            if isinstance(fmt.get(name), kind_of):
                schema[name] = fmt[name]
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest(f"text.format type {kind!r} is not supported; 'text', 'json_object' and 'json_schema' are",
                         param="text.format", code="unsupported_parameter")


class ResponsesRequest(_Model):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, json_schema_extra={"minimum": MIN_OUTPUT_TOKENS})  # checked in check_supported
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stream: StrictBool | None = False
    metadata: dict[str, str] | None = None
    store: StrictBool | None = True
    previous_response_id: str | None = None
    user: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    background: StrictBool | None = None
    prompt: Any = None
    conversation: Any = None
    top_logprobs: StrictInt | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    _chat: dict[str, Any] = PrivateAttr(default_factory=dict)  # the equivalent chat completion body (`chat_body`)

    # What CompletionService reads of every generation request.
    seed: ClassVar[None] = None

    @property
    def raw_body(self) -> dict[str, Any]:
        """What the engine gets as the client's body: the equivalent chat completion's."""
        return self._chat

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
        if self.max_output_tokens is not None and self.max_output_tokens < MIN_OUTPUT_TOKENS:  # OpenAI's own words and code
            raise InvalidRequest(f"Invalid 'max_output_tokens': integer below minimum value. Expected a value >= {MIN_OUTPUT_TOKENS}, "
                                 f"but got {self.max_output_tokens} instead.", param="max_output_tokens", code="integer_below_min_value")
        if isinstance(self.input, list) and not self.input:
            raise InvalidRequest("input must not be empty", param="input")
        if self.background:
            raise InvalidRequest("background mode is not supported", param="background", code="unsupported_parameter")
        if self.prompt is not None:
            raise InvalidRequest("prompt templates are not supported", param="prompt", code="unsupported_parameter")
        if self.conversation is not None:
            raise InvalidRequest("conversations are not supported; use previous_response_id", param="conversation", code="unsupported_parameter")
        if self.top_logprobs:
            raise InvalidRequest("logprobs are not supported", param="top_logprobs", code="unsupported_parameter")
        for i, part in enumerate(self.include or ()):
            if part not in INCLUDABLE:
                raise InvalidRequest(f"include[{i}] {part!r} is not one of {', '.join(INCLUDABLE)}", param=f"include[{i}]", code="invalid_value")
            if part == "message.output_text.logprobs":
                raise InvalidRequest("logprobs are not supported", param=f"include[{i}]", code="unsupported_parameter")
        self.chat_tools()
        self.chat_tool_choice()
        self.response_format()
        input_messages(self.input)  # every item is a message, a function call or its output, or a 400 naming it

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return chat_tools(self.tools) if self.tools else None

    def chat_tool_choice(self) -> Any:
        """`tool_choice` in chat's shape: auto | none | required | {"type": "function", "function": {"name"}}."""
        choice = self.tool_choice
        if choice is None or choice in TOOL_CHOICES:
            if choice == "required" and not self.tools:
                raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            name = choice.get("name")
            if not any(isinstance(t, dict) and t.get("name") == name for t in self.tools or ()):
                raise InvalidRequest(f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
            return {"type": "function", "function": {"name": name}}
        kind = choice.get("type") if isinstance(choice, dict) else choice
        raise InvalidRequest(f"tool_choice {kind!r} is not supported; 'auto', 'none', 'required' or a function tool are",
                             param="tool_choice", code="unsupported_parameter")

    def response_format(self) -> dict[str, Any] | None:
        return response_format((self.text or {}).get("format"))

    def input_messages(self) -> list[dict[str, Any]]:
        return input_messages(self.input)

    def chat_messages(self, history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """What the model sees: this request's instructions, the earlier turns, then its input."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return out + list(history or ()) + self.input_messages()

    def chat_body(self, history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The equivalent chat completion (also what `raw_body` answers from here on)."""
        messages = self.chat_messages(history)
        check_call_outputs(messages, self.input)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": bool(self.stream)}
        optional = {"max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p, "user": self.user,
                    "tools": self.chat_tools(), "tool_choice": self.chat_tool_choice(), "response_format": self.response_format(),
                    "parallel_tool_calls": self.parallel_tool_calls}
        body.update((k, v) for k, v in optional.items() if v is not None)
        self._chat = body
        return body

    def droppable(self) -> int:
        """truncation "auto": how many of the conversation's first items may leave what the model
        sees (the instructions stay, and the last item)."""
        return max(0, len(self._chat["messages"]) - (1 if self.instructions else 0) - 1)

    def keep_from(self, conversation: list[dict[str, Any]], dropped: int) -> None:
        """What the model sees: `conversation` (the whole chat_body messages) less its first `dropped`
        items after the instructions, and the tool results of calls no longer shown. The stored
        conversation keeps every item."""
        first = 1 if self.instructions else 0
        rest = conversation[first + dropped:]
        while len(rest) > 1 and rest[0]["role"] == "tool":
            rest = rest[1:]
        self._chat["messages"] = conversation[:first] + rest

    def echoed_tools(self) -> list[dict[str, Any]]:
        """`tools` as the Response object lists them (FunctionTool)."""
        return [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
                 "parameters": t["function"].get("parameters"), "strict": t["function"].get("strict", True)}
                for t in self.chat_tools() or ()]
