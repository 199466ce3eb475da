"""ASGI responses for generations: SSE chunks or one JSON body.

Plain ASGI on purpose: the connection is watched the whole time (the guarded protocol's
ConnectionWatch, else a task waiting for `http.disconnect`), so a client that leaves cancels the
engine request at once (not at the next token), and the metered stream is always closed here; then
the request's Admission is settled (its one ledger row), from this response's `finally`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from engines.base import FINISH_CANCELLED, FINISH_ERROR, EngineError, EngineOutput, EngineOverloadedError, EngineRequestRejected
from gateway.http.drain import draining_error
from gateway.http.errors import APIError, EngineOverloaded, InvalidRequest, ServiceUnavailable
from gateway.http.hardening import WATCH_KEY
from gateway.serving.admission import Admission
from gateway.serving.completions import Generation, usage_body

log = logging.getLogger("tollgate.responses")
DONE = b"data: [DONE]\n\n"


class ChunkRenderer:
    """OpenAI's chunk and body shapes for chat (`chat.completion`) and text (`text_completion`)."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        chat = gen.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + gen.request_id
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.body_object = "chat.completion" if chat else "text_completion"
        self._head: bytes | None = None  # `data: {"id":...,"choices":[` of this response's chunks
        self._tail = b""  # and what follows the choice: `]}` (`],"usage":null}` with include_usage)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.gen.created,
            "model": self.gen.model,
            "choices": choices,
            # with include_usage every other chunk carries `usage: null` (OpenAI's stream_options)
            **({"usage": None} if self.gen.include_usage else {}),
            **extra,
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def first(self) -> bytes | None:
        if self.gen.kind != "chat":
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])

    def delta(self, text: str, finish_reason: str | None, raw_choice: dict[str, Any] | None = None) -> bytes:
        if raw_choice is not None:  # a pass-through engine's choice, relayed as it came
            choice = raw_choice
        elif self.gen.kind == "chat":
            delta = {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        # What every chunk of this response shares is encoded once: `_chunk` with one choice, byte for byte.
        if self._head is None:
            whole = self._chunk([None])
            at = whole.rindex(b"[null]")
            self._head, self._tail = whole[: at + 1], whole[at + 5:]
        return self._head + orjson.dumps(choice) + self._tail

    def usage(self) -> bytes:
        return self._chunk([], usage=usage_body(self.gen))

    def end(self) -> bytes:
        """What a stream that ran to its end closes with, after its last delta."""
        return self.usage() + DONE if self.gen.include_usage else DONE

    def error(self, err: APIError) -> bytes:
        """The event that ends a stream that failed after its status line."""
        return b"data: " + orjson.dumps(err.body()) + b"\n\n" + DONE

    def error_body(self, err: APIError) -> tuple[int, bytes]:
        """The status and JSON body of an error answered before any of the response was sent."""
        return err.status_code, orjson.dumps(err.body())

    def body(self, text: str, raw_choice: dict[str, Any] | None = None, choices: list[dict[str, Any]] | None = None) -> bytes:
        """`choices`: every choice of a request with n > 1, as the engine made them."""
        finish = self.gen.finish_reason
        if raw_choice is not None:
            choice = raw_choice
        elif self.gen.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return orjson.dumps(
            {
                "id": self.id,
                "object": self.body_object,
                "created": self.gen.created,
                "model": self.gen.model,
                "choices": choices or [choice],
                "usage": usage_body(self.gen),
            }
        )


def _error_for(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineRequestRejected):  # the upstream judged the request invalid
        err = InvalidRequest(str(exc), param=exc.param, code=exc.code)
        err.status_code = exc.status_code
        return err
    if isinstance(exc, EngineOverloadedError):
        return EngineOverloaded("The engine is at capacity; retry shortly.", headers={"Retry-After": "1"})
    if isinstance(exc, EngineError):
        return ServiceUnavailable(f"The engine failed this request: {exc}", code="engine_error")
    return APIError("The server failed this request.")


class GenerationResponse:
    """`render`: the API's shapes (ChunkRenderer's methods); OpenAI's chunks by default.
    `admission`: what the request holds (gateway/serving/admission.py); this response's `finally` settles it,
    whatever happened before (a stream that never started included)."""

    def __init__(
        self, gen: Generation, outputs: AsyncIterator[EngineOutput], headers: dict[str, str], render: Any = None,
        *, admission: Admission | None = None,
    ) -> None:
        self.gen = gen
        self.outputs = outputs
        self.headers = headers
        self.render = render or ChunkRenderer(gen)
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stop_watching = self._watch(scope, receive)
        write_failed = failed = False
        try:
            await self._respond(send)
        except OSError:
            write_failed = True
            self.gen.cancel()  # the client went away while we wrote to it
        except BaseException:
            failed = True
            raise
        finally:
            stop_watching()
            try:
                await self._close()
            finally:
                if self.admission is not None:
                    self.admission.settle("error" if failed else None)  # a no-op when the stream has settled it
            self._report_abnormal_end(write_failed)

    def _report_abnormal_end(self, write_failed: bool) -> None:
        """A response that did not run to its end says why, at warning level: who closed it (the
        client, a failed write, the engine) and how far it got. Nothing ends a stream silently."""
        gen = self.gen
        if gen.cut:
            why = "the server is shutting down (drain deadline)"
        elif gen.cancel_requested:
            why = "a write to the client failed" if write_failed else "the client closed the connection"
        elif gen.finish_reason == FINISH_ERROR or gen.error:
            why = f"the engine failed: {gen.error}"
        else:
            return
        log.warning(
            "%s %s ended early: %s, after %d completion tokens in %.0f ms",
            "stream" if gen.stream else "response", gen.request_id, why, gen.completion_tokens,
            (time.perf_counter() - gen.started) * 1000.0,
        )

    async def _respond(self, send: Send) -> None:
        if self.gen.stream:
            await self._send_stream(send)
        else:
            await self._send_body(send)

    async def _close(self) -> None:
        await self.outputs.aclose()  # the metered stream's end writes the ledger row

    def _watch(self, scope: Scope, receive: Receive) -> Any:
        """A client that leaves cancels the generation at once: through the guarded protocol's
        connection watch when the server runs it, else a task waiting for `http.disconnect`.
        Returns what stops watching."""
        watch = scope.get(WATCH_KEY)
        if watch is not None:
            watch.on_lost(self.gen.cancel)
            return watch.forget
        return asyncio.get_running_loop().create_task(self._watch_disconnect(receive)).cancel

    async def _watch_disconnect(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gen.cancel()
                return

    def _headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        raw = [(b"content-type", content_type)]
        raw += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        return raw

    async def _send_stream(self, send: Send) -> None:
        # Pull the first output before the status line: an engine refusal can still be a proper error.
        try:
            first = await anext(self.outputs, None)
        except Exception as exc:
            await self._send_error(send, _error_for(exc))
            return
        headers = self._headers(b"text/event-stream; charset=utf-8")
        headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        opening = self.render.first()
        out = first
        pending: list[bytes] = [opening] if opening else []  # the chunks of one output leave in one send
        delta = self.render.delta
        try:
            while out is not None:
                if out.finish_reason == FINISH_CANCELLED:
                    if self.gen.cut:  # the server's drain ended it: the client is still there and is told
                        pending.append(self.render.error(draining_error()))
                        await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})
                    return
                for part in out.before or ():  # outputs that arrived together with this one
                    pending.append(delta(part.text, None, part.raw_choice))
                if out.finish_reason == FINISH_ERROR:
                    err = ServiceUnavailable(f"The engine failed this request: {out.error}", code="engine_error")
                    pending.append(self.render.error(err))
                    await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})
                    return
                if out.text or out.finished or out.raw_choice:
                    pending.append(delta(out.text, out.finish_reason, out.raw_choice))
                if out.finished:
                    break
                if pending:
                    await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
                    pending.clear()
                out = await anext(self.outputs, None)
        except OSError:
            raise
        except Exception as exc:
            log.exception("stream %s failed", self.gen.request_id)
            err = _error_for(exc)
            pending.append(self.render.error(err))
            await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})
            return
        pending.append(self.render.error(draining_error()) if out is None and self.gen.cut else self.render.end())
        await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})

    async def _send_body(self, send: Send) -> None:
        outputs: list[EngineOutput] = []
        try:
            async for out in self.outputs:
                outputs += out.before or ()
                outputs.append(out)
                if out.finished:
                    break
        except Exception as exc:
            await self._send_error(send, _error_for(exc))
            return
        await self._send_outputs(send, outputs)

    async def _send_outputs(self, send: Send, outputs: list[EngineOutput]) -> None:
        """One JSON body from the outputs of a finished generation (or its error)."""
        pieces: list[str] = []
        raw_choice: dict[str, Any] | None = None
        choices: list[dict[str, Any]] | None = None
        for out in outputs:
            pieces.append(out.text)
            raw_choice = out.raw_choice or raw_choice
            choices = out.choices or choices
        if self.gen.cut and self.gen.finish_reason in (None, FINISH_CANCELLED):
            await self._send_error(send, draining_error())  # the server's drain ended it; the client waits
            return
        if self.gen.finish_reason == FINISH_CANCELLED or self.gen.cancel_requested:
            return  # nobody is listening
        if self.gen.finish_reason == FINISH_ERROR:
            await self._send_error(send, ServiceUnavailable(f"The engine failed this request: {self.gen.error}", code="engine_error"))
            return
        body = self.render.body("".join(pieces), raw_choice, choices=choices) if choices else self.render.body("".join(pieces), raw_choice)
        headers = self._headers(b"application/json")
        headers.append((b"content-length", b"%d" % len(body)))  # one body: sized, not chunked
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _send_error(self, send: Send, err: APIError) -> None:
        status, body = self.render.error_body(err)
        headers = self._headers(b"application/json") + [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        headers.append((b"content-length", b"%d" % len(body)))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class CompletedResponse(GenerationResponse):
    """A one-body answer through `CompletionService.complete()`: the engine chain answers with one
    coroutine (engines that complete natively) instead of a stream of outputs through a generator per
    layer. The same watcher, errors and body as `GenerationResponse` for a non-streaming request."""

    def __init__(self, gen: Generation, service: Any, headers: dict[str, str], render: Any = None, *, admission: Admission) -> None:
        self.gen = gen
        self.service = service
        self.headers = headers
        self.render = render or ChunkRenderer(gen)
        self.admission = admission

    async def _respond(self, send: Send) -> None:
        try:
            final = await self.service.complete(self.gen, self.admission)  # the ledger row is written when this returns
        except Exception as exc:
            await self._send_error(send, _error_for(exc))
            return
        await self._send_outputs(send, [*final.before, final] if final.before else [final])

    async def _close(self) -> None:
        return None  # complete() has already ended the generation
