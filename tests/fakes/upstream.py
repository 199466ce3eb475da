"""A scripted OpenAI-compatible server for the `openai` backend's tests.

It speaks the streaming wire format of /v1/chat/completions and /v1/completions (SSE chunks,
a usage chunk only when `stream_options.include_usage` is asked for, `data: [DONE]`), answers
/health, and does what the test scripts for each request: answer an error status, stall before
or after the first token, drop the connection, omit usage, stream tool-call deltas. It records
every request (body, headers, client address) and when the client's connection closed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.types import Receive, Scope, Send

WORDS = ["The", " capital", " of", " France", " is", " Paris", "."]


@dataclass
class Behaviour:
    status: int = 200  # anything else: answer this status with an error body
    error_message: str = "scripted failure"
    headers_delay: float = 0.0  # seconds before the status line (a stall before the first byte)
    tokens: list[str] = field(default_factory=lambda: list(WORDS))
    token_delay: float = 0.0
    stall_after: int | None = None  # after this many content chunks, go silent until the client leaves
    drop_after: int | None = None  # after this many content chunks, break the connection
    usage: bool | dict[str, int] = True  # True: {prompt_tokens: 17, completion_tokens: len(tokens)}
    tool_calls: list[dict[str, Any]] | None = None  # stream these calls (name, arguments) instead of text
    finish_reason: str | None = None  # default: "tool_calls" with tool calls, else "stop"
    error_event_after: int | None = None  # after this many chunks, send an `error` event and end
    error_event: dict[str, Any] | None = None  # that event's body (vLLM's ErrorResponse for a bad field); default a bare message
    ending: str = "done"  # after the finish (and usage): "done" sends [DONE], "eof" just ends the body, "drop" breaks it
    error_body: dict[str, Any] | None = None  # with a status: this body as it is (e.g. trtllm-serve's ErrorResponse)
    # Generate at most the body's max_tokens (chat: max_completion_tokens, else max_tokens) of `tokens`,
    # as vLLM and trtllm-serve do; a body without one gets all of them, as trtllm-serve's None does
    # (it generates to the end of its context). False: `tokens` whatever the body asks.
    bounded: bool = False


@dataclass
class Seen:
    """One request as the server saw it."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    client: tuple[str, int]
    started: float = field(default_factory=time.monotonic)
    chunks_sent: int = 0
    finished: bool = False
    disconnected_at: float | None = None
    disconnected: asyncio.Event | None = None


class ScriptedUpstream:
    def __init__(self, name: str = "upstream") -> None:
        self.name = name
        self.default = Behaviour()
        self.script: list[Behaviour] = []  # the next requests take these, in order
        self.requests: list[Seen] = []
        self.healthy = True
        self.health_checks = 0
        # Cleared: a /health request waits until it is set again (a replica slow to answer its probe).
        self.health_open = threading.Event()
        self.health_open.set()
        self.active = 0  # requests being answered right now
        # Like trtllm-serve's request models (pydantic extra="forbid"): when set, a body with a field
        # not listed here ("chat", "text", and "stream_options" for its inner fields) is answered 400.
        self.accepts: dict[str, frozenset[str]] | None = None

    def next_behaviour(self) -> Behaviour:
        return self.script.pop(0) if self.script else self.default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if path == "/health":
            self.health_checks += 1
            if not self.health_open.is_set():
                await asyncio.to_thread(self.health_open.wait)
            await _json(send, 200 if self.healthy else 503, {"status": "ok" if self.healthy else "down"})
        elif path in ("/v1/chat/completions", "/v1/completions") and scope["method"] == "POST":
            await self._completion(scope, receive, send, chat=path.endswith("chat/completions"))
        elif path == "/v1/models":
            await _json(send, 200, {"object": "list", "data": [{"id": self.name, "object": "model"}]})
        else:
            await _json(send, 404, {"error": {"message": "not found"}})

    async def _completion(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen = Seen(scope["path"], json.loads(raw), {k.decode(): v.decode() for k, v in scope["headers"]}, tuple(scope["client"]))
        seen.disconnected = asyncio.Event()
        self.requests.append(seen)
        extra = self._extra_field(seen.body, chat)
        if extra is not None:
            await _json(send, 400, {"object": "error", "message": f"1 validation error: {extra}: Extra inputs are not permitted",
                                    "type": "BadRequestError", "param": None, "code": 400})
            return
        behaviour = self.next_behaviour()
        watcher = asyncio.get_running_loop().create_task(self._watch(receive, seen))
        self.active += 1
        try:
            if behaviour.headers_delay:
                await _sleep_unless(seen, behaviour.headers_delay)
                if seen.disconnected_at is not None:
                    return
            if behaviour.status != 200:
                await _json(send, behaviour.status, behaviour.error_body or
                            {"error": {"message": behaviour.error_message, "type": "scripted", "param": "tools", "code": "scripted"}})
                return
            if not seen.body.get("stream"):
                await self._whole(send, seen, behaviour, chat)
                return
            await self._stream(send, seen, behaviour, chat)
        finally:
            self.active -= 1
            watcher.cancel()

    def _extra_field(self, body: dict[str, Any], chat: bool) -> str | None:
        if self.accepts is None:
            return None
        allowed = self.accepts["chat" if chat else "text"]
        extra = [k for k in body if k not in allowed]
        options = body.get("stream_options")
        if isinstance(options, dict) and "stream_options" in self.accepts:
            extra += [f"stream_options.{k}" for k in options if k not in self.accepts["stream_options"]]
        return extra[0] if extra else None

    async def _watch(self, receive: Receive, seen: Seen) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        seen.disconnected_at = time.monotonic()
        assert seen.disconnected is not None
        seen.disconnected.set()

    def _chunks(self, behaviour: Behaviour, chat: bool, logprobs: bool) -> list[dict[str, Any]]:
        if behaviour.tool_calls is not None:
            chunks = []
            for i, call in enumerate(behaviour.tool_calls):
                head = {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": call["name"], "arguments": ""}}
                chunks.append({"delta": {"tool_calls": [head]}})
                args = call["arguments"]
                for piece in (args[: len(args) // 2], args[len(args) // 2 :]):
                    chunks.append({"delta": {"tool_calls": [{"index": i, "function": {"arguments": piece}}]}})
            return chunks
        out = []
        for token in behaviour.tokens:
            choice: dict[str, Any] = {"delta": {"content": token}} if chat else {"text": token}
            if logprobs:
                choice["logprobs"] = {"content": [{"token": token, "logprob": -0.25, "bytes": None, "top_logprobs": []}]}
            out.append(choice)
        return out

    async def _stream(self, send: Send, seen: Seen, behaviour: Behaviour, chat: bool) -> None:
        model = seen.body.get("model")
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        async def emit(choices: list[dict[str, Any]], **extra: Any) -> None:
            payload = {"id": "cmpl-scripted", "object": kind, "created": created, "model": model, "choices": choices, **extra}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(payload).encode() + b"\n\n", "more_body": True})

        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        if chat:
            await emit([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        pieces = self._chunks(_bounded(behaviour, seen.body, chat), chat, bool(seen.body.get("logprobs")))
        for n, piece in enumerate(pieces):
            if seen.disconnected_at is not None:
                return
            if behaviour.stall_after is not None and n == behaviour.stall_after:
                await _sleep_unless(seen, 60.0)
                return
            if behaviour.drop_after is not None and n == behaviour.drop_after:
                raise ConnectionAbortedError("scripted connection drop")  # uvicorn closes the socket mid-body
            if behaviour.error_event_after is not None and n == behaviour.error_event_after:
                event = behaviour.error_event or {"error": {"message": "scripted error event"}}
                await send({"type": "http.response.body", "body": b"data: " + json.dumps(event).encode() + b"\n\n", "more_body": False})
                return
            await emit([{"index": 0, "logprobs": None, "finish_reason": None, **piece}])
            seen.chunks_sent += 1
            if behaviour.token_delay:
                await _sleep_unless(seen, behaviour.token_delay)
        finish = behaviour.finish_reason or ("tool_calls" if behaviour.tool_calls is not None else "stop")
        await emit([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish} if chat else
                    {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}])
        if behaviour.usage and (seen.body.get("stream_options") or {}).get("include_usage"):
            await emit([], usage=self._usage(behaviour, len(pieces), seen.body))
        if behaviour.ending == "drop":
            raise ConnectionAbortedError("scripted connection drop after the finish")
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n" if behaviour.ending == "done" else b"", "more_body": False})
        seen.finished = True

    @staticmethod
    def _usage(behaviour: Behaviour, completion: int, body: dict[str, Any]) -> dict[str, int]:
        usage = dict(behaviour.usage) if isinstance(behaviour.usage, dict) else {"prompt_tokens": 17, "completion_tokens": completion}
        # What a real server would bill for the engine-level fields it honours: a token-id prompt
        # instead of the messages (trtllm-serve), best_of sequences each generating (trtllm-serve chat).
        if isinstance(body.get("prompt_token_ids"), list):
            usage["prompt_tokens"] = len(body["prompt_token_ids"])
        if isinstance(body.get("best_of"), int) and body["best_of"] > 1:
            usage["completion_tokens"] *= body["best_of"]
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return usage

    async def _whole(self, send: Send, seen: Seen, behaviour: Behaviour, chat: bool) -> None:
        behaviour = _bounded(behaviour, seen.body, chat)
        text = "".join(behaviour.tokens)
        finish = behaviour.finish_reason or "stop"
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish} if chat else \
            {"index": 0, "text": text, "finish_reason": finish}
        body = {"id": "cmpl-scripted", "object": "chat.completion" if chat else "text_completion", "model": seen.body.get("model"),
                "choices": [choice], "usage": self._usage(behaviour, len(behaviour.tokens), seen.body)}
        await _json(send, 200, body)
        seen.finished = True


def _bounded(behaviour: Behaviour, body: dict[str, Any], chat: bool) -> Behaviour:
    """`behaviour` with its tokens cut to the body's bound where it honours one."""
    if not behaviour.bounded:
        return behaviour
    bound = body.get("max_completion_tokens") if chat else None
    bound = bound if bound is not None else body.get("max_tokens")
    return behaviour if bound is None else replace(behaviour, tokens=behaviour.tokens[:bound])


async def _sleep_unless(seen: Seen, seconds: float) -> None:
    """Sleeps, waking early when the client disconnects."""
    assert seen.disconnected is not None
    try:
        await asyncio.wait_for(seen.disconnected.wait(), seconds)
    except asyncio.TimeoutError:
        pass


async def _json(send: Send, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def main(argv: list[str] | None = None) -> None:
    """Serves a scripted upstream on its own, e.g. as a stand-in engine for `tollgate bench`:
    python -m tests.fakes.upstream --port 9001 --tokens 64 --token-delay 0.01"""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--tokens", type=int, default=64, help="content chunks per answer")
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds between chunks")
    args = parser.parse_args(argv)
    upstream = ScriptedUpstream("stand-in")
    upstream.default = Behaviour(tokens=[" tok"] * args.tokens, token_delay=args.token_delay)
    upstream.requests = _Forgetful()
    uvicorn.run(upstream, host=args.host, port=args.port, log_level="warning")


class _Forgetful(list):  # type: ignore[type-arg]
    """A request log that keeps nothing (a long benchmark would otherwise grow it without end)."""

    def append(self, item: Any) -> None:
        pass


if __name__ == "__main__":
    main()
