"""The one streaming interface every backend implements.

A request goes in (prompt token ids or chat messages, sampling parameters, max tokens, stop
strings); `Engine.stream()` yields increments (text delta + the engine's token ids) and ends
with one output carrying the finish reason and exact prompt/completion token counts.
Closing the iterator early (or `cancel()`) cancels the engine request and frees its slot.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

# Finish reasons: OpenAI's "stop" and "length", plus "cancelled" (client left) and "error".
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"
# An end the engine's source reports that clients know only as "length" (the answer was cut short):
# the ledger records it as it came (EngineOutput.recorded_finish).
FINISH_TIMEOUT = "timeout"
FINISH_UPSTREAM_CANCELLED = "cancelled"


# transformers' from_pretrained patches process-global state while it builds a model (meta-device
# initialisation); two loads in parallel threads can leave one model's tensors on `meta`. Its lazy
# module also fails imports made by two threads at once ("cannot import name 'AutoModelForCausalLM'
# from 'transformers'", seen when the chat and embedding models started together), so every
# `from transformers import ...` made while the engines start happens under this lock too.
MODEL_LOAD_LOCK = threading.RLock()


class EngineError(Exception):
    """The engine failed a request."""


class EngineOverloadedError(EngineError):
    """The engine has no room for another request right now. `retry_after`: seconds after which a
    retry may be taken; `own_backlog`: the caller's own queued requests are most of the wait."""

    def __init__(self, message: str = "", *, retry_after: int = 1, own_backlog: bool = False) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.own_backlog = own_backlog


class EngineRequestRejected(EngineError):
    """The engine refused the request itself as invalid (a client error, not an engine failure)."""

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.param = param
        self.code = code


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class EngineRequest:
    request_id: str
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    # The client's JSON body: engines that pass fields through (`Engine.passthrough`) forward it.
    extra: dict[str, Any] | None = None
    # Who asks, for the gateway's scheduler (engines/wrappers/scheduler.py): fair share is per account,
    # order is by priority class (the account's plan); None: no account / the default class.
    account_id: int | None = None
    priority: str | None = None
    # Choices the client asked for (OpenAI's `n`) and sequences the engine generates for them
    # (`best_of`, text completions; at least n). Only engines with `max_choices` > 1 get n > 1.
    n: int = 1
    best_of: int = 1

    @property
    def sequences(self) -> int:
        """Sequences the engine generates: what the quota reserves max_tokens for."""
        return max(self.n, self.best_of)


@dataclass
class EngineOutput:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # set on the last output only
    prompt_tokens: int = 0
    # Cumulative. An estimate (`estimated`) may be raised after the output was yielded, once only: by
    # an engine whose stream is closed before its final output (the client left, a write failed), to
    # the count of everything it relayed, which is what the request's row is then billed.
    completion_tokens: int = 0
    estimated: bool = False  # counts not from the engine's own token ids
    # On a final output: no engine had the request (dropped from a queue, or the client left first):
    # it used nothing, and its row counts no token.
    unrun: bool = False
    error: str | None = None
    queue_ms: float | None = None  # time the request waited (gateway queue + inside the engine) before running
    # A pass-through engine's choice object, in the shape the client's response uses (a chunk's
    # choice with `delta` when streaming, the whole choice with `message` otherwise): relayed as is.
    raw_choice: dict[str, Any] | None = None
    # Outputs that arrived together with this one, in order, carried by it so that the chain of
    # engines and the response handle one object for the lot: each is relayed as its own chunk
    # before this one. Their counts are folded into this one's (cumulative) counts.
    before: list["EngineOutput"] | None = None
    # When the first output token of this request arrived (time.perf_counter()), for an engine
    # that yields nothing until the end (a pool collecting a non-streamed answer): the TTFT.
    first_token_at: float | None = None
    # Prompt tokens the engine served from its prefix (KV) cache, when it says (TensorRT-LLM's
    # result.cached_tokens, an upstream's usage.prompt_tokens_details.cached_tokens); the last output's counts.
    cached_tokens: int | None = None
    # The stop string that ended the request (finish_reason "stop"), when the engine says which.
    stop_sequence: str | None = None
    # What the ledger records instead of finish_reason: the engine's source ended the request early
    # (FINISH_TIMEOUT, or FINISH_UPSTREAM_CANCELLED while the client was still there); the client sees "length".
    recorded_finish: str | None = None
    # Every choice of a request with n > 1, on the final output of a non-streamed one: the whole
    # choice objects (`message` or `text`, each with its `index`), in order. Streamed, each output
    # carries one choice's chunk in `raw_choice` instead.
    choices: list[dict[str, Any]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine(abc.ABC):
    """A backend serving one model id."""

    model_id: str
    context_length: int
    vocab_size: int | None = None
    owned_by: str = "tollgate"
    # True: the engine forwards the client's fields (tools, response_format, logprobs, ...) to a
    # server that honours them, so the gateway skips its own unsupported-parameter checks.
    passthrough: bool = False
    # The most choices (OpenAI's `n`, and `best_of` sequences) one request may ask of this engine;
    # above it the gateway answers 400 naming the field. 1: one metered choice per request.
    max_choices: int = 1
    # True: the model's completions may be served from the gateway's response cache (models.yaml `cache:`).
    response_cache: bool = False

    @property
    def renders_tools(self) -> bool:
        """Whether the engine renders a request's tools into its own prompt (a tool parser is set):
        the gateway then sends the messages as the client wrote them, with `encode_chat(messages, tools)`."""
        return False

    def tool_encoder(self) -> Callable[[list[dict[str, Any]], list[Any]], list[int]] | None:
        """The `encode_chat(messages, tools)` that counts a request's tools into its prompt as the
        model's chat template renders them (what an engine that sends the tools on bills for them),
        or None: the engine counts the messages only."""
        return None

    @property
    def renderer(self) -> Engine:
        """What the gateway asks for a request's prompt ids and for its verdict on the request's
        fields (`encode_chat`, `encode_text`, `check_request`): the engine itself. A wrapper that only
        stands in front of one engine (the gateway's scheduler) names that engine's, so those calls
        go to the engine that answers them rather than through the wrapper's forwarding."""
        return self

    def unwrapped(self) -> Engine:
        """The engine behind the wrappers that stand in front of one engine (the gateway's
        scheduler): the backend itself, with its own specifics. Any other engine, a fallback chain
        and a routing model included, is its own."""
        return self

    def queue_depth(self) -> int | None:
        """Requests waiting in front of the engine for a slot (the gateway's scheduler); None: no queue."""
        return None

    def runners(self) -> list[Engine]:
        """The engines that run this model's requests themselves: this one. A fallback chain: its
        candidates; a routing model: none (the models it picks are served as themselves)."""
        return [self]

    def use_classes(self, names: tuple[str, ...]) -> None:
        """The gateway's scheduling classes, highest first, for an engine that sends the class on
        (a pool's `priority: by_class`). This default sends nothing."""
        return None

    @property
    @abc.abstractmethod
    def ready(self) -> bool: ...

    @property
    def healthy(self) -> bool:
        """Whether the engine can serve right now (a pool with every replica ejected cannot)."""
        return self.ready

    @abc.abstractmethod
    async def start(self) -> None:
        """Loads the model / connects; after it returns, `ready` is true."""

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt token ids for chat messages, through the model's chat template."""

    @abc.abstractmethod
    def encode_text(self, prompt: str) -> list[int]: ...

    @abc.abstractmethod
    def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    # True when `complete()` is native: the final output of a one-body (non-streamed) request as one
    # coroutine, without a generator per layer. The gateway uses it for clients that want one body.
    completes: bool = False

    async def complete(self, request: EngineRequest) -> EngineOutput:
        """The request's final output, the outputs before it carried in its `before` (the same
        outputs `stream()` yields, in one object). This default reads `stream()` to its end."""
        return await collect(self.stream(request))

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """Stops a running request: its stream ends with finish reason `cancelled`."""

    @abc.abstractmethod
    def has_capacity(self) -> bool:
        """False when one more request would only wait past the engine's queue limit."""

    @abc.abstractmethod
    def requests_in_flight(self) -> int:
        """Requests the engine itself still holds (running or queued inside it)."""

    def slots(self) -> int | None:
        """Requests the engine runs at once (its batch size; a pool's replicas in rotation times
        their concurrency). None: unknown. The scheduler queues what does not fit."""
        return None

    def check_request(self, request: EngineRequest) -> None:
        """Refuses, as EngineRequestRejected naming the field, what of the client's body (`extra`, in
        chat-completions terms) this engine cannot honour. Asked before the quota is reserved. This
        default: a pass-through engine's server judges for itself; any other serves text only."""
        if self.passthrough:
            return
        body = request.extra or {}
        if body.get("tools"):
            raise EngineRequestRejected("tools are not supported by this model", param="tools", code="unsupported_parameter")
        if body.get("tool_choice") not in (None, "none"):
            raise EngineRequestRejected("tool_choice is not supported by this model", param="tool_choice", code="unsupported_parameter")
        fmt = body.get("response_format")
        if fmt and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
            raise EngineRequestRejected("response_format other than text is not supported by this model", param="response_format", code="unsupported_parameter")

    def refusal(self, request: EngineRequest) -> EngineOverloadedError | None:
        """Why the engine would turn this request away now, or None. A question: it takes nothing
        (`admit()` takes the place). Asked before the quota is reserved, so a refusal costs the
        client nothing."""
        return None if self.has_capacity() else EngineOverloadedError("The engine is at capacity; retry shortly.")

    def admit(self, request: EngineRequest) -> None:
        """Takes a place for this request until `stream()`/`complete()` comes with it, or
        `release()`; raises the refusal (EngineOverloadedError) instead. This default holds nothing:
        an engine without a queue of its own only answers the question."""
        refused = self.refusal(request)
        if refused is not None:
            raise refused

    def release(self, request_id: str) -> None:
        """Gives back the place `admit()` took for a request that never came to `stream()` (its
        quota refused it, or it failed before); a no-op once it has come, or when none was held."""
        return None


async def collect(outputs: AsyncIterator[EngineOutput]) -> EngineOutput:
    """A stream's outputs as one: its last, with the ones before it (and theirs) in `before`."""
    earlier: list[EngineOutput] = []
    last: EngineOutput | None = None
    async with aclosing(outputs) as it:  # type: ignore[type-var]
        async for out in it:  # read to its end: every layer below finishes by itself
            if last is not None:
                if last.finished:
                    continue  # nothing after the final output counts
                earlier.append(last)
            if out.before:
                earlier.extend(out.before)
                out.before = None
            last = out
    if last is None:
        raise EngineError("the engine ended the request without an output")
    if earlier:
        last.before = earlier
    return last
