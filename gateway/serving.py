"""Turns a protocol request into one engine stream and meters it.

    prepare()  -> model, key permissions, prompt tokens, context and capacity checks
    metered()  -> the engine stream, with exactly one ledger row written in its `finally`
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from billing.keys import Principal
from billing.ledger import LedgerWriter, UsageRecord
from engines.base import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    SamplingParams,
)
from gateway.errors import (
    ContextLengthExceeded,
    EngineNotReady,
    EngineOverloaded,
    InvalidRequest,
    ModelNotFound,
    PermissionDenied,
)
from gateway.protocol import ChatCompletionRequest, CompletionRequest


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass
class Generation:
    """One admitted request on its way through an engine."""

    request_id: str
    principal: Principal
    engine: Engine
    engine_request: EngineRequest
    kind: str  # "chat" | "text"
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    ttft_ms: float | None = None
    queue_ms: float | None = None
    estimated: bool = False
    error: str | None = None
    cancel_requested: bool = False

    @property
    def model(self) -> str:
        return self.engine.model_id

    def cancel(self) -> None:
        """The client left: stop the engine request; the stream ends with `cancelled`."""
        self.cancel_requested = True
        cancel = getattr(self.engine, "cancel", None)
        if cancel is not None:
            cancel(self.request_id)


class CompletionService:
    def __init__(self, engines: dict[str, Engine], ledger: LedgerWriter) -> None:
        self.engines = engines
        self.ledger = ledger

    def engine_for(self, model: str, principal: Principal) -> Engine:
        engine = self.engines.get(model)
        if engine is None:
            raise ModelNotFound(f"The model {model!r} does not exist.", param="model")
        if not principal.may_use(model):
            raise PermissionDenied(f"This API key may not use the model {model!r}.", param="model", code="model_not_allowed")
        if not engine.ready:
            raise EngineNotReady(f"The model {model!r} is still loading; retry shortly.", headers={"Retry-After": "5"})
        return engine

    def prepare_chat(self, principal: Principal, request: ChatCompletionRequest, request_id: str) -> Generation:
        engine = self.engine_for(request.model, principal)
        messages = request.chat_messages()
        try:
            prompt_ids = engine.encode_chat(messages)
        except Exception as exc:  # a template may reject a role order
            raise InvalidRequest(f"messages could not be rendered with the model's chat template: {exc}", param="messages") from None
        return self._prepare(engine, principal, request, request_id, prompt_ids, request.requested_max_tokens(), "chat")

    def prepare_text(self, principal: Principal, request: CompletionRequest, request_id: str) -> Generation:
        engine = self.engine_for(request.model, principal)
        prompt = request.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = engine.encode_text(prompt)
            if not prompt_ids:
                raise InvalidRequest("prompt must not be empty", param="prompt")
        else:
            vocab = getattr(engine, "vocab_size", None)
            if any(t < 0 or (vocab is not None and t >= vocab) for t in prompt):
                raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = prompt
        return self._prepare(engine, principal, request, request_id, prompt_ids, request.max_tokens, "text")

    def _prepare(
        self,
        engine: Engine,
        principal: Principal,
        request: ChatCompletionRequest | CompletionRequest,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int | None,
        kind: str,
    ) -> Generation:
        room = engine.context_length - len(prompt_ids)
        if room < 1:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {engine.context_length} tokens; "
                f"the prompt has {len(prompt_ids)} tokens.",
                param="messages" if kind == "chat" else "prompt",
            )
        if not engine.has_capacity():
            raise EngineOverloaded("The engine is at capacity; retry shortly.", headers={"Retry-After": "1"})
        temperature = 1.0 if request.temperature is None else request.temperature
        sampling = SamplingParams(
            temperature=temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            stop=request.stop_sequences(),
        )
        engine_request = EngineRequest(
            request_id=request_id,
            max_tokens=min(max_tokens, room) if max_tokens is not None else room,
            sampling=sampling,
            prompt_token_ids=prompt_ids,
        )
        return Generation(
            request_id=request_id,
            principal=principal,
            engine=engine,
            engine_request=engine_request,
            kind=kind,
            stream=bool(request.stream),
            include_usage=request.include_usage(),
            prompt_tokens=len(prompt_ids),
        )

    async def metered(self, gen: Generation) -> AsyncIterator[EngineOutput]:
        """The engine's outputs; whatever happens, the ledger gets this request's one row."""
        status: str | None = None
        try:
            async with aclosing(gen.engine.stream(gen.engine_request)) as outputs:
                async for out in outputs:
                    self._observe(gen, out)
                    yield out
                    if out.finished:
                        break
        except EngineError as exc:
            status = "error"
            gen.error = str(exc) or type(exc).__name__
            raise
        except Exception as exc:
            status = "error"
            gen.error = type(exc).__name__
            raise
        finally:
            # Reached on completion, on engine failure, and when the consumer closes us early.
            self.ledger.record(self.usage_record(gen, status or final_status(gen)))

    def _observe(self, gen: Generation, out: EngineOutput) -> None:
        if gen.ttft_ms is None and out.token_ids:
            gen.ttft_ms = (time.perf_counter() - gen.started) * 1000.0
        gen.prompt_tokens = out.prompt_tokens or gen.prompt_tokens
        gen.completion_tokens = out.completion_tokens
        gen.estimated = gen.estimated or out.estimated
        if out.queue_ms is not None:
            gen.queue_ms = out.queue_ms
        if out.finished:
            gen.finish_reason = out.finish_reason
            gen.error = out.error

    def usage_record(self, gen: Generation, status: str) -> UsageRecord:
        finish = gen.finish_reason
        if status == "cancelled":
            finish = FINISH_CANCELLED
        return UsageRecord(
            request_id=gen.request_id,
            account_id=gen.principal.account_id,
            key_id=gen.principal.key_id,
            model=gen.model,
            prompt_tokens=gen.prompt_tokens,
            completion_tokens=gen.completion_tokens,
            status=status,
            finish_reason=finish,
            total_ms=(time.perf_counter() - gen.started) * 1000.0,
            queue_ms=gen.queue_ms,
            ttft_ms=gen.ttft_ms,
            estimated=gen.estimated,
        )


def final_status(gen: Generation) -> str:
    if gen.finish_reason == FINISH_ERROR:
        return "error"
    if gen.finish_reason in (None, FINISH_CANCELLED):
        return "cancelled"
    return "completed"


def usage_body(gen: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
    }
