"""`openai` backend: a pool of OpenAI-compatible servers (trtllm-serve, vLLM, Triton's OpenAI
front end, or a hosted provider) behind the one engine interface.

    pick a replica (least outstanding requests, ejected ones skipped)
      -> POST {replica}/chat/completions or /completions, always streamed, always with
         stream_options.include_usage, the client's fields passed through, `model` rewritten
      -> relay each choice as it comes; bill the upstream's usage (or count, marked estimated)

Retries and failover happen only before the first output leaves this engine (so before the
first byte reaches the client). A client that leaves closes that upstream connection: servers
like trtllm-serve abort a request only when they see its connection close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from billing.periodic import Periodic
from engines.base import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_STOP,
    Engine,
    EngineError,
    EngineOutput,
    EngineOverloadedError,
    EngineRequest,
    EngineRequestRejected,
    collect,
)
from engines.backends.openai_stream import (
    CALLER_SIZED_PARTS,
    DONE,
    ChoiceAccumulator,
    SSEDecoder,
    TokenCounter,
    chunk_choice,
    delta_is_empty,
    non_text_parts,
    normalized_finish,
    recorded_finish,
)
from engines.backends.upstream_http import Inbox, LeanExchange, UpstreamPool
from engines.wrappers.scheduler import DEFAULT_CLASSES
from engines.backends.upstream_params import ParamPolicy, ParamRefused

log = logging.getLogger("tollgate.engines.openai")

# Statuses that mean "this request is wrong", not "this replica is broken": relayed, never retried.
CLIENT_ERRORS = {400, 413, 422}
# Statuses that mean "busy": try another replica, but do not count towards ejection.
BUSY = {408, 429}
# trtllm-serve answers every exception of a chat/completion handler as a 400 BadRequestError with
# the exception's text (openai_server.py create_error_response(str(e))), a dead executor's too:
# generate_async raises RuntimeError("LLM is shutting down") once the executor is gone. Matched at
# the start of the message only, so that a client's own text echoed in a validation error cannot
# eject a replica.
DEAD_ENGINE_MESSAGES = ("LLM is shutting down", "EngineDeadError")


def _health_round_failed(exc: Exception) -> None:  # a replica's failure is its check's result; this is the round's own
    log.error("health check round failed", exc_info=exc)


def engine_is_dead(message: str) -> bool:
    """Whether an upstream's 400 message says its engine is gone (a replica failure, not a bad request)."""
    return message.lstrip().startswith(DEAD_ENGINE_MESSAGES)


@dataclass
class Replica:
    """One upstream server of a pool, and what the pool knows about it."""

    url: str  # base URL including the API prefix, e.g. http://10.0.0.7:8000/v1
    index: int
    outstanding: int = 0
    failures: int = 0  # consecutive
    ejected: bool = False
    ejected_until: float = 0.0  # monotonic time before which it is not reinstated
    ejections: int = 0
    served: int = 0
    last_error: str | None = None
    last_pick: int = 0

    @property
    def label(self) -> str:
        """How clients see it in error messages (never the internal address)."""
        return f"replica #{self.index}"

    @property
    def shown(self) -> str:
        """Its URL for the logs: credentials written into it (`https://user:token@host/v1`) left out."""
        parts = urlsplit(self.url)
        if "@" not in parts.netloc:
            return self.url
        return parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]).geturl()


class ReplicaPool:
    """Least-outstanding-requests balancing with passive and active ejection.

    A replica is ejected after `eject_after` consecutive failures or one failed health check.
    It comes back once `cooldown` seconds have passed and (with active health checks) a check
    succeeds; without health checks it simply gets traffic again after the cooldown.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        max_concurrency: int,
        eject_after: int,
        cooldown: float,
        active_checks: bool,
        clock: Any = time.monotonic,
    ) -> None:
        self.replicas = [Replica(url.rstrip("/"), i) for i, url in enumerate(urls)]
        self.max_concurrency = max_concurrency
        self.eject_after = eject_after
        self.cooldown = cooldown
        self.active_checks = active_checks
        self._clock = clock
        self._picks = 0

    def _in_rotation(self, replica: Replica) -> bool:
        if not replica.ejected:
            return True
        if not self.active_checks and self._clock() >= replica.ejected_until:
            self._reinstate(replica)
            return True
        return False

    def healthy(self) -> bool:
        return any(self._in_rotation(r) for r in self.replicas)

    def has_capacity(self) -> bool:
        return any(self._in_rotation(r) and r.outstanding < self.max_concurrency for r in self.replicas)

    def outstanding(self) -> int:
        return sum(r.outstanding for r in self.replicas)

    def slots(self) -> int:
        """Requests the replicas in rotation take at once: the scheduler's capacity for the pool."""
        return sum(self.max_concurrency for r in self.replicas if self._in_rotation(r))

    def pick(self, exclude: list[Replica]) -> Replica | None:
        ready = [r for r in self.replicas if r not in exclude and self._in_rotation(r) and r.outstanding < self.max_concurrency]
        if not ready:
            return None
        least = min(r.outstanding for r in ready)
        ties = [r for r in ready if r.outstanding == least]
        self._picks += 1
        chosen = min(ties, key=lambda r: r.last_pick)  # ties: the least recently picked
        chosen.last_pick = self._picks
        chosen.outstanding += 1
        return chosen

    def release(self, replica: Replica) -> None:
        replica.outstanding -= 1

    def succeeded(self, replica: Replica) -> None:
        replica.failures = 0
        replica.served += 1

    def failed(self, replica: Replica, reason: str) -> None:
        replica.failures += 1
        replica.last_error = reason
        log.warning("upstream %s failed (%d in a row): %s", replica.shown, replica.failures, reason)
        if replica.failures >= self.eject_after:
            self.eject(replica, reason)

    def eject(self, replica: Replica, reason: str) -> None:
        if not replica.ejected:
            replica.ejected = True
            replica.ejections += 1
            replica.ejected_until = self._clock() + self.cooldown
            log.warning("upstream %s ejected for %.0fs: %s", replica.shown, self.cooldown, reason)

    def health_result(self, replica: Replica, ok: bool, reason: str = "") -> None:
        if not ok:
            replica.last_error = reason
            self.eject(replica, f"health check: {reason}")
        elif replica.ejected and self._clock() >= replica.ejected_until:
            self._reinstate(replica)

    def _reinstate(self, replica: Replica) -> None:
        replica.ejected = False
        replica.failures = 0
        log.info("upstream %s back in rotation", replica.shown)

    def snapshot(self) -> list[dict[str, Any]]:
        return [
            {"url": r.shown, "outstanding": r.outstanding, "ejected": r.ejected, "failures": r.failures,
             "ejections": r.ejections, "served": r.served, "last_error": r.last_error}
            for r in self.replicas
        ]


class _Retryable(Exception):
    """A failure before the first output: another replica may take the request."""

    def __init__(self, reason: str, *, busy: bool = False) -> None:
        super().__init__(reason)
        self.busy = busy


class _Exchange:
    """One streamed HTTP exchange with a replica. A task reads it into a queue so that the
    consumer can wait with deadlines and a cancel interrupts the wait at once; cancelling the
    task leaves `client.stream()` with the body unread, which closes that connection."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str]) -> None:
        self.queue = Inbox()
        self.task = asyncio.get_running_loop().create_task(self._read(client, url, body, headers))

    async def _read(self, client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str]) -> None:
        put = self.queue.put_nowait
        try:
            async with client.stream("POST", url, content=body, headers=headers) as response:
                if response.status_code != 200:
                    put(("status", (response.status_code, (await response.aread())[:65536])))
                    return
                decoder = SSEDecoder()
                async for line in response.aiter_lines():
                    data = decoder.feed(line)
                    if data is not None:
                        put(("data", data))
                tail = decoder.flush()
                if tail is not None:
                    put(("data", tail))
            put(("eof", None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # connection refused/reset, timeouts, protocol errors
            put(("error", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__))

    def interrupt(self) -> None:
        self.queue.put_nowait(("cancel", None))

    async def close(self, grace: float = 0.0) -> None:
        """Ends the exchange. With a grace period a body that is about to end is read to its end,
        so its connection goes back to the pool; otherwise the connection is closed."""
        if grace and not self.task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self.task), grace)
        if not self.task.done():
            self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


class _Live:
    """A request in flight: what `cancel()` needs to reach it."""

    __slots__ = ("cancelled", "exchange")

    def __init__(self) -> None:
        self.cancelled = False
        self.exchange: _Exchange | LeanExchange | None = None


def _is_done(data: str | bytes) -> bool:
    """The `[DONE]` sentinel, whitespace around it allowed."""
    return (data.strip() if isinstance(data, str) else data.strip().decode("latin-1")) == DONE


def _json_objects(events: Sequence[str | bytes]) -> tuple[list[dict[str, Any] | None], bool]:
    """The JSON objects of the events read together, up to `[DONE]` (None for an event that is not
    a JSON object), and whether `[DONE]` came. Decoded as one JSON array when every event is bytes:
    one parser call instead of one per event. The array has one element per event only if each
    event is exactly one JSON value (an event holding two values would need an empty one beside it
    to keep the count, and an empty element does not parse), so otherwise each is decoded alone."""
    done = False
    for i, data in enumerate(events):
        if len(data) < 16 and _is_done(data):
            events, done = events[:i], True
            break
    if len(events) > 1 and all(type(e) is bytes for e in events):
        try:
            values = orjson.loads(b"[" + b",".join(events) + b"]")  # type: ignore[arg-type]
        except orjson.JSONDecodeError:
            pass
        else:
            if len(values) == len(events):
                return [v if type(v) is dict else None for v in values], done
    return [_json_object(e) for e in events], done


def _json_object(data: str | bytes) -> dict[str, Any] | None:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """Prompt tokens the upstream served from its prefix cache (OpenAI's
    `usage.prompt_tokens_details.cached_tokens`; trtllm-serve and vLLM fill it), or None."""
    details = usage.get("prompt_tokens_details") if usage else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if type(value) is int and value >= 0 else None


def upstream_error_message(raw: bytes) -> tuple[str, str | None, str | None]:
    """(message, param, code) from an upstream's error body, whatever its flavour. `code` as OpenAI's
    (a short string or none): vLLM's and trtllm-serve's are the HTTP status as a number, which is
    none; their context overflow is OpenAI's `context_length_exceeded`."""
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")[:500] or "no message", None, None
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(error, dict):
        message = str(error.get("message") or error.get("detail") or str(error))
        code = error.get("code")
        named = code if isinstance(code, str) and not code.isdigit() else None
        if named is None and "maximum context length" in message:
            named = "context_length_exceeded"
        param = error.get("param")
        return message[:500], param if isinstance(param, str) else None, named
    return str(error)[:500], None, None


def event_status(error: Any) -> int | None:
    """The HTTP status an upstream's in-stream error event stands for: its numeric `code` (vLLM,
    trtllm-serve), else 400 for a bad-request type; None when it says none."""
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if type(code) is int and 400 <= code <= 599:
        return code
    return 400 if error.get("type") in ("BadRequestError", "invalid_request_error") else None


class OpenAIPoolEngine(Engine):
    owned_by = "tollgate-openai"
    passthrough = True
    completes = True

    def __init__(
        self,
        *,
        model_id: str,
        replicas: list[str],
        context_length: int,
        upstream_model: str | None = None,
        api_key: str | None = None,
        tokenizer: str = "cl100k_base",
        max_concurrency: int = 256,
        retries: int = 2,
        connect_timeout: float = 5.0,
        first_token_timeout: float = 60.0,
        idle_timeout: float = 30.0,
        health_path: str | None = "/health",
        health_interval: float = 5.0,
        health_timeout: float = 2.0,
        eject_after: int = 3,
        cooldown: float = 30.0,
        max_connections: int | None = None,
        keepalive_expiry: float = 30.0,
        lean_client: bool = True,
        params: dict[str, Any] | None = None,
        tokens_per_non_text_part: int | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("an openai pool needs at least one replica URL")
        bound = tokens_per_non_text_part
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or not 1 <= bound <= context_length):
            raise ValueError(f"tokens_per_non_text_part must be an integer from 1 to context_length ({context_length}), got {bound!r}")
        self.model_id = model_id
        self.context_length = context_length
        self.upstream_model = upstream_model or model_id
        self._api_key = api_key
        # Non-text content parts (images, audio, files, video) go upstream as sent and are billed there;
        # each is counted at this bound (models.yaml `tokens_per_non_text_part`), or refused without one.
        self.counter = TokenCounter(tokenizer, tokens_per_part=tokens_per_non_text_part)
        # Which client fields go upstream (models.yaml `params:`, engines/backends/upstream_params.py).
        self.params = ParamPolicy.from_config(params)
        self.params.use_classes(tuple(c.name for c in DEFAULT_CLASSES))  # the gateway's, once wired
        self.retries = retries
        self.first_token_timeout = first_token_timeout
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.health_path = health_path
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.pool = ReplicaPool(
            replicas, max_concurrency=max_concurrency, eject_after=eject_after, cooldown=cooldown,
            active_checks=bool(health_path),
        )
        self._max_connections = max_connections or max_concurrency * len(replicas)
        self._keepalive_expiry = keepalive_expiry
        self._client: httpx.AsyncClient | None = None
        # Streamed POSTs to http:// replicas go through the lean client (engines/backends/upstream_http.py);
        # https replicas and health checks through httpx.
        self._lean: UpstreamPool | None = None
        self._use_lean = lean_client
        self.health_loop: Periodic | None = None  # with a health_path: a check of every replica each health_interval
        self._live: dict[str, _Live] = {}
        self._ready = False

    def use_classes(self, names: tuple[str, ...]) -> None:
        """The gateway's scheduling classes, highest first: what `params.priority: by_class` maps."""
        self.params.use_classes(names)

    # lifecycle --------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def healthy(self) -> bool:
        return self._ready and self.pool.healthy()

    async def start(self) -> None:
        if self._ready:
            return
        if not self.counter.loaded:
            await asyncio.to_thread(self.counter.load)
        # One client for the engine's lifetime: connections are pooled per replica and reused.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=self.connect_timeout, read=None, write=self.connect_timeout, pool=self.first_token_timeout),
            limits=httpx.Limits(
                max_connections=self._max_connections,
                max_keepalive_connections=self._max_connections,
                keepalive_expiry=self._keepalive_expiry,
            ),
            follow_redirects=False,
        )
        if self._use_lean:
            self._lean = UpstreamPool(connect_timeout=self.connect_timeout, keepalive_expiry=self._keepalive_expiry,
                                      max_idle=self._max_connections)
        if self.health_path:
            await self.check_health()
            self.health_loop = Periodic(f"health-{self.model_id}", self.health_interval, self.check_health,
                                        on_error=_health_round_failed)
            self.health_loop.start()
        self._ready = True
        log.info("model %s: pool of %d replicas ready", self.model_id, len(self.pool.replicas))

    async def stop(self) -> None:
        self._ready = False
        if self.health_loop is not None:
            await self.health_loop.stop()
            self.health_loop = None
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
        if self._lean is not None:
            lean, self._lean = self._lean, None
            await lean.aclose()

    # health -----------------------------------------------------------------------------------
    def health_url(self, replica: Replica) -> str:
        assert self.health_path
        if self.health_path.startswith("/"):
            parts = urlsplit(replica.url)
            return f"{parts.scheme}://{parts.netloc}{self.health_path}"
        return f"{replica.url}/{self.health_path}"

    async def check_health(self) -> None:
        """One round of active health checks, all replicas at once."""
        await asyncio.gather(*(self._check(r) for r in self.pool.replicas))

    async def _check(self, replica: Replica) -> None:
        assert self._client is not None
        try:
            response = await self._client.get(self.health_url(replica), headers=self._headers(), timeout=self.health_timeout)
        except Exception as exc:
            self.pool.health_result(replica, False, type(exc).__name__)
            return
        self.pool.health_result(replica, response.status_code < 300, f"HTTP {response.status_code}")

    # tokens -----------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
        self.check_parts(messages)
        return self.counter.encode_chat(messages, tools)

    def check_parts(self, messages: list[dict[str, Any]]) -> None:
        """Refuses a content part the count cannot bound (EngineRequestRejected naming it, a 400 at
        prepare, before anything is reserved): any non-text part when models.yaml sets no
        `tokens_per_non_text_part`, and embeddings given as content (their length is the caller's)."""
        for _, param, kind in non_text_parts(messages):
            if param.endswith(".audio"):
                if self.counter.tokens_per_part is None:
                    raise EngineRequestRejected(
                        f"a message's `audio` (an earlier answer's audio) is not accepted by {self.model_id}: the model's configuration does not "
                        "bound the tokens of non-text content (tokens_per_non_text_part in models.yaml); send the "
                        "answer's transcript as text instead", param=param)
                continue
            if kind in CALLER_SIZED_PARTS:
                raise EngineRequestRejected(
                    f"content part type {kind!r} is not accepted by {self.model_id}: its length is set by the request, "
                    "so no reservation can bound it", param=param)
            if self.counter.tokens_per_part is None:
                raise EngineRequestRejected(
                    f"content part type {kind!r} is not accepted by {self.model_id}: the model's configuration does not "
                    "bound the tokens of non-text content parts (tokens_per_non_text_part in models.yaml); "
                    "only 'text' parts are", param=param)

    def tool_encoder(self) -> Callable[[list[dict[str, Any]], list[Any]], list[int]]:
        # The tools go upstream with the body: counted through the tokenizer's chat template where it
        # has one, else as their JSON (TokenCounter), so the reservation holds them before the prefill.
        return self.encode_chat

    def encode_text(self, prompt: str) -> list[int]:
        return self.counter.encode_text(prompt)

    # capacity ---------------------------------------------------------------------------------
    def has_capacity(self) -> bool:
        return self._ready and self.pool.has_capacity()

    def slots(self) -> int | None:
        return self.pool.slots()

    def requests_in_flight(self) -> int:
        return self.pool.outstanding()

    def cancel(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.cancelled = True
            if live.exchange is not None:
                live.exchange.interrupt()

    # generation -------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        return headers

    @staticmethod
    def _is_chat(request: EngineRequest) -> bool:
        if request.extra is not None:
            return "messages" in request.extra
        return request.messages is not None

    def upstream_body(self, request: EngineRequest, chat: bool) -> dict[str, Any]:
        """The client's body with `model` rewritten and streaming with usage forced on; for a
        request built without a client body, the equivalent body from its own fields."""
        if request.extra is not None:
            body = dict(request.extra)
            dropped = self.params.apply(body, chat)
            if dropped:
                log.debug("model %s: request %s: fields not forwarded to the upstream: %s",
                          self.model_id, request.request_id, ", ".join(dropped))
            # The bound the gateway reserved for goes up with the body, always: OpenAI's default for a
            # text completion (16) where the client sent none (trtllm-serve has none), the room the
            # gateway's context leaves for a chat without one (vLLM's own default is its context).
            self.params.bound(body, chat, request.max_tokens)
        else:
            s = request.sampling
            body = {"max_tokens": request.max_tokens, "temperature": s.temperature, "top_p": s.top_p}
            if s.seed is not None:
                body["seed"] = s.seed
            if s.stop:
                body["stop"] = list(s.stop)
            if chat:
                body["messages"] = request.messages
            else:
                body["prompt"] = request.prompt if request.prompt is not None else request.prompt_token_ids
        priority = self.params.upstream_priority(request.priority)
        if priority is not None:
            body["priority"] = priority  # the account's scheduling class, in the upstream's terms
        body["model"] = self.upstream_model
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return body

    def check_request(self, request: EngineRequest) -> None:
        """Refuses a field no tenant may set before admission, so a refusal holds nothing and
        leaves no row; `_begin` refuses it again for a request built past this check."""
        if request.extra is None:
            return
        try:
            self.params.refuse(request.extra, self._is_chat(request))
        except ParamRefused as exc:
            raise EngineRequestRejected(str(exc), status_code=400, param=exc.name, code="unsupported_parameter") from None

    @staticmethod
    def _echoed(request: EngineRequest, chat: bool) -> str | None:
        """The prompt a text completion's `echo` puts in front of its text, not counted as generated
        when the text is counted (a stream that ends without the upstream's usage)."""
        body = request.extra
        if chat or not body or not body.get("echo"):
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else None

    def _prompt_estimate(self, request: EngineRequest, chat: bool) -> int:
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids)
        if chat:
            return len(self.encode_chat(request.messages or []))
        return len(self.encode_text(request.prompt or ""))

    def _begin(self, request: EngineRequest) -> tuple[bool, bytes, _Live]:
        """Whether the request is a chat, the upstream body, and its live record (for cancel)."""
        if self._client is None:
            raise EngineError("engine is not running")
        chat = self._is_chat(request)
        try:
            body = orjson.dumps(self.upstream_body(request, chat))
        except ParamRefused as exc:
            raise EngineRequestRejected(str(exc), status_code=400, param=exc.name, code="unsupported_parameter") from None
        live = self._live[request.request_id] = _Live()
        return chat, body, live

    def _replicas(self) -> Iterator[Replica]:
        """The replicas to try in turn: the first pick and up to `retries` others."""
        tried: list[Replica] = []
        for _ in range(1 + self.retries):
            replica = self.pool.pick(exclude=tried)
            if replica is None:
                return
            tried.append(replica)
            yield replica

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        chat, body, live = self._begin(request)
        failures: list[_Retryable] = []
        try:
            for replica in self._replicas():
                try:
                    # Closed here, not left to the garbage collector: an async generator dropped while
                    # suspended is closed by the loop's finalizer hook (a thread-safe wake-up and a task).
                    async with aclosing(self._attempt(replica, body, request, chat, live)) as attempt:
                        async for out in attempt:
                            yield out
                    return
                except _Retryable as failure:
                    failures.append(failure)
            raise self._unserved(failures)
        finally:
            self._live.pop(request.request_id, None)

    async def complete(self, request: EngineRequest) -> EngineOutput:
        """`stream()` for a client that wants one body: the same tries, retries and outputs, as one
        coroutine. A relayed non-streaming request is collected inside the attempt (its only output
        is the final one)."""
        if request.extra is None or request.extra.get("stream"):
            return await collect(self.stream(request))
        chat, body, live = self._begin(request)
        failures: list[_Retryable] = []
        try:
            for replica in self._replicas():
                try:
                    return await collect(self._attempt(replica, body, request, chat, live))
                except _Retryable as failure:
                    failures.append(failure)
            raise self._unserved(failures)
        finally:
            self._live.pop(request.request_id, None)

    def _unserved(self, failures: list[_Retryable]) -> EngineError:
        if not failures or all(f.busy for f in failures):
            return EngineOverloadedError(f"every replica of {self.model_id} is busy or ejected")
        return EngineError(f"no replica could serve the request: {failures[-1]}")

    async def _attempt(
        self, replica: Replica, body: bytes, request: EngineRequest, chat: bool, live: _Live
    ) -> AsyncIterator[EngineOutput]:
        """One replica's try. Raises `_Retryable` only while no output has come from this replica."""
        assert self._client is not None
        loop = asyncio.get_running_loop()
        path = "/chat/completions" if chat else "/completions"
        url = replica.url + path
        exchange: _Exchange | LeanExchange
        if self._lean is not None and UpstreamPool.handles(url):
            exchange = self._lean.exchange(url, body, self._headers())
        else:
            exchange = _Exchange(self._client, url, body, self._headers())
        live.exchange = exchange
        if live.cancelled:
            exchange.interrupt()
        relay = request.extra is not None
        streaming = relay and bool(request.extra and request.extra.get("stream"))
        # A client that gets one body from a pass-through engine needs nothing before the end: the
        # merged choice carries it all, so the chunks are only accumulated (and counted) here.
        collect = relay and not streaming
        merged = ChoiceAccumulator(chat, echoed=self._echoed(request, chat))
        text_field = "content" if chat else "text"
        prompt_estimate = self._prompt_estimate(request, chat)
        completion_estimate = 0
        usage: dict[str, Any] | None = None
        finish: dict[str, Any] | None = None
        first_at: float | None = None  # when the first output token arrived
        batch: list[EngineOutput] = []  # outputs read, not yet yielded: they leave together as one
        deadline = loop.time() + self.first_token_timeout
        clean_end = False
        relayed: EngineOutput | None = None  # the latest output yielded
        try:
            while True:
                try:
                    if not exchange.queue.empty():  # already here: no deadline to arm
                        kind, value = exchange.queue.get_nowait()
                    elif batch:
                        # About to wait for the network: what arrived so far leaves now, as one output.
                        out = batch.pop()
                        out.before, batch = batch or None, []
                        relayed = out
                        yield out
                        continue
                    else:
                        wait = deadline - loop.time() if first_at is None else self.idle_timeout
                        kind, value = await exchange.queue.get(max(wait, 0.0))
                except TimeoutError:
                    reason = f"no data for {self.idle_timeout:g}s" if first_at is not None else f"no first token within {self.first_token_timeout:g}s"
                    kind, value = "error", reason
                if kind == "events" or kind == "data":
                    chunks, done = _json_objects(value if kind == "events" else (value,))
                    for chunk in chunks:
                        if chunk is None:
                            continue  # not an event we understand; keep reading
                        choices = chunk.get("choices")
                        if chunk.get("error") and not choices:
                            status = event_status(chunk["error"])
                            if status in CLIENT_ERRORS and first_at is None:
                                # vLLM checks some fields only once its stream has begun (top_logprobs past
                                # 20, a logit_bias id past the vocabulary): 200, then an error event with
                                # code 400. The request's fault as its 400 would be: relayed, never retried,
                                # never a failure of the replica (three such requests ejected it for everyone).
                                kind, value = "status", (status, orjson.dumps(chunk))
                            else:
                                kind, value = "error", "error event: " + upstream_error_message(orjson.dumps(chunk))[0]
                            break
                        usage = chunk.get("usage") or usage
                        for choice in choices or ():
                            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                                continue
                            # The usual chunk is one more piece of the answer's text and nothing else:
                            # taken as it is, without the general merge.
                            piece = None
                            if choice.get("finish_reason") is None and choice.get("logprobs") is None:
                                part = choice.get("delta") if chat else choice
                                if type(part) is dict and (not chat or len(part) == 1):
                                    piece = part.get(text_field)
                            if type(piece) is str and piece and merged.add_piece(text_field, piece):
                                text = piece
                            else:
                                merged.add(choice)
                                if choice.get("finish_reason"):
                                    finish = choice
                                    continue
                                if not self._carries_output(choice, chat):
                                    continue
                                text = self._text_of(choice, chat)
                            completion_estimate += 1  # servers stream about a token a chunk; the final count is exact or counted
                            if first_at is None:
                                first_at = time.perf_counter()
                            if not collect:
                                batch.append(EngineOutput(
                                    text, [], None, prompt_estimate, completion_estimate,
                                    estimated=True, raw_choice=chunk_choice(choice) if streaming else None,
                                ))
                    else:
                        if not done:
                            continue
                        kind = "eof"  # `[DONE]`: what came after it in the same read is not read
                if kind == "cancel":
                    yield self._final(FINISH_CANCELLED, "", None, prompt_estimate, merged, usage)
                    return
                if kind == "status":
                    self._raise_for_status(replica, *value)
                if kind == "eof" and finish is None and usage is None:
                    kind, value = "error", "the stream ended before a finish reason"
                elif kind == "error" and finish is not None:
                    kind = "eof"  # the answer was complete; only the usage or [DONE] was lost
                if kind == "eof":
                    clean_end = True
                    self.pool.succeeded(replica)
                    reason = normalized_finish(finish.get("finish_reason")) if finish else "stop"
                    if streaming:
                        raw = {**chunk_choice(finish), "finish_reason": reason} if finish else None
                    else:
                        raw = merged.choice() if relay else None
                    text = self._text_of(finish, chat) if finish else ""
                    final = self._final(reason, text, raw, prompt_estimate, merged, usage)
                    final.before, final.first_token_at = batch or None, first_at
                    final.recorded_finish = recorded_finish(finish.get("finish_reason")) if finish else None
                    # vLLM and trtllm-serve name the stop string that ended it in the choice's `stop_reason`
                    # (a token id there is a stop token): Anthropic's stop_sequence.
                    stop = finish.get("stop_reason") if finish and reason == FINISH_STOP else None
                    final.stop_sequence = stop if isinstance(stop, str) else None
                    yield final
                    return
                # an error: retry elsewhere while no output has come from this replica, else end the
                # stream with it (after what came: the client has it or is about to)
                value = self._scrubbed(value)
                self.pool.failed(replica, value)
                if first_at is None:
                    raise _Retryable(f"{replica.label}: {value}")
                final = self._final(FINISH_ERROR, "", None, prompt_estimate, merged, usage, error=f"upstream {replica.label}: {value}")
                # when output came (a one-body relay gathers it instead of yielding it): what says so to a
                # fallback, which must not run the request again elsewhere
                final.before, final.first_token_at = batch or None, first_at
                yield final
                return
        finally:
            if not clean_end and relayed is not None and relayed.estimated and relayed.finish_reason is None:
                # Closed before the end (the client left, a write failed): the row is billed from the
                # latest output, whose count is of chunks (a server may stream several tokens a chunk:
                # vLLM's stream_interval, speculative decoding). Counted instead: the text relayed.
                relayed.completion_tokens = max(relayed.completion_tokens, self.counter.count(merged.generated_text()))
            self.pool.release(replica)
            live.exchange = None
            await exchange.close(grace=1.0 if clean_end else 0.0)

    def _scrubbed(self, text: str) -> str:
        """`text` without this pool's upstream key: an HTTP library's error may quote the header it
        refused, and an upstream's error may quote the key it was given."""
        return text.replace(self._api_key, "***") if self._api_key and self._api_key in text else text

    def _raise_for_status(self, replica: Replica, status: int, raw: bytes) -> None:
        message, param, code = upstream_error_message(raw)
        message = self._scrubbed(message)
        if status == 400 and engine_is_dead(message):
            # Not the request's fault and not going to pass: out of rotation now, another replica tries.
            self.pool.failed(replica, f"HTTP 400, engine dead: {message[:200]}")
            self.pool.eject(replica, f"engine dead: {message[:200]}")
            raise _Retryable(f"{replica.label}: its engine is not running")
        if status in CLIENT_ERRORS:
            self.pool.succeeded(replica)  # the replica works; the request was wrong
            raise EngineRequestRejected(message, status_code=413 if status == 413 else 400, param=param, code=code)
        if status in BUSY:
            raise _Retryable(f"{replica.label}: HTTP {status}", busy=True)
        self.pool.failed(replica, f"HTTP {status}: {message[:200]}")
        raise _Retryable(f"{replica.label}: HTTP {status}")

    @staticmethod
    def _text_of(choice: dict[str, Any], chat: bool) -> str:
        if chat:
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""

    @staticmethod
    def _carries_output(choice: dict[str, Any], chat: bool) -> bool:
        if choice.get("logprobs"):
            return True
        if chat:
            return not delta_is_empty(choice.get("delta") or {})
        return bool(choice.get("text"))

    def _final(
        self,
        reason: str,
        text: str,
        raw: dict[str, Any] | None,
        prompt_estimate: int,
        merged: ChoiceAccumulator,
        usage: dict[str, Any] | None,
        error: str | None = None,
    ) -> EngineOutput:
        if usage and isinstance(usage.get("prompt_tokens"), int) and isinstance(usage.get("completion_tokens"), int):
            prompt, completion, estimated = usage["prompt_tokens"], usage["completion_tokens"], False
        else:
            prompt, completion, estimated = prompt_estimate, self.counter.count(merged.generated_text()), True
        return EngineOutput(text, [], reason, prompt, completion, estimated=estimated, error=error, raw_choice=raw,
                            cached_tokens=cached_tokens(usage))
