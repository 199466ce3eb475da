"""Turns a protocol request into one engine stream and meters it.

    prepare()  -> model, key permissions, prompt tokens, context checks (questions only)
    admit()    -> an Admission (gateway/serving/admission.py): the engine's place (its one capacity check), the worst case reserved, the journal entry
    metered()  -> the engine stream; its `finally` settles the admission (the one ledger row)
    complete() -> the same for a one-body answer from an engine that completes natively (one coroutine)
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from billing.keys.store import Principal
from billing.ledger.writer import LedgerWriter
from billing.prices.book import PriceBook
from billing.quota import Limiter
from engines.base import (
    FINISH_CANCELLED,
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    EngineRequestRejected,
    SamplingParams,
)
from engines.wrappers.router import router_of
from gateway.batches.line import BatchLine
from gateway.serving.admission import Admission, Meter, Usage, share_of
from gateway.http.errors import (
    APIError,
    ContextLengthExceeded,
    EngineNotReady,
    InvalidRequest,
    ModelNotFound,
    PermissionDenied,
)
from gateway.api.anthropic.protocol import MessagesRequest
from gateway.api.openai.responses_protocol import ResponsesRequest
from gateway.api.openai.protocol import ChatCompletionRequest, CompletionRequest, parse


log = logging.getLogger("tollgate.serving")


@dataclass
class Generation(Usage):
    """One admitted request on its way through an engine; its Usage (what its ledger row says) as it goes."""

    request_id: str
    principal: Principal
    engine: Engine
    engine_request: EngineRequest
    kind: str  # "chat" | "text"
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    error: str | None = None
    cancel_requested: bool = False
    stop_sequence: str | None = None  # the stop string that ended it, when the engine says

    @property
    def model(self) -> str:
        return self.engine.model_id

    def cancel(self) -> None:
        """The client left: stop the engine request; the stream ends with `cancelled`."""
        self.cancel_requested = True
        self.engine.cancel(self.request_id)

    def cut_short(self) -> None:
        """The server is shutting down: stop the engine request; the stream ends with an error
        event and the row says `interrupted`."""
        self.cut = True
        self.cancel()


class CompletionService:
    def __init__(
        self,
        engines: dict[str, Engine],
        ledger: LedgerWriter,
        *,
        limiter: Limiter | None = None,
        prices: PriceBook | None = None,
        meter: Meter | None = None,
    ) -> None:
        self.engines = engines
        self.meter = meter or Meter(ledger, limiter=limiter, prices=prices)
        self.ledger = self.meter.ledger
        self.limiter = self.meter.limiter
        self.prices = self.meter.prices

    @property
    def on_quota_rejected(self) -> list[Any]:
        return self.meter.on_quota_rejected

    async def admit(self, gen: Generation, line: BatchLine | None = None) -> Admission:
        """Takes the engine's place, reserves the worst case and journals the admission (Meter.admit);
        the Admission's `settle()` ends it. `line`: the batch line it is."""
        request = gen.engine_request
        worst_completion = request.max_tokens * request.sequences  # every sequence may run to max_tokens
        return await self.meter.admit(
            gen.request_id, gen.principal, gen.model, gen,
            tokens=gen.prompt_tokens + worst_completion,
            cost=lambda price: price.cost_nanos(gen.prompt_tokens, worst_completion),
            slot=(gen.engine, request),
            cut=gen.cut_short,
            line=line,
        )

    async def admit_hit(self, gen: Generation, prompt: int, completion: int, hit_price: Decimal) -> Admission:
        """A response-cache hit: no engine place; its tokens count against token limits like the
        original's, and it costs `hit_price` times what the request would cost (billing/prices/book)."""
        gen.hit = True
        admission = await self.meter.admit(
            gen.request_id, gen.principal, gen.model, gen,
            tokens=prompt + completion,
            cost=lambda price: share_of(price.cost_nanos(prompt, completion), hit_price),  # its row's cost, delivered whole
        )
        gen.prompt_tokens = prompt
        return admission

    async def drain(self, timeout: float = 10.0) -> None:
        """Waits for background settlements (shutdown and tests)."""
        await self.meter.drain(timeout)

    def resolve(self, raw: Any, kind: str) -> tuple[Any, Engine | None]:
        """The request body and its model's engine, looked up once for the whole request (None: no
        such model, refused by `engine_for` once the body has been parsed). A routing model (`auto`)
        names the model it chooses, in the body too."""
        name = raw.get("model") if isinstance(raw, dict) else None
        engine = self.engines.get(name) if isinstance(name, str) else None
        router = router_of(engine) if engine is not None else None
        if router is None:
            return raw, engine
        chosen = router.choose(raw, kind)
        return {**raw, "model": chosen}, self.engines.get(chosen)

    def engine_for(self, model: str, principal: Principal, engine: Engine | None = None) -> Engine:
        """The engine of `model` (`engine`: already resolved) if this key may use it and it is ready."""
        if engine is None:
            engine = self.engines.get(model)
        if engine is None:
            raise ModelNotFound(f"The model {model!r} does not exist.", param="model")
        if not (principal.may_use(model) or principal.may_use(engine.model_id)):  # an alias or its model
            raise PermissionDenied(f"This API key may not use the model {model!r}.", param="model", code="model_not_allowed")
        if not engine.ready:
            raise EngineNotReady(f"The model {model!r} is still loading; retry shortly.", headers={"Retry-After": "5"})
        return engine

    def prepare_chat(self, principal: Principal, request: ChatCompletionRequest, request_id: str, engine: Engine | None = None) -> Generation:
        engine = self.engine_for(request.model, principal, engine)
        prompt_ids = self.chat_prompt(engine, request, "messages")
        return self._prepare(engine, principal, request, request_id, prompt_ids, request.requested_max_tokens(), "chat")

    def prepare_text(self, principal: Principal, request: CompletionRequest, request_id: str, engine: Engine | None = None) -> Generation:
        engine = self.engine_for(request.model, principal, engine)
        prompt = request.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = engine.renderer.encode_text(prompt)
            if not prompt_ids:
                raise InvalidRequest("prompt must not be empty", param="prompt")
        else:
            vocab = engine.vocab_size
            if any(t < 0 or (vocab is not None and t >= vocab) for t in prompt):
                raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = prompt
        return self._prepare(engine, principal, request, request_id, prompt_ids, request.max_tokens, "text", api="completions")

    def prepare_messages(self, principal: Principal, request: MessagesRequest, request_id: str) -> Generation:
        """An Anthropic Messages request, as the chat completion it translates to (`chat_body`)."""
        body = request.chat_body()  # also the request's raw_body from here on
        routed, engine = self.resolve(body, "chat")
        body["model"] = routed["model"]  # a routing model (`auto`) names the one it chooses
        engine = self.engine_for(body["model"], principal, engine)
        prompt_ids = self.prompt_of(engine, body, "messages")
        return self._prepare(engine, principal, request, request_id, prompt_ids, request.max_tokens, "chat", api="messages")

    def prepare_responses(self, principal: Principal, request: ResponsesRequest, request_id: str, history: list[dict[str, Any]]) -> Generation:
        """An OpenAI Responses request (its instructions, earlier turns from previous_response_id and
        input), as the chat completion it translates to (`chat_body`)."""
        body = request.chat_body(history)  # also the request's raw_body from here on
        try:
            routed, engine = self.resolve(body, "chat")
            body["model"] = routed["model"]  # a routing model (`auto`) names the one it chooses
            engine = self.engine_for(body["model"], principal, engine)
        except ModelNotFound:  # the Responses API answers an unknown model with a 400 (chat: 404)
            raise InvalidRequest(f"The requested model {body['model']!r} does not exist.", param="model", code="model_not_found") from None
        prompt_ids = self.prompt_of(engine, body, "input", RESPONSES_PARAMS)
        need = request.max_output_tokens or 1
        if request.truncation == "auto" and len(prompt_ids) + need > engine.context_length:
            # The fewest first items to drop for the prompt and its bound to fit, by bisection: each try
            # renders and counts the whole prompt on the loop, so a long history costs log2(items) of them.
            conversation, low, high = body["messages"], 1, request.droppable()
            while low < high:
                middle = (low + high) // 2
                request.keep_from(conversation, middle)
                if len(self.prompt_of(engine, body, "input", RESPONSES_PARAMS)) + need <= engine.context_length:
                    high = middle
                else:
                    low = middle + 1
            request.keep_from(conversation, high)  # none fits: the most that may go, and _prepare's 400
            prompt_ids = self.prompt_of(engine, body, "input", RESPONSES_PARAMS)
        try:
            return self._prepare(engine, principal, request, request_id, prompt_ids, request.max_output_tokens, "chat", api="responses")
        except InvalidRequest as err:  # the engine's refusal of a chat field: named as the Responses API names it
            raise renamed(err, RESPONSES_PARAMS) from None

    def prompt_of(self, engine: Engine, body: dict[str, Any], param: str, renames: Renames = ()) -> list[int]:
        """The prompt ids of another API's request translated to a chat completion `body`, which
        this engine must take as it takes a chat completion (the same checks, the same messages);
        a refusal names the field of the API the client spoke (`renames`). Counted as prepare_chat
        counts (`chat_prompt`)."""
        return self.chat_prompt(engine, chat_equivalent(body, engine.passthrough, renames), param)

    @staticmethod
    def chat_prompt(engine: Engine, chat: ChatCompletionRequest, param: str) -> list[int]:
        """A chat completion's prompt ids as this engine prefills and bills them: what its
        reservation holds and, where the engine reports no usage, what its row is billed.

        An engine that renders tools itself (hf with a tool parser) gets the messages as sent and
        is counted with the tools shown to the model. A pass-through engine gets the body as sent,
        tools and all, and its chat template may show every tool (vLLM shows them even with
        tool_choice "none"): they are counted where the engine can count them (`tool_encoder`), so
        a long tool list is reserved for before the engine prefills it."""
        renders_tools = not engine.passthrough and chat.uses_tools() and engine.renders_tools
        messages = chat.raw_messages() if engine.passthrough or renders_tools else chat.chat_messages()
        renderer = engine.renderer
        try:
            if renders_tools:
                return renderer.encode_chat(messages, chat.prompt_tools())  # type: ignore[call-arg]
            bills_tools = tool_encoder(engine) if engine.passthrough and chat.tools else None
            return bills_tools(messages, chat.tools) if bills_tools is not None else renderer.encode_chat(messages)
        except EngineRequestRejected as exc:  # a part the engine cannot count (a pool's non-text parts): named
            raise InvalidRequest(str(exc), param=exc.param, code=exc.code) from None
        except Exception as exc:  # a template may reject a role order
            raise InvalidRequest(f"{param} could not be rendered with the model's chat template: {exc}", param=param) from None

    def _prepare(
        self,
        engine: Engine,
        principal: Principal,
        request: ChatCompletionRequest | CompletionRequest | MessagesRequest | ResponsesRequest,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int | None,
        kind: str,
        *,
        api: str = "chat",
    ) -> Generation:
        room = engine.context_length - len(prompt_ids)
        part = "messages" if kind == "chat" else "prompt"
        if room < 1:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {engine.context_length} tokens; "
                f"the prompt has {len(prompt_ids)} tokens.",
                param=part,
            )
        if max_tokens is not None and max_tokens > room:
            # Refused, not cut to the room: OpenAI, Anthropic, vLLM and trtllm-serve all refuse a prompt
            # and completion bound that together pass the context: the client learns that the model cannot
            # give what it asked for instead of getting a shorter bound in silence.
            raise ContextLengthExceeded(
                f"This model's maximum context length is {engine.context_length} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the {part}, {max_tokens} in the completion). "
                f"Please reduce the length of the {part} or completion.",
                param=part,
            )
        choices = getattr(request, "choices", None)  # n (and best_of): OpenAI's generation requests only
        n, best_of = choices(engine.max_choices) if choices is not None else (1, 1)
        temperature = 1.0 if request.temperature is None else request.temperature
        sampling = SamplingParams(
            temperature=temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            stop=request.stop_sequences(),
        )
        engine_request = EngineRequest(
            request_id=request_id,
            max_tokens=max_tokens if max_tokens is not None else room,
            sampling=sampling,
            prompt_token_ids=prompt_ids,
            extra=request.raw_body or None,
            account_id=principal.account_id,
            priority=principal.priority,
            n=n,
            best_of=best_of,
        )
        try:
            engine.renderer.check_request(engine_request)  # tools, response_format: what this engine honours
        except EngineRequestRejected as exc:
            raise InvalidRequest(str(exc), param=exc.param, code=exc.code) from None
        # The engine's refusal is not asked here: admission asks it once as its first step (Meter.admit:
        # engine.admit, before any quota is held); answer() asks it for a cache hit, which takes no place.
        return Generation(
            request_id=request_id,
            principal=principal,
            engine=engine,
            engine_request=engine_request,
            kind=kind,
            stream=bool(request.stream),
            include_usage=request.include_usage(),
            prompt_tokens=len(prompt_ids),
            api=api,
        )

    async def metered(self, gen: Generation, admission: Admission) -> AsyncIterator[EngineOutput]:
        """The engine's outputs; whatever happens, the admission is settled (its one ledger row)."""
        status: str | None = None
        last: EngineOutput | None = None
        seen: EngineOutput | None = None
        try:
            if gen.cancel_requested:
                # The client left before the engine had the request (between its admission and this
                # stream): the engine never sees it. Asked now, a scheduler that has given up its
                # place would admit it afresh, and perhaps refuse it: an `error` row for a client that left.
                gen.unrun = True
                return
            async with aclosing(gen.engine.stream(gen.engine_request)) as outputs:
                async for out in outputs:
                    if last is not None:
                        break  # an engine that goes on after its final output: nothing after it counts
                    seen = out
                    # The engine's stream has the request: the place admit() took is the stream's now,
                    # freed when it ends; settling has none left to give back.
                    admission.slot = None
                    self._observe(gen, out)
                    if gen.cancel_requested and not out.finished:
                        # The client left before the engine saw the request: closing the stream cancels it.
                        break
                    if out.finished:
                        # Held back until the row is journaled: a client that saw the end has its row. The
                        # stream is read on to its end (right after this): every layer finishes by itself
                        # instead of being closed while suspended.
                        last = out
                        continue
                    yield out
        except Exception as exc:
            status = "error"
            gen.error = failure_text(exc)
            raise
        finally:
            if last is None and seen is not None and seen.estimated:
                # Closed early: the engine, closed by now, may have raised its estimate (EngineOutput).
                gen.completion_tokens = max(gen.completion_tokens, seen.completion_tokens)
            admission.settle(status)  # on completion, on engine failure, and when the consumer closes us early
        if last is not None:
            yield last

    async def complete(self, gen: Generation, admission: Admission) -> EngineOutput:
        """`metered()` for a client that wants one body, through the engine's native `complete()`:
        the final output (earlier ones in its `before`); whatever happens, the admission is settled
        before the caller sees the result."""
        failed = False
        try:
            if gen.cancel_requested:  # the client left before the engine had the request: as `metered`
                out = EngineOutput("", [], FINISH_CANCELLED, gen.prompt_tokens, 0, unrun=True)
            else:
                out = await gen.engine.complete(gen.engine_request)
            self._observe(gen, out)
            return out
        except Exception as exc:
            failed, gen.error = True, failure_text(exc)
            raise
        finally:
            admission.settle("error" if failed else None)

    def live_count(self) -> int:
        return self.meter.live_count()

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every admitted request has been settled within `timeout` seconds."""
        return await self.meter.wait_idle(timeout)

    def cut_live(self) -> int:
        """Ends every running generation (graceful drain's deadline); returns how many."""
        return self.meter.cut_live()

    def _observe(self, gen: Generation, out: EngineOutput) -> None:
        if gen.ttft_ms is None:
            if out.first_token_at is not None:  # an engine that yields only at the end says when it began
                gen.ttft_ms = (out.first_token_at - gen.started) * 1000.0
            elif out.token_ids or out.text or out.raw_choice or out.before:
                gen.ttft_ms = (time.perf_counter() - gen.started) * 1000.0
        gen.prompt_tokens = out.prompt_tokens or gen.prompt_tokens
        gen.completion_tokens = out.completion_tokens
        gen.estimated = out.estimated  # the latest counts say whether they are estimates
        if out.queue_ms is not None:
            gen.queue_ms = out.queue_ms
        if out.cached_tokens is not None:
            gen.cached_tokens = out.cached_tokens
        if out.finished:
            gen.finish_reason = out.finish_reason
            gen.unrun = out.unrun
            gen.error = out.error
            gen.stop_sequence = out.stop_sequence
            gen.recorded_finish = out.recorded_finish


# A chat field's name -> the Responses API's, each rule a pattern on the start of the name and what it
# becomes: `text.format` holds the schema itself (chat's `response_format.json_schema.schema` is its
# `text.format.schema`), a function tool is flat (chat's `tools[0].function.name` is its
# `tools[0].name`), and `input` names every turn (a chat message's index is not the input's).
Renames = tuple[tuple[re.Pattern[str], str], ...]
RESPONSES_PARAMS: Renames = tuple((re.compile(pattern), own) for pattern, own in (
    (r"^response_format\.json_schema(?=$|[.\[])", "text.format"),
    (r"^response_format(?=$|[.\[])", "text.format"),
    (r"^tools\[(\d+)\]\.function(?=$|[.\[])", r"tools[\1]"),
    (r"^messages(?:$|[.\[].*$)", "input"),
))


def renamed(err: APIError, renames: Renames) -> APIError:
    """An error about a translated chat completion, naming the field of the API the client spoke."""
    param = err.param or ""
    for pattern, own in renames:
        found = pattern.match(param)
        if found is not None:
            theirs = found.expand(own)
            err.param = theirs + param[found.end():]
            err.message = err.message.replace(found.group(0), theirs)
            if theirs == "input":  # chat's word for the turns, wherever the message says it
                err.message = err.message.replace("messages", "input")
            break
    return err


def tool_encoder(engine: Engine) -> Callable[[list[dict[str, Any]], list[Any]], list[int]] | None:
    """The encode_chat(messages, tools) that counts a request's tools as the engine bills them, or
    None when it counts the messages only: what the engine declares (the scheduler answers as the
    engine it wraps, a fallback chain as its encoder)."""
    return engine.tool_encoder()


def chat_equivalent(body: dict[str, Any], passthrough: bool, renames: Renames) -> ChatCompletionRequest:
    """`body` as a chat completion request, refused where a chat completion with it would be for
    this engine. `stop` is left out of the check: other APIs allow more stop sequences than chat's 4,
    and the sampling fields come from their own request."""
    try:
        return parse(ChatCompletionRequest, {k: v for k, v in body.items() if k != "stop"}, passthrough=passthrough)  # type: ignore[no-any-return]
    except InvalidRequest as err:
        raise renamed(err, renames) from None


def failure_text(exc: Exception) -> str:
    """What the ledger row says of a failed generation: an engine's own message, else only the
    exception's type (its text may hold anything)."""
    if isinstance(exc, EngineError):
        return str(exc) or type(exc).__name__
    return type(exc).__name__


def usage_body(gen: Generation) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
    }
    if gen.cached_tokens is not None:  # the engine said how much of the prompt its cache served (the row's cached_tokens)
        usage["prompt_tokens_details"] = {"cached_tokens": min(gen.cached_tokens, gen.prompt_tokens)}
    return usage
