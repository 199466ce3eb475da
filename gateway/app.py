"""The Starlette application: routes are thin; everything is built once in the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.middleware import Middleware
from starlette.routing import Route

from billing.db import create_engine
from billing.keys import KeyStore, Principal
from billing.journal import JournalLocked, LedgerJournal, Recovered
from billing import partitions
from billing.ledger import LedgerWriter, adopt_journal, release_interrupted
from billing.models import utcnow
from billing.prices import EffectivePrice, PriceBook
from billing.quota import LedgerTotals, Limiter, MemoryLimiter, RedisLimiter
from engines.base import Engine, EngineError
from engines.scheduler import ScheduledEngine, schedule_engines
from gateway import admin, anthropic_api, dashboard, drain, openai_responses
from gateway import billing_api
from gateway import credits_api  # issue 25
from gateway import embeddings_api, response_cache  # issue 10
from engines.router import route_body  # issue 10
from gateway.ratelimit import hold_headers
from gateway.config import Settings
from gateway.errors import APIError, EngineNotReady, MethodNotAllowed, NotFound, ServiceUnavailable
from gateway.http import authenticate, read_json
from gateway.logs import RequestContext, request_id_of
from gateway.metrics import Metrics, metrics_endpoint
from gateway.openapi import openapi_document
from gateway.protocol import ChatCompletionRequest, CompletionRequest, parse
from gateway.responses import CompletedResponse, GenerationResponse
from gateway.serving import CompletionService
from gateway.sessions import SessionStore
from gateway.usage_api import get_usage

log = logging.getLogger("tollgate")


def json_response(payload: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status_code, media_type="application/json", headers=headers)


def build_engines(settings: Settings) -> dict[str, Engine]:
    if settings.models_file:
        from engines.registry import ModelsConfigError, load_models

        try:
            built = load_models(settings.models_file).build()
        except ModelsConfigError as exc:
            raise SystemExit(f"error in the models file:\n{exc}") from None
        if settings.workers > 1:
            share_replicas(built, settings.workers)
        return built
    if settings.engine_backend != "hf":
        raise SystemExit(
            f"TOLLGATE_ENGINE={settings.engine_backend!r}: without a models file only the hf backend is served; "
            "describe trtllm and openai models in a models.yaml (TOLLGATE_MODELS or --models)"
        )
    from engines.hf import HFEngine
    from engines.hf_process import HFProcessEngine

    params: dict[str, Any] = dict(
        model_path=settings.model_path,
        device=settings.device,
        max_batch_size=settings.max_batch_size,
        max_queue=settings.max_queue,
        kv_cache_tokens=settings.kv_cache_tokens,
        max_batch_tokens=settings.max_batch_tokens,
        cuda_graphs=settings.cuda_graphs,
        warmup=settings.warmup,
    )
    if settings.engine_process:
        engine: HFEngine = HFProcessEngine(model_id=settings.model_id, gather_ms=settings.engine_gather_ms, **params)
    else:
        engine = HFEngine(model_id=settings.model_id, **params)
    return {engine.model_id: engine}


def share_replicas(engines: dict[str, Engine], workers: int) -> None:
    """Each of `workers` processes sends a replica its share of the requests the replica takes at
    once (`max_concurrency`, rounded up), so that together they do not overload it."""
    from engines.openai_pool import OpenAIPoolEngine

    seen: set[int] = set()
    for chain in engines.values():
        for engine in getattr(chain, "candidates", [chain]):
            if isinstance(engine, OpenAIPoolEngine) and id(engine) not in seen:
                seen.add(id(engine))
                engine.pool.max_concurrency = max(1, -(-engine.pool.max_concurrency // workers))


def open_ledger(db: Any, settings: Settings) -> tuple[LedgerWriter, Recovered]:
    """The ledger writer; with the journal on, rows an earlier run left unwritten are queued first."""
    if not settings.ledger_journal:
        return LedgerWriter(db, max_backlog=settings.ledger_max_backlog, linger=settings.ledger_linger, **_ingest(settings)), Recovered()
    # One journal directory per process. With several workers each takes the first one no other
    # worker holds (journal, journal-1, ...): a worker that replaces a dead one recovers its rows.
    def writer(name: str) -> LedgerWriter:
        journal = LedgerJournal(settings.data_dir / name, fsync_interval=settings.ledger_fsync_interval)
        return LedgerWriter(db, journal=journal, max_backlog=settings.ledger_max_backlog, linger=settings.ledger_linger, **_ingest(settings))

    names = ["journal"] + [f"journal-{i}" for i in range(1, settings.workers)]
    for name in names[:-1]:
        ledger = writer(name)
        try:
            return ledger, ledger.recover()
        except JournalLocked:
            continue
    ledger = writer(names[-1])
    return ledger, ledger.recover()  # JournalLocked here: every directory is held


def _ingest(settings: Settings) -> dict[str, int]:
    """The ledger writer's Postgres path: binary COPY on several connections with larger batches
    (billing/ledger_copy.py; bench/ledger_writer.py compares), or the one-statement insert."""
    if settings.ledger_copy_connections:
        return {"copy_connections": settings.ledger_copy_connections, "batch_size": 2500 * settings.ledger_copy_connections}
    return {}


def orphan_journals(settings: Settings) -> list[Path]:
    """Journal directories of workers beyond the current count (the server ran with more before):
    no worker claims them now, so their rows are finished here (billing.ledger.adopt_journal)."""
    if not settings.ledger_journal:
        return []
    found = []
    for path in settings.data_dir.glob("journal-*"):
        suffix = path.name.removeprefix("journal-")
        if path.is_dir() and suffix.isdigit() and int(suffix) >= settings.workers:
            found.append(path)
    return sorted(found)


def schedule(served: dict[str, Engine], settings: Settings) -> tuple[dict[str, Engine], list[ScheduledEngine]]:
    """The gateway's queue in front of every engine (docs/scheduling.md); off: the engines as they are."""
    if not settings.scheduler:
        return served, []
    classes = settings.priority_classes

    def make(engine: Engine) -> ScheduledEngine:
        return ScheduledEngine(
            engine,
            capacity=-(-settings.scheduler_capacity // settings.workers) or None,  # each worker's share
            capacity_tokens=settings.scheduler_capacity_tokens or None,
            reserve=settings.scheduler_reserve,
            classes=classes,
            max_queue=settings.scheduler_max_queue,
        )

    return schedule_engines(served, make)


def build_limiter(settings: Settings, db: Any, ledger: LedgerWriter) -> Limiter:
    totals = LedgerTotals(db, flush=lambda: ledger.flush(timeout=2.0))
    if settings.redis_url:
        return RedisLimiter(
            settings.redis_url,
            totals,
            prefix=settings.redis_prefix,
            timeout=settings.redis_timeout,
            fail_open=settings.quota_fail_open,
            hold_seconds=settings.quota_hold_seconds,
        )
    return MemoryLimiter(totals, hold_seconds=settings.quota_hold_seconds)


async def _admit(service: CompletionService, gen: Any) -> None:
    """Quota admission; a refused request gives back the place the scheduler held for it at prepare."""
    try:
        await service.admit(gen)
    except BaseException:
        gen.engine.cancel(gen.request_id)
        raise


async def _generate(request: Request, model: type[Any], kind: str) -> Any:
    state = request.app.state
    request_id = request_id_of(request)  # made by RequestContext; also the ledger row's id
    principal = await authenticate(request, state.keys)
    state.billing.guard(principal)  # 403 for keys of a suspended account (unpaid invoices)
    raw = await read_json(request, state.settings.max_body_bytes)
    raw = route_body(state.service.engines, raw, kind)  # issue 10: a virtual model (`auto`) names a real one
    body = parse(model, raw, passthrough=_passes_through(state.service, raw))
    service: CompletionService = state.service
    if kind == "chat":
        gen = service.prepare_chat(principal, body, request_id)
    else:
        gen = service.prepare_text(principal, body, request_id)
    cached = await response_cache.replay(request, gen)  # issue 10: a hit is metered and served from the cache
    if cached is not None:
        gen.engine.cancel(request_id)  # never reaches the engine: gives back the place the scheduler held
        return cached
    await _admit(service, gen)
    # Admitted from here on: the metered stream settles the quota and writes the ledger row.
    headers = {"x-request-id": request_id, **hold_headers(gen.hold)}
    if not gen.stream and gen.engine.completes and not response_cache.records(request):
        return CompletedResponse(gen, service, headers)  # one body from a chain that answers as one coroutine
    return GenerationResponse(gen, response_cache.recording(request, gen, service.metered(gen)), headers)  # issue 10


async def chat_completions(request: Request) -> Any:
    return await _generate(request, ChatCompletionRequest, "chat")


async def completions(request: Request) -> Any:
    return await _generate(request, CompletionRequest, "text")


def _model_card(engine: Engine, price: EffectivePrice | None = None) -> dict[str, Any]:
    card: dict[str, Any] = {"id": engine.model_id, "object": "model", "created": 0, "owned_by": engine.owned_by}
    if price is not None:
        # What the caller's account pays now (its overrides applied), exact decimal strings.
        card["pricing"] = {
            "input_per_million": format(price.input_per_million, "f"),
            "output_per_million": format(price.output_per_million, "f"),
            "currency": price.currency,
        }
    return card


async def _priced_card(request: Request, principal: Principal, engine: Engine) -> dict[str, Any]:
    return _model_card(engine, await request.app.state.prices.current_for(principal.account_id, engine.model_id))


def _passes_through(service: CompletionService, raw: Any) -> bool:
    """Whether the requested model's engine forwards fields it does not use (see Engine.passthrough)."""
    name = raw.get("model") if isinstance(raw, dict) else None
    engine = service.engines.get(name) if isinstance(name, str) else None
    return bool(engine is not None and engine.passthrough)


async def _embedding_card(request: Request, principal: Principal, model: Any) -> dict[str, Any]:
    """An embedding model's card: its vectors' size once it has loaded (`dimensions`)."""
    card = await _priced_card(request, principal, model)
    card["type"] = "embedding"
    if model.dimensions:
        card["dimensions"] = model.dimensions
    return card


def _embedding_models(request: Request) -> dict[str, Any]:
    service = getattr(request.app.state, "embeddings", None)
    return service.models if service is not None else {}


async def list_models(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    engines: dict[str, Engine] = request.app.state.service.engines
    # Aliases resolve to the same engine under another key; the list names each model once.
    data = [await _priced_card(request, principal, e) for mid, e in engines.items() if mid == e.model_id and principal.may_use(mid)]
    data += [await _embedding_card(request, principal, m) for mid, m in _embedding_models(request).items() if principal.may_use(mid)]
    return json_response({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    model_id = request.path_params["model_id"]
    engine = request.app.state.service.engines.get(model_id)
    if engine is not None and (principal.may_use(model_id) or principal.may_use(engine.model_id)):
        return json_response(await _priced_card(request, principal, engine))
    embedding = _embedding_models(request).get(model_id)
    if embedding is not None and principal.may_use(model_id):
        return json_response(await _embedding_card(request, principal, embedding))
    raise NotFound(f"The model {model_id!r} does not exist.", param="model", code="model_not_found")


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    if request.app.draining:  # SIGTERM: out of the load balancer at once (gateway/drain.py)
        return ServiceUnavailable("This server is shutting down.", code="draining", headers={"Retry-After": "1"}).response()
    engines: dict[str, Engine] = request.app.state.service.engines
    failed = getattr(request.app.state, "load_failures", {})
    if failed:
        reasons = "; ".join(f"{mid}: {why}" for mid, why in failed.items())
        return ServiceUnavailable(f"models failed to load: {reasons}", code="model_load_failed").response()
    pending = [mid for mid, e in engines.items() if not e.ready]
    if pending:
        return EngineNotReady(f"models still loading: {', '.join(pending)}", headers={"Retry-After": "5"}).response()
    return json_response({"status": "ready", "models": list(engines)})


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return MethodNotAllowed(f"Method {request.method} is not allowed for {request.url.path}.").response()
    if exc.status_code == 404:
        return NotFound(f"Unknown path {request.url.path}.").response()
    err = APIError(str(exc.detail))
    err.status_code = exc.status_code
    err.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return err.response()


async def unexpected_error(request: Request, exc: Exception) -> Response:
    if database_unreachable(exc):  # an outage, not a bug: say so, and that a retry may work
        log.warning("database unreachable on %s %s: %s", request.method, request.url.path, type(exc).__name__)
        return ServiceUnavailable("The database is unavailable; retry shortly.", code="database_unavailable",
                                  headers={"Retry-After": "1"}).response()
    log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path, exc_info=exc)
    return APIError("The server had an error while processing your request.").response()


async def _error_response(scope: Any, exc: Exception) -> Any:
    """What Starlette's exception handlers would answer, for the routes dispatched without them."""
    request = Request(scope)
    if isinstance(exc, APIError):
        return exc.response()
    if isinstance(exc, HTTPException):
        return await http_error(request, exc)
    return await unexpected_error(request, exc)


def _endpoint_app(endpoint: Any) -> Any:
    """A request-response endpoint as a bare ASGI app (no router, no exception middleware)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scope["endpoint"] = endpoint  # the route label in logs and metrics, as the router sets it
        response = await endpoint(Request(scope, receive, send))
        await response(scope, receive, send)

    return app


class Gateway(Starlette):
    """Starlette, with the generation routes dispatched before the router.

    `POST /v1/chat/completions` and `POST /v1/completions` are most of the traffic. They skip
    Starlette's middleware stack, router scan and exception layers (eight ASGI frames that every
    streamed chunk resumes through) and run under the same RequestContext (ids, logs, metrics,
    security headers) with the same error answers. Anything else, other methods on those paths
    included, goes through Starlette as before."""

    def __init__(self, *, hot: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hot = {path: RequestContext(_endpoint_app(endpoint), on_error=_error_response) for path, endpoint in hot.items()}
        self.draining = False  # set on SIGTERM (gateway/drain.py): new requests get 503 with Retry-After
        self._refuse = RequestContext(drain.refuse)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.draining and drain.is_refused(scope):
            scope["app"] = self
            await self._refuse(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            app = self._hot.get(scope["path"])
            if app is not None:
                scope["app"] = self
                await app(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def database_unreachable(exc: BaseException) -> bool:
    if isinstance(exc, (OperationalError, InterfaceError)) or (isinstance(exc, DBAPIError) and exc.connection_invalidated):
        return True
    return isinstance(exc, (ConnectionError, asyncio.TimeoutError, TimeoutError)) or (
        isinstance(exc, OSError) and exc.errno is not None and exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH)
    )


def freeze_heap() -> None:
    """Moves what is alive now out of the cyclic collector's scans (`gc.freeze()`), after a
    collection: what starting up built (models, tokenizers, SQLAlchemy and pydantic state, the
    embedding model's modules) lives as long as the process. Left in the oldest generation it was
    scanned by every full collection, and request garbage promoted under load triggers one every
    second or two: ~360k objects, ~160 ms with the event loop stopped (docs/performance.md)."""
    gc.collect()
    gc.freeze()


def create_app(
    settings: Settings, engines: dict[str, Engine] | None = None, *, freeze_gc: bool = False, exit_on_load_failure: bool = False
) -> Gateway:
    """Builds the app. Engines passed in are owned by the caller (not started or stopped here).
    `freeze_gc` (the server's processes): `freeze_heap()` once started and again as each model
    that loads in the background is in."""
    owns_engines = engines is None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        db = create_engine(settings.resolved_database_url)
        ledger, recovered = open_ledger(db, settings)
        ledger.start()
        app.state.settings = settings
        app.state.db = db
        # Dashboards, /v1/usage and /admin/usage read here: a replica when DATABASE_READ_URL is set.
        read_db = create_engine(settings.database_read_url) if settings.database_read_url else db
        app.state.read_db = read_db
        app.state.keys = KeyStore(
            db, settings.secret_bytes(), cache_seconds=settings.key_cache_seconds, stale_seconds=settings.key_stale_seconds
        )
        app.state.ledger = ledger
        served, schedulers = schedule(engines if engines is not None else build_engines(settings), settings)
        prices = PriceBook(db)
        limiter = build_limiter(settings, db, ledger)
        releasing = asyncio.create_task(release_interrupted(ledger, limiter.settle, recovered, wait=30.0))
        adopting = [asyncio.create_task(adopt_journal(ledger, limiter.settle, d)) for d in orphan_journals(settings)]
        partitioning = asyncio.create_task(partitions.keep_ahead(db, utcnow), name="ledger-partitions")  # issue 24
        app.state.prices = prices
        app.state.limiter = limiter
        app.state.service = CompletionService(served, ledger, limiter=limiter, prices=prices)
        # Observability and dashboards (issue 6).
        app.state.metrics = Metrics(served, ledger)
        app.state.metrics.watch_queues(schedulers)
        ledger.add_listener(app.state.metrics.observe_usage)
        app.state.service.on_quota_rejected.append(app.state.metrics.quota_rejected)
        app.state.sessions = SessionStore(db, app.state.keys)
        await embeddings_api.start(app)  # issue 10
        await response_cache.start(app)  # issue 10
        await billing_api.start(app)  # invoices, price overrides, Stripe, monthly close (issue 5)
        await credits_api.start(app)  # prepaid credit (issue 25)
        loading: list[asyncio.Task[None]] = []
        app.state.load_failures = {}
        app.state.model_loads = loading  # the background loads (tests wait on them)
        if owns_engines:
            loading[:] = [asyncio.create_task(e.start(), name=f"load-{mid}") for mid, e in served.items()]
            for mid, task in zip(served, loading):
                task.add_done_callback(_load_watcher(app, mid, len(served), exit_on_load_failure))
        if freeze_gc:
            freeze_heap()
            for task in [*loading, app.state.embeddings_loading]:
                task.add_done_callback(lambda _task: freeze_heap())
        try:
            yield
        finally:
            await billing_api.stop(app)
            await credits_api.stop(app)
            await embeddings_api.stop(app)  # issue 10
            await response_cache.stop(app)  # issue 10
            releasing.cancel()
            partitioning.cancel()
            for task in adopting:
                task.cancel()
            for task in loading:
                task.cancel()
            if owns_engines:
                for e in served.values():
                    await e.stop()
            await app.state.service.drain()
            await limiter.close()
            await ledger.close()
            await db.dispose()
            if read_db is not db:
                await read_db.dispose()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/openapi.json", openapi_document, methods=["GET"]),
        *admin.routes,
        Route("/v1/usage", get_usage, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *dashboard.routes,
        *billing_api.routes,
        *credits_api.routes,  # issue 25
        *embeddings_api.routes,  # issue 10
        *anthropic_api.routes,  # issue 21
        *openai_responses.routes,  # issue 21
    ]
    return Gateway(
        hot={"/v1/chat/completions": chat_completions, "/v1/completions": completions},
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(RequestContext)],  # ids, logs, metrics, security headers, query guard: one layer
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: unexpected_error},
    )


def _load_watcher(app: Starlette, model_id: str, models: int, exit_when_all_failed: bool) -> Any:
    """A done-callback for one model's load: a failure is logged, kept for /readyz, and when every
    model the server loads has failed (`tollgate serve`), the server stops with a non-zero exit."""

    def done(task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, EngineError) else str(exc)
        app.state.load_failures[model_id] = reason
        log.error("model %s failed to load: %s", model_id, reason)
        if exit_when_all_failed and len(app.state.load_failures) == models:
            app.state.fatal = f"no model could be loaded ({model_id}: {reason})"
            stop = getattr(app.state, "stop_server", None)  # set by `tollgate serve`, which then exits 1
            if stop is not None:
                stop()

    return done
