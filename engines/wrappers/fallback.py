"""One public model id served by an ordered list of engines: the first that can take a request
gets it, and a failure before the first output moves the request to the next one.

Engines may be shared (a model's engine can also be another model's fallback, and aliases
point at the same wrapper): `SharedLifecycle` starts and stops each engine once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from engines.base import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    Engine,
    EngineError,
    EngineOutput,
    EngineOverloadedError,
    EngineRequest,
    EngineRequestRejected,
)
from engines.backends.openai_stream import content_text

log = logging.getLogger("tollgate.engines.fallback")


class PromptIds(list[int]):
    """Prompt token ids that remember which engine's tokenizer made them."""

    def __init__(self, ids: list[int], encoder: Engine) -> None:
        super().__init__(ids)
        self.encoder = encoder


class SharedLifecycle:
    """Starts every engine at most once however many models share it, and stops it once."""

    def __init__(self) -> None:
        self._starts: dict[int, asyncio.Future[None]] = {}
        self._stopped: set[int] = set()

    async def start(self, engines: list[Engine]) -> list[BaseException | None]:
        futures = []
        for engine in engines:
            future = self._starts.get(id(engine))
            if future is None:
                future = self._starts[id(engine)] = asyncio.ensure_future(engine.start())
            futures.append(future)
        return list(await asyncio.gather(*(asyncio.shield(f) for f in futures), return_exceptions=True))

    async def stop(self, engines: list[Engine]) -> None:
        for engine in engines:
            if id(engine) in self._stopped:
                continue
            self._stopped.add(id(engine))
            future = self._starts.get(id(engine))
            if future is not None and not future.done():
                future.cancel()
            try:
                await engine.stop()
            except Exception:
                log.exception("stopping an engine of %s failed", getattr(engine, "model_id", "?"))


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Chat messages as role + text, the shape every chat template takes."""
    out = []
    for m in messages:
        role = m.get("role", "user")
        out.append({"role": "system" if role == "developer" else role, "content": content_text(m.get("content"))})
    return out


def _failed_before_output(out: EngineOutput) -> bool:
    """An error output that came before any output: another engine may serve the request. One after
    output came (in `before`, or gathered into a one-body answer: `first_token_at`) ends it here, so
    nothing is generated twice and its row holds what was."""
    return out.finish_reason == FINISH_ERROR and not out.before and out.first_token_at is None


class FallbackEngine(Engine):
    def __init__(
        self,
        model_id: str,
        candidates: list[Engine],
        *,
        context_length: int | None = None,
        lifecycle: SharedLifecycle | None = None,
    ) -> None:
        if not candidates:
            raise ValueError("a model needs at least one engine")
        self.model_id = model_id
        self.candidates = candidates
        self._context_length = context_length
        self._lifecycle = lifecycle or SharedLifecycle()
        self._routes: dict[str, Engine | None] = {}  # request id -> the engine serving it (None: choosing)
        self._cancelled: set[str] = set()  # cancelled while between engines

    @property
    def primary(self) -> Engine:
        return self.candidates[0]

    @property
    def owned_by(self) -> str:  # type: ignore[override]
        return self.primary.owned_by

    @property
    def passthrough(self) -> bool:  # type: ignore[override]
        # Pass-through only if every engine honours the fields: a fallback must not drop them.
        return all(c.passthrough for c in self.candidates)

    @property
    def max_choices(self) -> int:  # type: ignore[override]
        # A fallback must be able to serve every choice asked of the primary.
        return min(c.max_choices for c in self.candidates)

    def check_request(self, request: EngineRequest) -> None:
        super().check_request(request)
        for candidate in self.candidates:  # what any of them refuses, a fallback must not run there
            if candidate.passthrough:
                candidate.check_request(request)

    def runners(self) -> list[Engine]:
        return list(self.candidates)

    def encoder(self) -> Engine:
        """The engine whose tokenizer counts prompts at admission: the first one loaded."""
        return next((c for c in self.candidates if c.ready), self.primary)

    def tool_encoder(self) -> Callable[[list[dict[str, Any]], list[Any]], list[int]] | None:
        return self.encoder().tool_encoder()  # the tokenizer that counts the chain's prompts

    @property
    def context_length(self) -> int:  # type: ignore[override]
        return self._context_length or self.encoder().context_length

    @property
    def vocab_size(self) -> int | None:  # type: ignore[override]
        return self.encoder().vocab_size

    @property
    def ready(self) -> bool:
        return any(c.ready for c in self.candidates)

    @property
    def healthy(self) -> bool:
        return any(c.ready and c.healthy for c in self.candidates)

    async def start(self) -> None:
        outcomes = await self._lifecycle.start(self.candidates)
        for engine, outcome in zip(self.candidates, outcomes):
            if outcome is not None:
                log.error("model %s: engine %s failed to start: %s", self.model_id, engine.model_id, outcome)
        if all(o is not None for o in outcomes):
            raise EngineError(f"no engine of {self.model_id} started: {outcomes[0]}")

    async def stop(self) -> None:
        await self._lifecycle.stop(self.candidates)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        encoder = self.encoder()
        return PromptIds(encoder.encode_chat(messages), encoder)

    def encode_text(self, prompt: str) -> list[int]:
        encoder = self.encoder()
        return PromptIds(encoder.encode_text(prompt), encoder)

    def has_capacity(self) -> bool:
        return any(self._available(c) for c in self.candidates)

    def requests_in_flight(self) -> int:
        return len(self._routes)

    def refusal(self, request: EngineRequest) -> EngineOverloadedError | None:
        """None when some engine of the chain would take the request, else the refusal that
        clears soonest."""
        refusals = []
        for engine in self.candidates:
            if not (engine.ready and engine.healthy):
                continue
            refused = engine.refusal(request)
            if refused is None:
                return None
            refusals.append(refused)
        if not refusals:
            return EngineOverloadedError(f"no engine of {self.model_id} can take a request now")
        return min(refusals, key=lambda r: r.retry_after)

    def admit(self, request: EngineRequest) -> None:
        """A place at the first engine of the chain that takes the request, else the refusal that
        clears soonest."""
        refusals = []
        for engine in self.candidates:
            if not (engine.ready and engine.healthy):
                continue
            try:
                engine.admit(request)
            except EngineOverloadedError as refused:
                refusals.append(refused)
                continue
            return
        if not refusals:
            raise EngineOverloadedError(f"no engine of {self.model_id} can take a request now")
        raise min(refusals, key=lambda r: r.retry_after)

    def release(self, request_id: str) -> None:
        for engine in self.candidates:
            engine.release(request_id)

    def cancel(self, request_id: str) -> None:
        if request_id not in self._routes:  # not streaming: an engine may hold a place for it (a scheduler)
            for engine in self.candidates:
                engine.cancel(request_id)
            return
        self._cancelled.add(request_id)  # no further engine is tried for it
        engine = self._routes[request_id]
        if engine is not None:
            engine.cancel(request_id)

    @staticmethod
    def _available(engine: Engine) -> bool:
        return engine.ready and engine.healthy and engine.has_capacity()

    def request_for(self, engine: Engine, request: EngineRequest) -> EngineRequest | None:
        """The request as `engine` needs it: prompt ids from its own tokenizer, max_tokens
        within its context. None when it cannot take the prompt."""
        ids = request.prompt_token_ids
        if isinstance(ids, PromptIds) and ids.encoder is not engine:
            try:
                ids = self._encode_for(engine, request)
            except Exception as exc:
                log.warning("model %s: %s cannot encode the prompt: %s", self.model_id, engine.model_id, exc)
                return None
            if ids is None:
                return None
        room = engine.context_length - len(ids or [])
        if room < 1:
            return None
        if ids is request.prompt_token_ids and request.max_tokens <= room:
            return request  # as it came (the primary, usually): no copy
        return dataclasses.replace(request, prompt_token_ids=ids, max_tokens=min(request.max_tokens, room))

    @staticmethod
    def _encode_for(engine: Engine, request: EngineRequest) -> list[int] | None:
        body = request.extra or {}
        messages = body.get("messages", request.messages)
        if messages is not None:
            return engine.encode_chat(messages if engine.passthrough else plain_messages(messages))
        prompt = body.get("prompt", request.prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return engine.encode_text(prompt)
        return None

    @property
    def completes(self) -> bool:  # type: ignore[override]
        return all(c.completes for c in self.candidates)

    async def complete(self, request: EngineRequest) -> EngineOutput:
        """`stream()` for a one-body answer: the same order of candidates and the same reasons to
        move on, each candidate asked with its own `complete()`."""
        tries = _Tries(self, request)
        try:
            for engine, sub in tries:
                try:
                    out = await engine.complete(sub)
                except EngineRequestRejected:
                    raise
                except EngineError as exc:
                    tries.refused(engine, exc)
                    continue
                if _failed_before_output(out):
                    tries.failed(engine, out.error)
                    continue
                tries.served(engine)
                return out
            if tries.cancelled:
                return tries.cancelled_output()
        finally:
            tries.end()
        raise tries.exhausted()

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        tries = _Tries(self, request)
        try:
            for engine, sub in tries:
                outputs = engine.stream(sub)
                try:
                    first = await anext(outputs)
                except EngineRequestRejected:
                    await outputs.aclose()
                    raise
                except (EngineError, StopAsyncIteration) as exc:
                    await outputs.aclose()
                    tries.refused(engine, exc)
                    continue
                if _failed_before_output(first):
                    await outputs.aclose()
                    tries.failed(engine, first.error)
                    continue
                tries.served(engine)
                try:
                    yield first
                    if not first.finished:
                        async for out in outputs:  # read to its end: the engine's stream ends after its final output
                            yield out
                finally:
                    await outputs.aclose()
                return
            if tries.cancelled:
                yield tries.cancelled_output()
                return
        finally:
            tries.end()
        raise tries.exhausted()


class _Tries:
    """One request's way down a chain: the candidates that can take it, in order (each with the
    request as it needs it), and why each one it left did not serve it."""

    def __init__(self, chain: FallbackEngine, request: EngineRequest) -> None:
        self.chain = chain
        self.request = request
        self.reasons: list[str] = []
        self.busy_only = True  # every engine tried was only full, not broken
        self.cancelled = False  # the client left: no further engine is tried
        chain._routes[request.request_id] = None

    def __iter__(self) -> Iterator[tuple[Engine, EngineRequest]]:
        chain, rid = self.chain, self.request.request_id
        for engine in chain.candidates:
            if rid in chain._cancelled:
                self.cancelled = True
                return
            if not chain._available(engine):
                continue
            sub = chain.request_for(engine, self.request)
            if sub is None:
                continue
            chain._routes[rid] = engine
            yield engine, sub

    def refused(self, engine: Engine, exc: BaseException) -> None:
        self.chain._routes[self.request.request_id] = None
        self.busy_only = self.busy_only and isinstance(exc, EngineOverloadedError)
        self.reasons.append(f"{engine.model_id}: {exc or type(exc).__name__}")

    def failed(self, engine: Engine, error: str | None) -> None:
        self.chain._routes[self.request.request_id] = None
        self.busy_only = False
        self.reasons.append(f"{engine.model_id}: {error}")

    def served(self, engine: Engine) -> None:
        chain = self.chain
        for other in chain.candidates:  # the place admit() took may be at another engine of the chain
            if other is not engine:
                other.release(self.request.request_id)
        if engine is not chain.primary:
            log.warning("model %s served by fallback %s (%s)", chain.model_id, engine.model_id, "; ".join(self.reasons) or "unavailable")

    def cancelled_output(self) -> EngineOutput:
        return EngineOutput("", [], FINISH_CANCELLED, len(self.request.prompt_token_ids or []), 0, unrun=True)

    def end(self) -> None:
        self.chain._routes.pop(self.request.request_id, None)
        self.chain._cancelled.discard(self.request.request_id)

    def exhausted(self) -> EngineError:
        if not self.reasons or self.busy_only:
            return EngineOverloadedError(f"no engine of {self.chain.model_id} can take a request now")
        return EngineError(f"every engine of {self.chain.model_id} failed: {self.reasons[-1]}")
