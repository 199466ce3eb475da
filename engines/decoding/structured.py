"""Tools and structured outputs for an engine that renders its own prompts and samples with a grammar
(the `hf` engine): the chat-completions fields `tools`, `tool_choice` and `response_format` as a
prompt, a grammar and a shaped answer.

    prompt   `tools` through the model's chat template (`apply_chat_template(tools=...)`); a template
             that knows no tools gets them as a system message describing the parser's call format
    grammar  `response_format` json_object / json_schema: JSON text matching the schema; `tool_choice`
             `required` / a named function: calls in the parser's format, their arguments matching the
             function's `parameters` (engines/decoding/guided.py turns the grammar into a token mask)
    answer   the model's text through the model's tool parser (engines/decoding/tool_calls.py) into `tool_calls`;
             streamed, a call's arguments leave as deltas while the model writes them (hermes)

Every problem with these fields is an `EngineRequestRejected` naming the field, raised before the
request is admitted (`plan()` runs at prepare time through `Engine.check_request`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engines.decoding import guided
from engines.base import FINISH_STOP, EngineOutput, EngineRequestRejected
from engines.decoding.tool_calls import ToolCall, ToolCallParser, parser_for, partial_tag

CALL_FORMATS = {
    "hermes": (
        "For each function call, return a JSON object with the function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    ),
    "llama3_json": (
        "To call a function, answer with only a JSON object of the form "
        "{\"name\": <function-name>, \"parameters\": <args-json-object>}, nothing else."
    ),
}


def _rejected(message: str, param: str, code: str = "invalid_value") -> EngineRequestRejected:
    return EngineRequestRejected(message, param=param, code=code)


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]


def functions_of(body: dict[str, Any]) -> list[Function]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _rejected("tools must be an array of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise _rejected(f"tool type {kind!r} is not supported; only 'function' tools are", f"tools[{i}].type", "unsupported_parameter")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", fn["name"]):
            raise _rejected("a function tool needs a name of letters, digits, '_', '.' or '-' (at most 64)", f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _rejected("function parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        out.append(Function(fn["name"], params))
    return out


def tool_choice_of(body: dict[str, Any], functions: list[Function]) -> str | Function | None:
    """None (no tools offered), "none", "auto", "required" or the named Function."""
    choice = body.get("tool_choice")
    if not functions:
        if choice not in (None, "none"):
            raise _rejected("tool_choice needs tools", "tool_choice")
        return None
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return str(choice)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _rejected("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    for fn in functions:
        if fn.name == name:
            return fn
    raise _rejected(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")


def schema_of(body: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema `response_format` asks for; None: free text."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type", "text") not in ("text", "json_object", "json_schema"):
        kind = fmt.get("type") if isinstance(fmt, dict) else type(fmt).__name__
        raise _rejected(f"response_format type {kind!r} is not supported; use text, json_object or json_schema", "response_format.type")
    if fmt.get("type", "text") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "object"}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise _rejected("response_format.json_schema.schema must be a JSON schema object", "response_format.json_schema.schema")
    return dict(spec["schema"])


def _call_schema(fn: Function, args_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, args_key: fn.parameters},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _calls_lark(functions: list[Function], parser: str, many: bool) -> str:
    """Lark rules (`calls`) for one or more calls of these functions, written as `parser` reads them."""
    key = "arguments" if parser == "hermes" else "parameters"
    options = [_call_schema(fn, key) for fn in functions]
    body = guided.lark_json(options[0] if len(options) == 1 else {"anyOf": options})
    # Parallel calls: at most one per tool offered (a small model left free repeats a call until max_tokens).
    more = f"{{0,{len(functions) - 1}}}" if many and len(functions) > 1 else ""
    if parser == "hermes":
        call = f'"<tool_call>\\n" {body} "\\n</tool_call>"'
        more = f'("\\n" call){more}' if more else ""
    else:
        call = body
        more = f'("; " call){more}' if more else ""
    return f"calls: call {more}\ncall: {call}\n"


@dataclass
class Plan:
    """What a request asks beyond plain text."""

    grammar: str | None = None
    parser: str | None = None  # the tool parser the answer goes through; None: plain content
    tools: list[dict[str, Any]] | None = None  # the tools the prompt shows

# The fields a plan is made of: a body with none of them is a plain chat, whose plan is None (callers
# test this before calling plan(), which most requests then never do).
FIELDS = frozenset({"tools", "tool_choice", "response_format"})


def plan(body: dict[str, Any], tool_parser: str | None, guided_decoding: bool) -> Plan | None:
    """The request's plan, or None for a plain chat. Raises EngineRequestRejected naming the field."""
    if FIELDS.isdisjoint(body):
        return None
    functions = functions_of(body)
    choice = tool_choice_of(body, functions)
    schema = schema_of(body)
    if choice is None or choice == "none":
        if schema is None:
            return None
        return Plan(grammar=_grammar(lambda: guided.json_schema_grammar(schema), guided_decoding, "response_format"))
    if tool_parser is None:
        raise _rejected("tools are not supported by this model: its models.yaml entry sets no tool_parser", "tools", "unsupported_parameter")
    many = body.get("parallel_tool_calls") is not False
    grammar = None
    if isinstance(choice, Function):
        grammar = _grammar(lambda: guided.lark_grammar("start: calls\n" + _calls_lark([choice], tool_parser, False)), guided_decoding, "tool_choice")
    elif choice == "required":
        grammar = _grammar(lambda: guided.lark_grammar("start: calls\n" + _calls_lark(functions, tool_parser, many)), guided_decoding, "tool_choice")
    elif schema is not None:  # auto with a schema: calls, or the answer as JSON matching it
        lark = "start: calls | answer\nanswer: " + guided.lark_json(schema) + "\n" + _calls_lark(functions, tool_parser, many)
        grammar = _grammar(lambda: guided.lark_grammar(lark), guided_decoding, "response_format")
    return Plan(grammar=grammar, parser=tool_parser, tools=list(body["tools"]))


def _grammar(make: Any, guided_decoding: bool, param: str) -> str:
    if not guided_decoding:
        raise _rejected(
            f"{param} needs guided decoding, which this model's engine cannot do while it batches asynchronously "
            "(hf on CUDA with cuda_graphs; see docs/engines.md)", param, "unsupported_parameter")
    try:
        return make()  # type: ignore[no-any-return]
    except guided.GrammarError as exc:
        where = "response_format.json_schema.schema" if param == "response_format" else "tools"
        raise _rejected(f"the schema cannot be used for guided decoding: {exc}", where) from None


# the prompt ---------------------------------------------------------------------------------------
def template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def _text(content: Any, where: str, role: Any = None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if role == "assistant" and isinstance(part, dict) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
                parts.append(part["refusal"])  # an earlier answer's refusal, replayed: what the model said
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}.content[{j}]: content part type {kind!r} is not supported by this model; only 'text' parts are")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}.content must be a string or an array of text parts")


def _arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments", "{}") if isinstance(fn, dict) else "{}"
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def _call_shaped(call: Any) -> bool:
    """An assistant's tool call as OpenAI takes one: an object whose `function` is an object with a name."""
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _written_call(call: Any, parser: str) -> str:
    """An earlier assistant tool call, as the model would have written it."""
    name = call["function"]["name"]  # template_messages checked the call's shape
    key = "arguments" if parser == "hermes" else "parameters"
    obj = json.dumps({"name": name, key: _arguments(call)}, ensure_ascii=False)
    return f"<tool_call>\n{obj}\n</tool_call>" if parser == "hermes" else obj


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, parser: str, knows_tools: bool) -> list[dict[str, Any]]:
    """The messages (as the client sent them: content parts, tool calls, tool results) as the chat
    template takes them. A template that knows tools gets tool calls and results in the shape HF
    templates read; one that does not gets them as text in the parser's format, the tools in a system
    message (ValueError: a message the template cannot take)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role = "system" if m.get("role") == "developer" else m.get("role")
        text = _text(m.get("content"), f"messages[{i}]", role)
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None and not (isinstance(calls, list) and all(_call_shaped(c) for c in calls)):
            raise ValueError(f"messages[{i}].tool_calls must be a list of {{\"type\": \"function\", \"id\", "
                             f"\"function\": {{\"name\", \"arguments\"}}}} objects")
        if role == "tool":
            if knows_tools:
                out.append({"role": "tool", "content": text, "tool_call_id": m.get("tool_call_id")})
            else:
                out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        elif calls:
            if knows_tools:
                shaped = [{"type": "function", "id": c.get("id"), "function": {"name": c["function"]["name"], "arguments": _arguments(c)}}
                          for c in calls]
                out.append({"role": "assistant", "content": text, "tool_calls": shaped})
            else:
                written = "\n".join(_written_call(c, parser) for c in calls)
                out.append({"role": "assistant", "content": (text + "\n" if text else "") + written})
        else:
            out.append({"role": role, "content": text})
    if tools and not knows_tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        intro = (
            "You may call one or more functions to answer the user. The functions you can call are "
            f"listed as JSON within <tools></tools> tags:\n<tools>\n{listed}\n</tools>\n{CALL_FORMATS[parser]}"
        )
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + intro}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out


# the answer ---------------------------------------------------------------------------------------
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class HermesDeltas:
    """Hermes tool calls from streamed text as OpenAI's stream carries them: a call's id and name as
    soon as the model has written its name, then its arguments as the model writes them. Text before
    the first call is content (text that may begin a tag is held back); text after a call is not, as
    the whole answer's parser (tool_calls.HermesParser) and vLLM's hermes parser have it."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._call: ToolCall | None = None  # the call whose name has been sent
        self._sent = 0  # characters of its arguments sent
        self._args_at = 0  # where its arguments begin in the call's body
        self.calls: list[ToolCall] = []

    def push(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool call deltas) for this text; `final`: the answer ends here."""
        self._buf += text
        content, deltas = "", []
        while True:
            if not self._in_call:
                start = self._buf.find(self.OPEN)
                if start < 0:
                    keep = 0 if final else partial_tag(self._buf, self.OPEN)
                    content += "" if self.calls else self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    return content, deltas
                content += "" if self.calls else self._buf[:start]
                self._buf, self._in_call, self._call, self._sent = self._buf[start + len(self.OPEN):], True, None, 0
            end = self._buf.find(self.CLOSE)
            body = self._buf if end < 0 else self._buf[:end]
            closed = end >= 0 or final
            if self._call is None:
                head = _HEADER.match(body)
                if head is not None:
                    self._call = ToolCall(json.loads(f'"{head.group(1)}"'), "")
                    self._args_at = head.end()
                    deltas.append({"index": len(self.calls), "id": self._call.id, "type": "function", "function": {"name": self._call.name, "arguments": ""}})
                    self.calls.append(self._call)
            if self._call is not None:
                args = body[self._args_at:].lstrip()
                ready = _args_safe(args) if end < 0 else _args_end(args)
                if len(ready) > self._sent and ready.startswith(self._call.arguments):
                    deltas.append({"index": len(self.calls) - 1, "function": {"arguments": ready[self._sent:]}})
                    self._call.arguments, self._sent = ready, len(ready)
            if not closed:
                return content, deltas
            self._in_call = False
            self._buf = self._buf[end + len(self.CLOSE):] if end >= 0 else ""
            if self._call is None:  # never looked like a call as it streamed: one last parse of the whole
                whole = _whole_call(body)
                if whole is None:
                    content += "" if self.calls else self.OPEN + body + (self.CLOSE if end >= 0 else "")
                else:
                    deltas.append({**whole.openai(len(self.calls))})
                    self.calls.append(whole)
            if final and not self._buf:
                return content, deltas


def _args_end(args: str) -> str:
    """A finished call's arguments: its text without the call object's closing brace."""
    args = args.rstrip()
    return args[:-1].rstrip() if args.endswith("}") else args


def _args_safe(args: str) -> str:
    """What of a call's arguments can be sent while it streams: all but a tail that may still turn
    out to be the call object's closing brace (or the start of the closing tag)."""
    args = args[: len(args) - partial_tag(args, HermesDeltas.CLOSE)]
    return _args_end(args)


def _whole_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


_LLAMA_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')


def _objects(text: str) -> list[tuple[int, int | None, int | None]]:
    """The top-level JSON objects in `text`: (start, where the value of depth 1 that is open or last
    closed ends (exclusive), end: one past the closing brace, or None while open)."""
    out: list[tuple[int, int | None, int | None]] = []
    depth, in_string, escaped, start, inner_end = 0, False, False, 0, None
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, in_string) if escaped else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            if depth == 0:
                start = i
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 1:
                inner_end = i + 1
            elif depth == 0:
                out.append((start, inner_end, i + 1))
                inner_end = None
            elif depth < 0:
                break
    if depth > 0:
        out.append((start, inner_end, None))
    return out


class Llama3Deltas:
    """Llama 3 JSON tool calls (the whole answer is `{"name": ..., "parameters": {...}}`, several
    separated by ';', optionally after <|python_tag|>) as OpenAI's stream carries them: a call's id
    and name once its name is written, then its arguments while the model writes them. An answer that
    does not begin like a call is content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._decided: bool | None = None
        self._sent: list[int] = []  # per call: characters of its arguments sent
        self.calls: list[ToolCall] = []

    def push(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        if self._decided is False:
            return text, []
        self._buf += text
        head = self._buf.lstrip()
        if self._decided is None:
            if head.startswith("{") or head.startswith(self.TAG):
                self._decided = True
            elif head and not self.TAG.startswith(head) or final:
                self._decided = False
                out, self._buf = self._buf, ""
                return out, []
            else:
                return "", []
        body = head.removeprefix(self.TAG)
        deltas: list[dict[str, Any]] = []
        for i, (start, inner_end, end) in enumerate(_objects(body)):
            match = _LLAMA_HEADER.match(body, start)
            if i == len(self.calls):  # a call not seen before
                if match is None:  # its name is not first: it leaves whole once it is whole
                    whole = _whole_call(body[start:end].replace('"parameters"', '"arguments"', 1)) if end is not None else None
                    if whole is None:
                        break
                    deltas.append(whole.openai(i))
                    self.calls.append(whole)
                    self._sent.append(len(whole.arguments))
                    continue
                self.calls.append(ToolCall(json.loads(f'"{match.group(1)}"'), ""))
                self._sent.append(0)
                deltas.append({"index": i, "id": self.calls[i].id, "type": "function", "function": {"name": self.calls[i].name, "arguments": ""}})
            if match is None:
                continue
            # The arguments: up to where their value closed, else all that is written of them so far.
            closed = inner_end is not None and inner_end > match.end()
            args = body[match.end(): inner_end if closed else len(body)].strip()
            call = self.calls[i]
            if len(args) > self._sent[i] and args.startswith(call.arguments):
                deltas.append({"index": i, "function": {"arguments": args[self._sent[i]:]}})
                call.arguments, self._sent[i] = args, len(args)
        if final and not self.calls:  # began like JSON but held no call: the answer is content
            out, self._buf = self._buf, ""
            return out, deltas
        return "", deltas


class AnswerShape:
    """Outputs of a request with tools as OpenAI choice objects (EngineOutput.raw_choice): streamed, a
    chunk's choice with `delta` (content and tool call deltas); not, the final output carries the whole
    choice (`message` with `tool_calls`). finish_reason `tool_calls` when the model called a tool."""

    def __init__(self, parser: str, stream: bool) -> None:
        self.stream = stream
        self.deltas: HermesDeltas | Llama3Deltas | None = None
        if stream:
            self.deltas = HermesDeltas() if parser == "hermes" else Llama3Deltas()
        self.parser: ToolCallParser = parser_for(parser)
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self._held = ""  # streamed whitespace before any other content: content only if no call comes
        self._said = False

    def shaped(self, out: EngineOutput) -> EngineOutput:
        if self.deltas is not None:
            return self._streamed(out)
        text, calls = self.parser.push(out.text)
        if out.finished:
            rest, more = self.parser.finish()
            text, calls = text + rest, calls + more
        first = len(self.calls)
        self.calls += calls
        out.text = text
        finish = self._finish(out)
        if self.stream:  # a parser that knows a call only once it is whole: each call in one delta
            text = out.text = self._content(text, out.finished)
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = [c.openai(first + i) for i, c in enumerate(calls)]
            if delta or out.finished:
                out.raw_choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return out
        self.content.append(text)
        if out.finished:
            content = "".join(self.content)
            # Whitespace around or between calls (a newline after `</tool_call>`) is no content: OpenAI's
            # message that only calls tools has content null.
            message: dict[str, Any] = {"role": "assistant", "content": content if content.strip() or not self.calls else None}
            if self.calls:
                message["tool_calls"] = [{k: v for k, v in c.openai(i).items() if k != "index"} for i, c in enumerate(self.calls)]
            out.raw_choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return out

    def _streamed(self, out: EngineOutput) -> EngineOutput:
        assert self.deltas is not None
        text, deltas = self.deltas.push(out.text, final=out.finished)
        self.calls = self.deltas.calls
        text = out.text = self._content(text, out.finished)
        delta: dict[str, Any] = {"content": text} if text else {}
        if deltas:
            delta["tool_calls"] = deltas
        if delta or out.finished:
            out.raw_choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": self._finish(out)}
        return out

    def _content(self, text: str, finished: bool) -> str:
        """The content to stream now: whitespace before any other content is held until text follows
        it, and dropped when the answer calls a tool, as the whole answer's message drops it."""
        if self._said:
            return text
        self._held += text
        if self._held.strip():
            text, self._held, self._said = self._held, "", True
            return text
        if finished and not self.calls:
            text, self._held = self._held, ""
            return text
        return ""

    def _finish(self, out: EngineOutput) -> str | None:
        if not out.finished:
            return None
        return "tool_calls" if self.calls and out.finish_reason == FINISH_STOP else out.finish_reason
