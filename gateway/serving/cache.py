"""An exact-match response cache for deterministic completions.

Opt-in: per model (models.yaml `cache: true`, or TOLLGATE_CACHE_MODELS=id,id) or per request
(header `X-Tollgate-Cache: on`; `off` bypasses a model's default). Only deterministic requests
are cached: temperature 0, or a fixed `seed`. The key is a SHA-256 of the account, the model
actually serving, the endpoint and the whole JSON body except `model`, `stream`,
`stream_options` and `user` — so one account never sees another's completions, any changed
parameter or message is a different entry, and a stream and a plain request share one.

An entry holds the engine's text increments, finish reason and token counts; a hit replays
them through the normal renderer (a stream gets the same SSE chunks as the original). Entries
live in Redis when REDIS_URL is set (`<prefix>rc:<sha>`, expiring after the TTL), otherwise in
this process (LRU). A Redis failure is a miss, never an error.

A hit is admitted through the same limiter (its tokens count against token limits, like the
original), written to the ledger with `cached = true`, and costs `hit_price` times what the
request would have cost at the model's price (TOLLGATE_CACHE_HIT_PRICE: 0 = free, default;
1 = full price; 0.1 = a tenth). Hits and misses are counted per model in /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import orjson
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request

from engines.base import FINISH_LENGTH, FINISH_STOP, EngineOutput
from gateway.config import CacheSettings, parse_hit_price  # noqa: F401  (parse_hit_price: re-exported)
from gateway.http.requests import header
from gateway.serving.admission import Admission
from gateway.serving.completions import Generation

log = logging.getLogger("tollgate.response_cache")
HEADER = "x-tollgate-cache"
HEADER_NAME = HEADER.encode()  # as the ASGI scope spells it
_IGNORED_FIELDS = ("model", "stream", "stream_options", "user")


@dataclass
class CacheConfig:
    """The running cache's policy: from its group of the one Settings (gateway/config.py:CacheSettings)."""

    ttl_seconds: float = 3600.0
    hit_price: Decimal = Decimal(0)  # share of the normal cost billed for a hit (exact: money is never a float)
    models: frozenset[str] = frozenset()  # cached by default (besides models.yaml `cache: true`)
    max_entries: int = 10_000  # in-process store only
    max_entry_bytes: int = 1_000_000

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> "CacheConfig":
        return cls(**dataclasses.asdict(settings))


class MemoryStore:
    def __init__(self, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._max = max_entries
        self._clock = clock

    async def get(self, key: str) -> bytes | None:
        found = self._entries.get(key)
        if found is None:
            return None
        expires, value = found
        if expires <= self._clock():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        self._entries[key] = (self._clock() + ttl, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    async def close(self) -> None:
        self._entries.clear()


class RedisStore:
    def __init__(self, url: str, prefix: str, timeout: float) -> None:
        from billing.quota import redis_url

        self._redis = redis_url.connect(url, timeout=timeout)  # one Redis, Redis Cluster or Sentinel
        self._prefix = prefix

    async def get(self, key: str) -> bytes | None:
        return await self._redis.get(self._prefix + key)

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        await self._redis.set(self._prefix + key, value, px=max(1, int(ttl * 1000)))

    async def close(self) -> None:
        await self._redis.aclose()


class _HitRatio(Collector):
    def __init__(self, cache: "ResponseCache") -> None:
        self._cache = cache

    def collect(self) -> Any:
        ratio = GaugeMetricFamily(
            "tollgate_response_cache_hit_ratio", "Response-cache hits / lookups since start, by model.", labels=["model"]
        )
        for model, (hits, misses) in sorted(self._cache.counts.items()):
            if hits + misses:
                ratio.add_metric([model], hits / (hits + misses))
        yield ratio


class ResponseCache:
    def __init__(self, store: Any, config: CacheConfig | None = None) -> None:
        self.store = store
        self.config = config or CacheConfig()
        self.counts: dict[str, list[int]] = {}  # model -> [hits, misses]
        self.lookups: Counter | None = None
        self._writes: set[asyncio.Task[Any]] = set()

    # policy --------------------------------------------------------------------------------------
    def applies(self, request: Request, gen: Generation) -> bool:
        asked = (header(request, HEADER_NAME) or "").strip().lower()
        if asked in ("off", "false", "0", "bypass", "no"):
            return False
        wanted = asked in ("on", "true", "1", "yes") or gen.model in self.config.models or _model_opted_in(gen.engine)
        asked_of_engine = gen.engine_request
        if asked_of_engine.n > 1 or asked_of_engine.best_of > 1:  # an entry stores one choice's text: never n of them
            return False
        sampling = asked_of_engine.sampling
        return wanted and (sampling.temperature == 0.0 or sampling.seed is not None)

    @staticmethod
    def key(gen: Generation) -> str:
        body = {k: v for k, v in (gen.engine_request.extra or {}).items() if k not in _IGNORED_FIELDS}
        material = {"v": 1, "account": gen.principal.account_id, "model": gen.model, "kind": gen.kind, "body": body}
        if gen.api in ("messages", "responses"):  # their bodies are chat bodies; what they answer is their own
            material["api"] = gen.api
        return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()

    # store ---------------------------------------------------------------------------------------
    async def get(self, key: str) -> dict[str, Any] | None:
        try:
            raw = await self.store.get(key)
        except Exception as exc:
            log.warning("response cache read failed (a miss): %s", type(exc).__name__)
            return None
        return orjson.loads(raw) if raw else None

    def put_later(self, key: str, entry: dict[str, Any]) -> None:
        value = orjson.dumps(entry)
        if len(value) > self.config.max_entry_bytes:
            return
        task = asyncio.get_running_loop().create_task(self._put(key, value))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _put(self, key: str, value: bytes) -> None:
        try:
            await self.store.set(key, value, self.config.ttl_seconds)
        except Exception as exc:
            log.warning("response cache write failed: %s", type(exc).__name__)

    async def flush(self) -> None:
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=5)

    def count(self, model: str, hit: bool) -> None:
        counts = self.counts.setdefault(model, [0, 0])
        counts[0 if hit else 1] += 1
        if self.lookups is not None:
            self.lookups.labels(model, "hit" if hit else "miss").inc()


def _model_opted_in(engine: Any) -> bool:
    return bool(engine.response_cache)


# gateway hooks ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hit:
    """A stored completion for this request, and the share of the normal cost a hit pays."""

    entry: dict[str, Any]
    hit_price: Decimal

    @property
    def prompt_tokens(self) -> int:
        return int(self.entry["prompt_tokens"])

    @property
    def completion_tokens(self) -> int:
        return int(self.entry["completion_tokens"])


@dataclass(frozen=True)
class Miss:
    """A cacheable request with nothing stored for it: its completion is stored as it streams."""

    cache: ResponseCache
    key: str

    def recording(self, gen: Generation, outputs: AsyncIterator[EngineOutput]) -> AsyncIterator[EngineOutput]:
        """The metered stream, storing its completion when it ends as a cacheable one."""
        return _recorded(self.cache, self.key, gen, outputs)


async def lookup(request: Request, gen: Generation) -> Hit | Miss | None:
    """The stored completion for this request (Hit), or what stores this one (Miss: run it), or
    None: the cache does not apply to it."""
    cache: ResponseCache | None = request.app.state.response_cache
    if cache is None or not cache.applies(request, gen):
        return None
    key = cache.key(gen)
    entry = await cache.get(key)
    cache.count(gen.model, entry is not None)
    if entry is None:
        return Miss(cache, key)
    return Hit(entry, cache.config.hit_price)


async def replayed(gen: Generation, hit: Hit, admission: Admission) -> AsyncIterator[EngineOutput]:
    """The stored increments as engine outputs; the admission is settled (its row written) before
    the last one is handed over, as `metered` does, or in `finally` as cancelled, billed nothing,
    when the client left before the end."""
    texts: list[str] = hit.entry["texts"]
    prompt, completion = hit.prompt_tokens, hit.completion_tokens
    try:
        for i, text in enumerate(texts):
            if gen.cancel_requested:
                return
            if gen.ttft_ms is None and (text or i == len(texts) - 1):
                gen.ttft_ms = (time.perf_counter() - gen.started) * 1000.0
            if i < len(texts) - 1:
                yield EngineOutput(text, [], None, prompt, 0)
                continue
            gen.finish_reason = hit.entry["finish_reason"]
            gen.stop_sequence = hit.entry.get("stop_sequence")
            gen.completion_tokens = completion
            gen.estimated = bool(hit.entry.get("estimated"))
            admission.settle()
            yield EngineOutput(text, [], gen.finish_reason, prompt, completion)
    finally:
        admission.settle()  # a no-op once delivered


async def _recorded(cache: ResponseCache, key: str, gen: Generation, outputs: AsyncIterator[EngineOutput]) -> AsyncIterator[EngineOutput]:
    texts: list[str] = []
    usable = True
    async with aclosing(outputs) as it:  # type: ignore[type-var]
        async for out in it:
            for part in out.before or ():
                texts.append(part.text)
                usable = usable and part.raw_choice is None
            texts.append(out.text)
            usable = usable and out.raw_choice is None and out.error is None
            if (out.finished and usable and out.finish_reason in (FINISH_STOP, FINISH_LENGTH) and out.recorded_finish is None
                    and not gen.cancel_requested):
                cache.put_later(key, {
                    "texts": texts,
                    "finish_reason": out.finish_reason,
                    "prompt_tokens": gen.prompt_tokens,
                    "completion_tokens": gen.completion_tokens,
                    "estimated": gen.estimated,
                    "stop_sequence": gen.stop_sequence,
                })
            yield out


async def start(app: Any) -> None:
    settings = app.state.settings
    config = app.state.response_cache_config or CacheConfig.from_settings(settings.cache)
    if settings.redis.url:
        store: Any = RedisStore(settings.redis.url, settings.redis.prefix + "rc:", max(0.05, settings.redis.timeout))
    else:
        store = MemoryStore(config.max_entries)
    cache = ResponseCache(store, config)
    metrics = app.state.metrics
    if metrics is not None:
        cache.lookups = Counter(
            "tollgate_response_cache_lookups", "Response-cache lookups of cacheable requests, by model and result (hit|miss).",
            ["model", "result"], registry=metrics.registry,
        )
        metrics.registry.register(_HitRatio(cache))
    app.state.response_cache = cache


async def stop(app: Any) -> None:
    cache: ResponseCache | None = app.state.response_cache
    if cache is not None:
        await cache.flush()
        await cache.store.close()
