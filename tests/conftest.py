"""Shared fixtures: a real Postgres database per session, the real model loaded once, and
gateway servers run by uvicorn on ephemeral ports (in threads, so tests can see the engine)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest
import sqlalchemy as sa

from bench.harness import ServerThread  # noqa: F401  (one server thread for benches and tests; re-exported)
from billing import migrate
from billing.db import create_engine
from billing.keys.store import KeyStore
from engines.backends.hf import HFEngine
from gateway.app import create_app
from gateway.config import DEFAULT_MODEL_ID, Settings, default_cache_dir
from tests.drop_databases import admin_sql
from tests.engine_ids import EngineIds

PG_HOST = os.environ.get("TOLLGATE_TEST_PGHOST", "127.0.0.1")
PG_PORT = int(os.environ.get("TOLLGATE_TEST_PGPORT", "5432"))
PG_USER = os.environ.get("TOLLGATE_TEST_PGUSER", "postgres")
MODEL = DEFAULT_MODEL_ID
SECRET = "test-secret-" + uuid.uuid4().hex

# Strict mode (.ci/run sets it): what the suite needs from the machine (Postgres, Redis, initdb,
# redis-server, Chromium) is an error when missing, never a skip; so is any other skip, except for
# tests marked `optional` (they need something CI does not have, e.g. a live Stripe key).
STRICT = os.environ.get("TOLLGATE_TEST_STRICT", "") not in ("", "0")
JOIN_TIMEOUT = 600.0  # seconds any fixture waits for a thread it started; then it fails, saying so


def missing(what: str) -> NoReturn:
    """A prerequisite of the machine is missing: an error in strict mode, a skip (named in the
    summary line) otherwise."""
    if STRICT:
        pytest.fail(f"strict mode (TOLLGATE_TEST_STRICT=1): {what}", pytrace=False)
    pytest.skip(what)


def reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def require_redis(url: str) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    if not reachable(host, port):
        missing(f"Redis is not reachable at {host}:{port} (make services starts it)")


def join_or_fail(thread: threading.Thread, what: str, timeout: float = JOIN_TIMEOUT) -> None:
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"{what} still running after {timeout:.0f}s")


def run_coro(coro: Any, timeout: float = JOIN_TIMEOUT) -> Any:
    """Runs a coroutine to completion on a private loop in a thread (legal inside async tests)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    join_or_fail(t, "run_coro's coroutine", timeout)
    if "error" in box:
        raise box["error"]
    return box.get("value")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "optional: needs something CI does not provide (a live secret): may skip in strict mode")
    config.addinivalue_line("markers", "solo: compares wall-clock times against a bound: `make test` runs it after the parallel "
                                       "part, alone on the machine (scripts/test.sh); so are tests that share a node id")


# The files whose tests take longest (a minute or more of processes: chaos, workers, vLLM on the CPU, drain),
# the longest first, measured with --durations under `make test`'s workers. `make test` hands files to its
# workers in collection order, one at a time (scripts/test.sh: --dist loadfile): started first, the long ones
# end together instead of one running on alone after the rest. Only the order changes; a file missing here
# runs after these, in its usual place.
LONGEST_FIRST = (
    "tests/engines/backends/test_vllm_replica.py",
    "tests/gateway/serving/test_workers_shared_engine.py",
    "tests/gateway/serving/test_chaos_cluster.py",
    "tests/gateway/serving/test_chaos.py",
    "tests/gateway/serving/test_durable_metering.py",
    "tests/gateway/batches/test_batch_restart.py",
    "tests/gateway/serving/test_workers_shared_trtllm.py",
    "tests/gateway/serving/test_quota_redis_failures.py",
    "tests/gateway/http/test_drain.py",
    "tests/gateway/serving/test_quotas.py",
    "tests/gateway/serving/test_workers.py",
    "tests/billing/credits/test_credits.py",
    "tests/engines/backends/test_hf_process.py",
    "tests/gateway/batches/test_batches.py",
    "tests/gateway/test_request_path.py",
    "tests/gateway/serving/test_model_load_failure.py",
    "tests/engines/decoding/test_guided.py",
    "tests/gateway/api/openai/test_completions.py",
    "tests/gateway/dashboard/test_dashboard.py",
)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # schemathesis gives every operation it generates a test for the same node id (its function's); the
    # workers' scheduler (--dist loadfile) keys tests by node id and would run one of them: they run in
    # `make test`'s one-process part, with the `solo` tests.
    ids = Counter(item.nodeid for item in items)
    for item in items:
        if ids[item.nodeid] > 1:
            item.add_marker(pytest.mark.solo)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    """Strict mode turns every skip into a failure, and every xfail (a timing check not compared on
    a loaded machine: CI's machine must be steady enough to compare), except in tests marked `optional`."""
    outcome = yield
    rep = outcome.get_result()
    if STRICT and hasattr(rep, "wasxfail") and rep.skipped and item.get_closest_marker("optional") is None:
        rep.outcome = "failed"
        rep.longrepr = f"strict mode (TOLLGATE_TEST_STRICT=1) allows no xfail: {rep.wasxfail}"
        del rep.wasxfail
        return
    if not rep.skipped or hasattr(rep, "wasxfail"):
        return
    if item.get_closest_marker("optional") is not None:
        rep.user_properties.append(("optional", True))
    elif STRICT:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"strict mode (TOLLGATE_TEST_STRICT=1) allows no skip: {reason}"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Says why tests were skipped and which timing assertions were not checked (xfail), so neither
    hides in a count."""
    skips: dict[bool, Counter[str]] = {True: Counter(), False: Counter()}
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        skips[("optional", True) in rep.user_properties][reason.removeprefix("Skipped: ")] += 1
    xfails = [(rep.nodeid, getattr(rep, "wasxfail", "")) for rep in terminalreporter.stats.get("xfailed", [])]
    for optional, reasons in skips.items():
        if not reasons:
            continue
        mode = "optional: allowed in strict mode" if optional else "local run: TOLLGATE_TEST_STRICT=1 (CI) makes these errors"
        terminalreporter.write_line(f"{sum(reasons.values())} skipped ({mode}):", yellow=True)
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"  {n} x {reason}", yellow=True)
    if xfails:
        terminalreporter.write_line(f"{len(xfails)} xfailed (assertions not checked, and why):", yellow=True)
        for nodeid, reason in xfails:
            terminalreporter.write_line(f"  {nodeid}: {reason.removeprefix('reason: ')}", yellow=True)


def seconds_to_room_in_minute(room: float) -> float:
    """How long to wait until the clock's minute has `room` seconds left: per-minute limits count in
    fixed windows (billing.quota.minute_of), so a test that expects a refusal must not straddle a boundary."""
    left = 60.0 - time.time() % 60.0
    return 0.0 if left >= room else left + 0.05


async def minute_with_room(room: float = 20.0) -> None:
    await asyncio.sleep(seconds_to_room_in_minute(room))


def pg_url(db: str) -> str:
    return f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{db}"


async def _admin_sql(sql: str) -> None:
    await admin_sql(PG_HOST, PG_PORT, PG_USER, [sql])


@pytest.fixture(scope="session")
def fresh_pg_database() -> Iterator[Any]:
    """A factory of Postgres databases, all dropped at the end of the session: empty, or with
    `migrated=True` at the migrations' head, a copy (CREATE DATABASE ... TEMPLATE) of one database
    the session migrated once: the same schema as running the migrations, in a fraction of the time."""
    if not reachable(PG_HOST, PG_PORT):
        missing(f"Postgres is not reachable at {PG_HOST}:{PG_PORT} (make services starts it)")
    made: list[str] = []
    head: list[str] = []  # the migrated template, made on first use

    def create(template: str | None = None) -> str:
        name = f"tollgate_test_{uuid.uuid4().hex[:12]}"
        run_coro(_admin_sql(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")))
        made.append(name)
        return name

    def make(migrated: bool = False) -> str:
        if not migrated:
            return pg_url(create())
        if not head:
            template = create()
            migrate.upgrade(pg_url(template))  # disposes its connections: a template must have none
            head.append(template)
        return pg_url(create(head[0]))

    yield make
    if made:  # dropped by a process of its own: each DROP waits for a checkpoint (tests/drop_databases.py)
        subprocess.Popen([sys.executable, "-m", "tests.drop_databases", PG_HOST, str(PG_PORT), PG_USER, *made],
                         cwd=Path(__file__).resolve().parents[1], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A factory of SQLite files at the migrations' head (returns the `sqlite:///` URL of `path`): a
    copy of one file the session migrated once, as fresh_pg_database(migrated=True) is for Postgres."""
    head = tmp_path_factory.mktemp("sqlite-head") / "head.db"

    def make(path: Path) -> str:
        if not head.exists():
            migrate.upgrade(f"sqlite:///{head}")
        shutil.copyfile(head, path)
        return f"sqlite:///{path}"

    return make


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A private Redis Cluster (3 masters + 3 replicas, tests/redis_topologies.py) for the quota suite;
    no test kills its nodes (the failover tests make their own)."""
    from tests.redis_topologies import LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def engine() -> Iterator[HFEngine]:
    """The real embedded model, loaded once for the whole session."""
    # The converted checkpoint where `tollgate serve` keeps it ($XDG_CACHE_HOME/tollgate): converted once.
    eng = HFEngine(model_id=MODEL, max_batch_size=32, max_queue=64, cache_dir=default_cache_dir(os.environ))
    asyncio.run(eng.start())
    EngineIds.on(eng)  # what the engine itself produces per request, for tests to bill against
    yield eng
    asyncio.run(eng.stop())


async def until(predicate: Any, what: str, timeout: float = 10.0, every: float = 0.02) -> None:
    """Polls `predicate` (a function, plain or async) until it returns true; fails naming `what`
    after `timeout` seconds. What tests wait on instead of a sleep."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not so after {timeout}s")
        await asyncio.sleep(every)


async def on_server_loop(app: Any, coro: Any) -> Any:
    """Runs `coro` on an in-process gateway's own loop (its server thread's, where its Redis and
    database clients live) and returns its result."""
    task = app.state.ledger._task  # the ledger writer runs on the server thread's loop
    assert task is not None and not task.done(), "the ledger writer is not running"
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, task.get_loop()))


async def price_in_force(gw: "Gateway", model: str, input_per_million: str) -> None:
    """Waits until the gateway's own price book prices `model` at the version just added (instead
    of sleeping after POST /admin/prices)."""
    from decimal import Decimal

    async def current() -> bool:
        version = await on_server_loop(gw.app, gw.app.state.prices.current(model))
        return version is not None and version.input_per_million == Decimal(input_per_million)

    await until(current, f"the price of {model} at {input_per_million}/M in force")


async def flush_ledger(app: Any, timeout: float = 30.0) -> None:
    """Barrier: returns once every ledger row an in-process gateway recorded before this call is in
    the database (LedgerWriter.flush, run on the server thread's own loop). After it, "no row was
    written" is a fact, not a guess after a sleep."""
    await on_server_loop(app, app.state.ledger.flush(timeout=timeout))


@dataclass
class Gateway:
    base_url: str
    settings: Settings
    admin_key: str
    engine: HFEngine
    app: Any
    db_url: str

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def admin_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=30)

    async def new_account(self, name: str | None = None) -> dict[str, Any]:
        async with self.admin_client() as c:
            r = await c.post("/admin/accounts", json={"name": name or f"acct-{uuid.uuid4().hex[:8]}"})
            assert r.status_code == 201, r.text
            return r.json()

    async def new_key(self, account_id: int | None = None, **fields: Any) -> dict[str, Any]:
        if account_id is None:
            account_id = (await self.new_account())["id"]
        async with self.admin_client() as c:
            r = await c.post("/admin/keys", json={"account_id": account_id, **fields})
            assert r.status_code == 201, r.text
            return r.json()

    async def ledger_row(self, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """The ledger row for a request, waiting for the writer's batch to land."""
        db = create_engine(self.db_url)
        try:
            deadline = time.monotonic() + timeout
            while True:
                async with db.connect() as conn:
                    row = (
                        await conn.execute(sa.text("SELECT * FROM ledger_entries WHERE request_id = :r"), {"r": request_id})
                    ).first()
                if row is not None:
                    return dict(row._mapping)
                if time.monotonic() > deadline:
                    raise AssertionError(f"no ledger row for {request_id} after {timeout}s")
                await asyncio.sleep(0.05)
        finally:
            await db.dispose()

    async def flush_ledger(self, timeout: float = 30.0) -> None:
        await flush_ledger(self.app, timeout)

    @property
    def produced(self) -> EngineIds:
        """What the engine itself produced per request id (tests/engine_ids.py), not what the gateway metered."""
        return EngineIds.on(self.engine)

    async def only_row(self, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """The request's ledger row, asserted to be its only one once the writer has flushed."""
        row = await self.ledger_row(request_id, timeout)
        await self.flush_ledger()
        assert await self.ledger_count(request_id=request_id) == 1, f"more than one ledger row for {request_id}"
        return row

    async def ledger_count(self, **where: Any) -> int:
        db = create_engine(self.db_url)
        try:
            clause = " AND ".join(f"{k} = :{k}" for k in where) or "1=1"
            async with db.connect() as conn:
                return int((await conn.execute(sa.text(f"SELECT count(*) FROM ledger_entries WHERE {clause}"), where)).scalar_one())
        finally:
            await db.dispose()


def bootstrap(db_url: str, secret: str) -> str:
    """Migrates a database and returns a fresh admin key for it."""
    migrate.upgrade(db_url)

    async def make_admin() -> str:
        db = create_engine(db_url)
        try:
            keys = KeyStore(db, secret.encode())
            account = await keys.ensure_account("admin")
            return str((await keys.create_key(account["id"], name="test admin", is_admin=True))["key"])
        finally:
            await db.dispose()

    return run_coro(make_admin())


def start_gateway(db_url: str, engine: HFEngine, tmp: Path, **overrides: Any) -> tuple[ServerThread, Gateway]:
    """`overrides` as Settings.with_overrides takes them: a group's fields by a mapping (`redis={"url": ...}`)."""
    # Slow shared CI cores must not turn the scheduler's expected-wait refusals into quota-test noise;
    # the scheduling tests pass their own classes.
    overrides["scheduler"] = {"classes": "interactive:600,batch:3600", **overrides.get("scheduler", {})}
    admin_key = bootstrap(db_url, SECRET)
    settings = Settings(database_url=db_url, server_secret=SECRET, data_dir=tmp).with_overrides(**overrides)
    app = create_app(settings, engines={engine.model_id: engine})
    limits = {"read_timeout": settings.http.request_read_timeout, "max_header_bytes": settings.http.max_header_bytes}
    server = ServerThread(app, **limits).__enter__()
    gw = Gateway(f"http://127.0.0.1:{server.port}", settings, admin_key, engine, app, db_url)
    return server, gw


def stop_server(server: ServerThread) -> None:
    """Stops a server thread; one that is still running after the join's timeout fails the teardown."""
    server.__exit__()
    if server.thread.is_alive():
        raise AssertionError("the gateway's server thread did not stop (ServerThread joins with a 15 s timeout)")


@pytest.fixture(scope="session")
def gateway(engine: HFEngine, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The gateway on real Postgres, serving the real model."""
    server, gw = start_gateway(fresh_pg_database(migrated=True), engine, tmp_path_factory.mktemp("gw-pg"))
    try:
        yield gw
    finally:
        stop_server(server)


REDIS_URL = os.environ.get("TOLLGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_gateway(engine: HFEngine, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The production shape: Postgres ledger and Redis quotas (a private key prefix per session)."""
    require_redis(REDIS_URL)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    server, gw = start_gateway(
        fresh_pg_database(migrated=True), engine, tmp_path_factory.mktemp("gw-redis"),
        redis={"url": REDIS_URL, "prefix": prefix, "timeout": 0.25},  # the suite shares 2 cores with the model; production default is 50 ms
    )
    try:
        yield gw
    finally:
        stop_server(server)


@pytest.fixture(scope="session")
def cluster_gateway(engine: HFEngine, fresh_pg_database: Any, redis_cluster: Any,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The gateway with REDIS_URL naming the local Redis Cluster (quotas and the response cache)."""
    server, gw = start_gateway(
        fresh_pg_database(migrated=True), engine, tmp_path_factory.mktemp("gw-cluster"),
        redis={"url": redis_cluster.url, "prefix": f"tgtest:{uuid.uuid4().hex[:8]}:", "timeout": 0.25},
    )
    try:
        yield gw
    finally:
        stop_server(server)


@pytest.fixture(scope="session")
def sqlite_gateway(engine: HFEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The embedded default: the same gateway on a SQLite file."""
    tmp = tmp_path_factory.mktemp("gw-sqlite")
    server, gw = start_gateway(f"sqlite:///{tmp / 'tollgate.db'}", engine, tmp)
    try:
        yield gw
    finally:
        stop_server(server)


@pytest.fixture
async def customer(gateway: Gateway) -> dict[str, Any]:
    """A new account with one key (dict from POST /admin/keys, secret under "key")."""
    return await gateway.new_key()


@pytest.fixture(autouse=True)
async def close_sdk_clients(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Closes every openai.AsyncOpenAI a test made, on the test's own loop, when it ends.

    The tests share one event loop. With SDK clients left open across tests, a later burst of
    200 concurrent requests hung until the client's timeout although the gateway had answered:
    the answers sat unread in client sockets whose transports were no longer registered with the
    loop (reproduced without the gateway, against a plain app; gone when clients are closed). The
    likely trigger is left-open clients being collected during a later burst that reuses their
    descriptors."""
    from openai import AsyncOpenAI

    made: list[AsyncOpenAI] = []
    original = AsyncOpenAI.__init__

    def tracking_init(self: AsyncOpenAI, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(AsyncOpenAI, "__init__", tracking_init)
    yield
    for client in made:
        try:
            await client.close()
        except RuntimeError:
            pass  # made and used on another loop (a server thread's): nothing of ours to close


@pytest.fixture
def client_for(gateway: Gateway) -> Any:
    from openai import AsyncOpenAI

    def make(key: str, gw: Gateway | None = None) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=(gw or gateway).v1, api_key=key, max_retries=0, timeout=120)

    return make
