"""OpenAI request models (field names and order follow OpenAI's API). Unknown fields are
accepted and ignored. This module imports neither engines nor billing."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from gateway.http.errors import InvalidRequest

StrictInt = Annotated[int, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
MAX_STOP_SEQUENCES = 4


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _StrictModel(_Model):
    """A body of Tollgate's own admin API: a field it does not know is a 400 naming it, never dropped
    in silence (a misplaced `limits` on a new key would leave that key unlimited)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Model):
    include_usage: StrictBool | None = None


class TextPart(_Model):
    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            if self.role == "assistant":
                return ""
            raise InvalidRequest(f"messages[{index}].content is required", param=f"messages[{index}].content")
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.type == "refusal" and self.role == "assistant" and part.refusal is not None:
                pieces.append(part.refusal)  # an earlier answer's refusal, replayed: what the model said
                continue
            if part.type != "text" or part.text is None:
                raise InvalidRequest(
                    f"content part type {part.type!r} is not supported by this model; only 'text' parts are",
                    param=f"messages[{index}].content[{j}].type",
                )
            pieces.append(part.text)
        return "".join(pieces)


class _SamplingFields(_Model):
    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: StrictInt | None = Field(default=None, ge=1)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)  # the JSON body as the client sent it

    @property
    def raw_body(self) -> dict[str, Any]:
        # Straight from pydantic's private store: `self._raw` goes through BaseModel.__getattr__,
        # which cost ~5 us a read, a visible share of each request.
        return self.__pydantic_private__["_raw"]  # type: ignore[index]

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        return value

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def choices(self, max_choices: int) -> tuple[int, int]:
        """(n, sequences generated) for an engine that serves at most `max_choices` choices a request."""
        n = self.n or 1
        if n > max_choices:
            if max_choices == 1:
                raise InvalidRequest("n > 1 is not supported; send separate requests", param="n", code="unsupported_parameter")
            raise InvalidRequest(f"n must be at most {max_choices} for this model", param="n", code="invalid_value")
        return n, n

    def check_supported(self, passthrough: bool = False) -> None:
        """Refuses what the engine cannot honour; a pass-through engine's upstream judges the rest.
        `n` is judged with the engine known (`choices`)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        if passthrough:
            return
        if self.presence_penalty:
            raise InvalidRequest("presence_penalty is not supported", param="presence_penalty", code="unsupported_parameter")
        if self.frequency_penalty:
            raise InvalidRequest("frequency_penalty is not supported", param="frequency_penalty", code="unsupported_parameter")
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported", param="logit_bias", code="unsupported_parameter")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self, passthrough: bool = False) -> None:
        super().check_supported(passthrough)
        for name in ("functions", "function_call"):  # deprecated by OpenAI for tools and tool_choice
            if self.raw_body.get(name) is not None:
                raise InvalidRequest(f"{name} is not supported; use {'tools' if name == 'functions' else 'tool_choice'}",
                                     param=name, code="unsupported_parameter")
        if passthrough:
            return
        if self.logprobs or self.top_logprobs:
            raise InvalidRequest("logprobs are not supported", param="logprobs", code="unsupported_parameter")
        # tools, tool_choice and response_format: the engine judges them (Engine.check_request, at prepare).

    def check_tool_results(self) -> None:
        """A `tool` message answers a call an earlier assistant message made (OpenAI: tool_call_id is
        required, and a tool message must respond to a preceding message with tool_calls). For a
        client's own chat messages: the Responses and Messages APIs check their call ids themselves,
        and a Responses truncation tries conversations that start with a call's output."""
        raw = self.raw_body.get("messages")
        called: set[str] = set()
        misshapen = False  # an assistant's tool_calls that are no list: the engine names that error
        for i, message in enumerate(self.messages):
            if message.role == "assistant" and isinstance(raw, list) and i < len(raw) and isinstance(raw[i], dict):
                calls = raw[i].get("tool_calls")
                misshapen |= calls is not None and not isinstance(calls, list)
                called |= {c["id"] for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str)} if isinstance(calls, list) else set()
            if message.role != "tool":
                continue
            if not message.tool_call_id:
                raise InvalidRequest(f"messages[{i}].tool_call_id is required for a message with role 'tool'",
                                     param=f"messages[{i}].tool_call_id")
            if message.tool_call_id not in called and not misshapen:
                raise InvalidRequest(f"messages[{i}] with role 'tool' must answer a call of an earlier assistant message: "
                                     f"no tool call has id {message.tool_call_id!r}", param=f"messages[{i}].tool_call_id")

    def uses_tools(self) -> bool:
        """Whether the conversation offers tools or carries tool calls or results (the messages then
        go to the engine as sent)."""
        raw = self.raw_body.get("messages")
        carried = isinstance(raw, list) and any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in raw)
        return bool(self.tools) or carried

    def prompt_tools(self) -> list[Any] | None:
        """The tools the prompt shows: none when tool_choice is "none" (the model is not told of them)."""
        return self.tools if self.tools and self.tool_choice != "none" else None

    def raw_messages(self) -> list[dict[str, Any]]:
        """The messages exactly as sent (tool calls, content parts and all), for pass-through engines."""
        raw = self.raw_body.get("messages")
        return list(raw) if isinstance(raw, list) else [m.model_dump(exclude_none=True) for m in self.messages]

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role if m.role != "developer" else "system", "content": m.text(i)} for i, m in enumerate(self.messages)]


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=16, ge=1)
    echo: StrictBool | None = None
    suffix: str | None = None
    best_of: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictInt | None = None

    def choices(self, max_choices: int) -> tuple[int, int]:
        n, _ = super().choices(max_choices)
        best_of = self.best_of or n
        if best_of > max_choices:
            if max_choices == 1:
                raise InvalidRequest("best_of > 1 is not supported", param="best_of", code="unsupported_parameter")
            raise InvalidRequest(f"best_of must be at most {max_choices} for this model", param="best_of", code="invalid_value")
        if best_of < n:
            raise InvalidRequest("best_of must be greater than or equal to n", param="best_of", code="invalid_value")
        if best_of > n and self.stream:
            raise InvalidRequest("best_of > n cannot be used with stream", param="best_of", code="invalid_value")
        return n, best_of

    def check_supported(self, passthrough: bool = False) -> None:
        super().check_supported(passthrough)
        if "messages" in self.raw_body:
            # not a field of a text completion; a pass-through engine would take the body for a chat
            # and run messages the gateway never counted
            raise InvalidRequest("messages is not a field of /v1/completions, which takes a prompt; send chat "
                                 "messages to /v1/chat/completions", param="messages", code="unknown_parameter")
        if passthrough:
            return
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo", code="unsupported_parameter")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix", code="unsupported_parameter")
        if self.logprobs is not None:
            raise InvalidRequest("logprobs are not supported", param="logprobs", code="unsupported_parameter")

    def single_prompt(self) -> str | list[int]:
        """The one prompt as text or token ids; batches of prompts are refused."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if len(prompt) == 0:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]
        if len(prompt) != 1:
            raise InvalidRequest("batched prompts are not supported; send one prompt per request", param="prompt")
        only = prompt[0]
        if isinstance(only, list) and len(only) == 0:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return only  # type: ignore[return-value]


def parse(model: type[_Model], body: Any, *, passthrough: bool = False) -> Any:
    """Validates a decoded JSON body, mapping the first problem to a 400 naming its field.
    `passthrough`: the model's engine forwards the fields it does not use to a server that does."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = _meant(errors)
        param = _param_path(first.get("loc", ()))
        kind = first.get("type", "")
        if kind == "missing":
            message = f"missing required parameter: {param!r}"
        elif kind == "extra_forbidden":
            message = f"unknown parameter: {param!r}"
        else:
            message = f"invalid value for {param!r}: {first.get('msg', 'invalid')}"
        code = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}.get(kind, "invalid_value")
        raise InvalidRequest(message, param=param or None, code=code) from None
    if isinstance(request, _SamplingFields):  # only generation requests keep the body they came as
        request.__pydantic_private__["_raw"] = body  # type: ignore[index]  # `request._raw = body`, minus pydantic's __setattr__
    if passthrough:
        request.check_supported(passthrough=True)
    else:
        request.check_supported()  # every parsed model has it (admin bodies too), without the flag
    return request


_TYPE_LABELS = {"str", "int", "bool", "float", "dict", "list"}


def _meant(errors: list[Any]) -> Any:
    """The error to report: the first, unless it says the value is not of one branch of a union
    (`content` not a string) while another branch's error lies deeper under the same field (its
    list's block has a bad field): the value was meant as that branch, and that error names the field."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if not (loc and isinstance(loc[-1], str) and _branch_label(loc[-1]) and str(first.get("type", "")).endswith("_type")):
        return first
    deeper = [e for e in errors[1:] if tuple(e.get("loc", ()))[:len(loc) - 1] == loc[:-1] and len(e.get("loc", ())) > len(loc)]
    return deeper[0] if deeper else first


def _branch_label(part: str) -> bool:
    return "[" in part or part in _TYPE_LABELS or part.startswith("function-")


def _param_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _branch_label(part):
            continue  # union branch labels, not fields
        else:
            out += ("." if out else "") + str(part)
    return out
