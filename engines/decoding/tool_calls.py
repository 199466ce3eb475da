"""Parsing a model's tool-call output into OpenAI `tool_calls`, as it streams.

A parser is chosen per model in models.yaml (`tool_parser:`). Each one knows how its model family
writes a call; text outside calls is content. While text may still be the start of a call it is
held back, as `StopMatcher` holds back the start of a stop string, so a client never sees half a
call's markup as content.

    hermes       <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
                 (Hermes 2/3, Qwen 2.5/3 and other models whose chat template says so)
    llama3_json  {"name": "get_weather", "parameters": {"city": "Paris"}}  as the whole answer
                 (Llama 3.1/3.2/3.3 JSON tool calling; optionally after <|python_tag|>)
"""

from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int) -> dict[str, Any]:
        return {"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def partial_tag(buf: str, tag: str) -> int:
    """How many characters at the end of `buf` may be the start of `tag` (held back until known)."""
    return next((n for n in range(min(len(buf), len(tag) - 1), 0, -1) if tag.startswith(buf[-n:])), 0)


class ToolCallParser(abc.ABC):
    """push(text) -> (content, calls completed by it); finish() -> (content left, calls left)."""

    @abc.abstractmethod
    def push(self, text: str) -> tuple[str, list[ToolCall]]: ...

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[ToolCall]]: ...


class HermesParser(ToolCallParser):
    """`<tool_call>{json}</tool_call>` calls. The content is the text before the first call; what the
    model writes after a call (a newline between two calls) is not content, as vLLM's hermes parser
    has it, so that an answer's content and calls are the same streamed (HermesDeltas) or not."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._called = False

    def _content(self, text: str) -> str:
        return "" if self._called else text

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buf.find(self.CLOSE)
                if end < 0:
                    return content, calls
                body, self._buf, self._in_call = self._buf[:end], self._buf[end + len(self.CLOSE):], False
                call = self._parse(body)
                if call is None:  # not a call after all: what the model wrote is content
                    content += self._content(self.OPEN + body + self.CLOSE)
                else:
                    calls.append(call)
                    self._called = True
                continue
            start = self._buf.find(self.OPEN)
            if start >= 0:
                content += self._content(self._buf[:start])
                self._buf, self._in_call = self._buf[start + len(self.OPEN):], True
                continue
            keep = partial_tag(self._buf, self.OPEN)
            content += self._content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return content, calls

    @staticmethod
    def _parse(body: str) -> ToolCall | None:
        try:
            return _call_from(json.loads(body.strip()), "arguments")
        except ValueError:
            return None

    def finish(self) -> tuple[str, list[ToolCall]]:
        buf, self._buf = self._buf, ""
        if self._in_call:  # the answer ended inside a call (e.g. cut by max_tokens): one last try
            self._in_call = False
            # without the start of a closing tag the cut left (`...}}\n</tool_call`), as the stream parses it
            call = self._parse(buf[: len(buf) - partial_tag(buf, self.CLOSE)])
            return ("", [call]) if call is not None else (self._content(self.OPEN + buf), [])
        return self._content(buf), []


class Llama3JsonParser(ToolCallParser):
    """The whole answer is one JSON call (or several separated by ';'); anything else is content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._decided: bool | None = None  # True: a call; False: content

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._decided is False:
            return text, []
        self._buf += text
        head = self._buf.lstrip()
        if self._decided is None and head:
            if head.startswith("{") or head.startswith(self.TAG) or self.TAG.startswith(head):
                self._decided = True if (head.startswith("{") or head.startswith(self.TAG)) else None
            else:
                self._decided = False
                out, self._buf = self._buf, ""
                return out, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        buf, self._buf = self._buf, ""
        body = buf.strip().removeprefix(self.TAG).strip()
        calls = []
        for part in [p for p in body.split(";") if p.strip()] if self._decided else []:
            try:
                call = _call_from(json.loads(part), "parameters")
            except ValueError:
                call = None
            if call is None:
                return buf, []
            calls.append(call)
        return ("", calls) if calls else (buf, [])


def parser_for(name: str) -> ToolCallParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(PARSERS)}")
