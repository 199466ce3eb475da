"""Wiring: builds what the app serves with (engines, scheduler, ledger, limiter, prices, the
metering every request goes through) from the settings, once, in the lifespan; the routes find it
all in `app.state`, one typed Services (gateway/services.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from billing.ledger import partitions
from billing.db import create_engine
from billing.ledger.journal import JournalLocked, LedgerJournal, Recovered
from billing.keys.store import KeyStore
from billing.ledger.writer import LedgerWriter, adopt_journal, release_interrupted
from billing.periodic import Periodic
from billing.models import utcnow
from billing.prices.book import PriceBook
from billing.quota import LedgerTotals, Limiter, MemoryLimiter, RedisLimiter, Scope
from billing.quota.limits import Limits
from engines.base import Engine, EngineError
from engines.wrappers.scheduler import ScheduledEngine, schedule_engines
from gateway import billing
from gateway.api.openai import embeddings as embeddings_api
from gateway.serving import cache as response_cache
from gateway.batches import service as batches
from gateway.config import EngineSettings, Settings
from gateway.http.metrics import Metrics
from gateway.serving.completions import CompletionService
from gateway.services import Services
from gateway.dashboard.sessions import SessionStore

log = logging.getLogger("tollgate")


async def limits_changed(limiter: Limiter, meter: Any, principal: Any) -> None:
    """A key's or its account's limits (or billing mode) changed, here or in another process (the
    CLI, another gateway): the counters are rebuilt from the ledger at the next admission (a scope
    that had no limits took no holds and settled nothing meanwhile), and the requests still running
    that were admitted without a hold there settle their usage there when they end (Meter), since
    their rows come after that rebuild read the ledger."""
    meter.limits_changed(principal)
    await limiter.invalidate(Scope("key", principal.key_id, Limits(), account=principal.account_id))
    await limiter.invalidate_account(principal.account_id)


def unserved_backend(config: EngineSettings) -> str | None:
    """Why `config` (the engine settings) names a backend that cannot be served (None: it can be)."""
    if config.models_file or config.backend == "hf":
        return None
    return (f"TOLLGATE_ENGINE={config.backend!r}: without a models file only the hf backend is served; "
            "describe trtllm and openai models in a models.yaml (TOLLGATE_MODELS or --models)")


def build_engines(settings: Settings) -> dict[str, Engine]:
    """The served map from `settings.engines`: a models file's models, or the one hf model. What the
    engines would otherwise take from the environment comes from the settings too: models.yaml's
    `api_key_env` names are looked up in `engines.environ`, converted checkpoints go to `engines.cache_dir`."""
    config = settings.engines
    if config.models_file:
        from engines.registry import ModelsConfigError, load_models

        try:
            built = load_models(config.models_file, environ=config.environ).build(cache_dir=config.cache_dir)
        except ModelsConfigError as exc:
            raise SystemExit(f"error in the models file:\n{exc}") from None
        if settings.http.workers > 1:
            share_replicas(built, settings.http.workers)
        if config.engine_hosts:
            from gateway.serving.engine_hosts import connect_hosted

            connect_hosted(built, config.engine_hosts)
        return built
    refused = unserved_backend(config)
    if refused:
        raise SystemExit(refused)
    from engines.backends.hf import HFEngine
    from engines.backends.hf_process import HFProcessEngine

    params: dict[str, Any] = dict(
        model_path=config.model_path,
        cache_dir=config.cache_dir,
        device=config.device,
        max_batch_size=config.max_batch_size,
        max_queue=config.max_queue,
        kv_cache_tokens=config.kv_cache_tokens,
        max_batch_tokens=config.max_batch_tokens,
        cuda_graphs=config.cuda_graphs,
        warmup=config.warmup,
    )
    if config.process:
        engine: HFEngine = HFProcessEngine(model_id=config.model_id, gather_ms=config.gather_ms, **params)
    else:
        engine = HFEngine(model_id=config.model_id, **params)
    return {engine.model_id: engine}


def share_replicas(engines: dict[str, Engine], workers: int) -> None:
    """Each of `workers` processes sends a replica its share of the requests the replica takes at
    once (`max_concurrency`, rounded up), so that together they do not overload it."""
    from engines.backends.openai_pool import OpenAIPoolEngine

    seen: set[int] = set()
    for chain in engines.values():
        for engine in chain.runners():
            if isinstance(engine, OpenAIPoolEngine) and id(engine) not in seen:
                seen.add(id(engine))
                engine.pool.max_concurrency = max(1, -(-engine.pool.max_concurrency // workers))


def open_ledger(db: Any, settings: Settings) -> tuple[LedgerWriter, Recovered]:
    """The ledger writer; with the journal on, rows an earlier run left unwritten are queued first."""
    if not settings.ledger.journal:
        return LedgerWriter(db, max_backlog=settings.ledger.max_backlog, linger=settings.ledger.linger, **_ingest(settings)), Recovered()
    # One journal directory per process. With several workers each takes the first one no other
    # worker holds (journal, journal-1, ...): a worker that replaces a dead one recovers its rows.
    def writer(name: str) -> LedgerWriter:
        journal = LedgerJournal(settings.data_dir / name, fsync_interval=settings.ledger.fsync_interval)
        return LedgerWriter(db, journal=journal, max_backlog=settings.ledger.max_backlog, linger=settings.ledger.linger, **_ingest(settings))

    names = ["journal"] + [f"journal-{i}" for i in range(1, settings.http.workers)]
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
    (billing/ledger/pg_copy.py; bench/ledger_writer.py compares), or the one-statement insert."""
    if settings.ledger.copy_connections:
        return {"copy_connections": settings.ledger.copy_connections, "batch_size": 2500 * settings.ledger.copy_connections}
    return {}


def orphan_journals(settings: Settings) -> list[Path]:
    """Journal directories of workers beyond the current count (the server ran with more before):
    no worker claims them now, so their rows are finished here (billing.ledger.writer.adopt_journal)."""
    if not settings.ledger.journal:
        return []
    found = []
    for path in settings.data_dir.glob("journal-*"):
        suffix = path.name.removeprefix("journal-")
        if path.is_dir() and suffix.isdigit() and int(suffix) >= settings.http.workers:
            found.append(path)
    return sorted(found)


def schedule(served: dict[str, Engine], settings: Settings) -> tuple[dict[str, Engine], list[ScheduledEngine]]:
    """The gateway's queue in front of every engine (docs/scheduling.md); off: the engines as they are."""
    names = tuple(c.name for c in settings.scheduler.priority_classes)
    for engine in served.values():  # pools that send the account's class upstream map these
        for candidate in engine.runners():
            candidate.use_classes(names)
    if not settings.scheduler.enabled:
        return served, []
    classes = settings.scheduler.priority_classes

    def make(engine: Engine) -> ScheduledEngine:
        return ScheduledEngine(
            engine,
            capacity=-(-settings.scheduler.capacity // settings.http.workers) or None,  # each worker's share
            capacity_tokens=settings.scheduler.capacity_tokens or None,
            reserve=settings.scheduler.reserve,
            classes=classes,
            max_queue=settings.scheduler.max_queue,
        )

    return schedule_engines(served, make)


def build_limiter(
    settings: Settings, db: Any, ledger: LedgerWriter, process_id: str | None = None, on_register: Callable[[str], None] | None = None
) -> Limiter:
    totals = LedgerTotals(db, flush=lambda: ledger.flush(timeout=2.0), pending=ledger.unconfirmed)
    if settings.redis.url:
        limiter = RedisLimiter(
            settings.redis.url,
            totals,
            prefix=settings.redis.prefix,
            timeout=settings.redis.timeout,
            fail_open=settings.quotas.fail_open,
            hold_seconds=settings.quotas.hold_seconds,
            process_id=process_id,
            on_register=on_register,
        )
        ledger.on_written(limiter.written)  # settled usage the ledger now holds (rebuilds need not keep it)
        return limiter
    return MemoryLimiter(totals, hold_seconds=settings.quotas.hold_seconds)


def quota_process_ids(ledger: LedgerWriter) -> tuple[str | None, str | None]:
    """This process's registration with the shared quota store, and the one the previous run on the
    same journal had (kept in the journal's directory: one process per directory), so a restart
    after a crash does not wait for a registration that will never come back. (None, None) without
    a journal."""
    return (None, None) if ledger.journal is None else ledger.journal.run_ids("quota-process")


async def finish_crashed_run(
    ledger: LedgerWriter, limiter: Limiter, recovered: Recovered, previous: str | None, groups: set[str] | frozenset[str] = frozenset()
) -> None:
    """What a start does with the journal of a run that crashed: its interrupted requests' holds are
    released with what their rows say; then, on a shared quota store, the counters of every account
    with replayed rows are rebuilt from the ledger and the rows not in it yet (the crashed run had
    counted them, but a failover meanwhile may have lost that; billing/quota/lua/recover.lua), which
    also drops the crashed run's other holds there. `groups`: every group the crashed run registered
    in (its notes); in those without replayed rows its holds are dropped alone (forget.lua): requests
    it reserved and was killed before journaling."""
    if isinstance(limiter, RedisLimiter):
        limiter.adopt(recovered.replayed)  # the crashed run filed their usage in `unc`
    await release_interrupted(ledger, limiter.settle, recovered, wait=30.0)
    rows = [*recovered.replayed, *(row for row, _hold in recovered.interrupted)]
    if rows and isinstance(limiter, RedisLimiter):
        try:
            await limiter.recover_groups({f"a{row['account_id']}" for row in rows}, previous)
        except Exception as exc:  # Redis out: the counters are rebuilt when it comes back (a restart or failover)
            log.warning("could not rebuild the quota counters after replaying the journal: %s", type(exc).__name__)
    rest = set(groups) - {f"a{row['account_id']}" for row in rows}
    if rest and previous and isinstance(limiter, RedisLimiter):
        try:
            await limiter.forget_run(rest, previous)
        except Exception as exc:  # Redis out: those holds expire by themselves (hold_seconds)
            log.warning("could not drop the crashed run's holds: %s", type(exc).__name__)


def freeze_heap() -> None:
    """Moves what is alive now out of the cyclic collector's scans (`gc.freeze()`), after a
    collection: what starting up built (models, tokenizers, SQLAlchemy and pydantic state, the
    embedding model's modules) lives as long as the process. Left in the oldest generation it was
    scanned by every full collection, and request garbage promoted under load triggers one every
    second or two: ~360k objects, ~160 ms with the event loop stopped (docs/performance.md)."""
    gc.collect()
    gc.freeze()


def lifespan(
    settings: Settings, engines: dict[str, Engine] | None, *, freeze_gc: bool, exit_on_load_failure: bool
) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: builds the services into `app.state` (a Services), starts the
    background work, and stops it all in reverse at shutdown. Engines passed in are the caller's
    (not started or stopped here)."""
    owns_engines = engines is None

    @contextlib.asynccontextmanager
    async def run(app: Any) -> AsyncIterator[None]:
        state: Services = app.state
        db = create_engine(settings.resolved_database_url)
        ledger, recovered = open_ledger(db, settings)
        ledger.start()
        state.settings = settings
        state.db = db
        # Dashboards, /v1/usage and /admin/usage read here: a replica when DATABASE_READ_URL is set.
        read_db = create_engine(settings.database_read_url) if settings.database_read_url else db
        state.read_db = read_db
        state.keys = KeyStore(
            db, settings.secret_bytes(), cache_seconds=settings.quotas.key_cache_seconds, stale_seconds=settings.quotas.key_stale_seconds
        )
        state.ledger = ledger
        served, schedulers = schedule(engines if engines is not None else build_engines(settings), settings)
        prices = PriceBook(db)
        process_id, previous_process = quota_process_ids(ledger)
        # The quota groups this run registers in, and those the previous run on this journal did.
        groups = ledger.journal.run_notes("quota-groups") if ledger.journal is not None else None
        limiter = build_limiter(settings, db, ledger, process_id, on_register=groups.note if groups else None)
        checking = asyncio.create_task(limiter.check_store()) if isinstance(limiter, RedisLimiter) else None  # warns of eviction
        state.keys.on_limits_changed = lambda principal: limits_changed(limiter, state.service.meter, principal)
        releasing = asyncio.create_task(
            finish_crashed_run(ledger, limiter, recovered, previous_process, groups.previous if groups else set()))
        adopting = [asyncio.create_task(adopt_journal(ledger, limiter.settle, d)) for d in orphan_journals(settings)]
        partitioning = asyncio.create_task(partitions.keep_ahead(db, utcnow), name="ledger-partitions")  # this and next months' partitions
        state.prices = prices
        state.limiter = limiter
        state.service = CompletionService(served, ledger, limiter=limiter, prices=prices)
        # Running requests that took no hold on their key or account: a limit set there elsewhere is
        # learnt within a key cache's time even if no other request of the key comes here meanwhile.
        def recheck_failed(exc: Exception) -> None:  # the database is out: said once, then every 60th round
            if rechecking.pulse.worth_saying():
                log.warning("limits recheck failed (%d rounds in a row): %s", rechecking.pulse.streak, type(exc).__name__)

        rechecking = Periodic("limits-recheck", max(settings.quotas.key_cache_seconds, 0.25),
                              lambda: state.keys.recheck(state.service.meter.unheld_keys()), on_error=recheck_failed)
        rechecking.start()
        # Observability and dashboards.
        state.metrics = Metrics(served, ledger, multiproc_dir=settings.dashboards.prometheus_multiproc_dir)
        state.metrics.watch_queues(schedulers)
        ledger.add_listener(state.metrics.observe_usage)
        state.service.on_quota_rejected.append(state.metrics.quota_rejected)
        state.sessions = SessionStore(db, state.keys)
        await embeddings_api.start(app)
        await response_cache.start(app)
        await billing.start(app)  # invoices, price overrides, Stripe, monthly close
        await billing.start_credits(app)  # prepaid credit
        await batches.start(app)  # the Batch API's stores and runner
        loading: list[asyncio.Task[None]] = []
        state.load_failures = {}
        state.model_loads = loading  # the background loads (tests wait on them)
        if owns_engines:
            loading[:] = [asyncio.create_task(e.start(), name=f"load-{mid}") for mid, e in served.items()]
            for mid, task in zip(served, loading):
                task.add_done_callback(_load_watcher(app, mid, len(served), exit_on_load_failure))
        if freeze_gc:
            freeze_heap()
            for task in [*loading, state.embeddings_loading]:
                task.add_done_callback(lambda _task: freeze_heap())
        try:
            if owns_engines and (settings.engines.engine_hosts or settings.http.workers > 1):  # a worker of `serve --workers N`: loaded before it accepts
                from gateway.serving.engine_hosts import await_loads

                await await_loads(served, loading, settings.engines.engine_hosts)
            yield
        finally:
            await batches.stop(app)
            await billing.stop(app)
            await billing.stop_credits(app)
            await embeddings_api.stop(app)
            await response_cache.stop(app)
            await rechecking.stop()
            releasing.cancel()
            if checking is not None:
                checking.cancel()
            partitioning.cancel()
            for task in adopting:
                task.cancel()
            for task in loading:
                task.cancel()
            if owns_engines:
                for e in served.values():
                    await e.stop()
            await state.service.drain()
            await limiter.close()
            if groups is not None:
                groups.close(clear=not limiter.holding)  # holding nothing: the next run has nothing to drop
            await ledger.close()
            await db.dispose()
            if read_db is not db:
                await read_db.dispose()

    return run


def _load_watcher(app: Any, model_id: str, models: int, exit_when_all_failed: bool) -> Any:
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
            stop = app.state.stop_server  # set by `tollgate serve`, which then exits 1
            if stop is not None:
                stop()

    return done
