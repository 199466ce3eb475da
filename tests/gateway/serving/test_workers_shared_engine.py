"""`tollgate serve --workers 2` over one engine process (gateway/serving/engine_hosts.py): the engine loads
once and its batch is one, each worker streams its own requests, the shared quota and the ledger stay
exact, and the scheduler's reserve applies to the engine as a whole (its queue is in the engine host).
The engine is the `synthetic` one (engines/backends/synthetic.py: the hf engine process's pipe, no model)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil
from openai import AsyncOpenAI

from billing.keys.store import KeyStore
from engines.backends.synthetic import TEXT
from billing.db import create_engine
from tests.conftest import REDIS_URL, SECRET, bootstrap, require_redis, run_coro, seconds_to_room_in_minute
from tests.gateway.serving.test_workers import journal_finals
from tests.processes import GatewayProcess

MODELS = """models:
  - id: synth
    backend: synthetic
    step_ms: {step_ms}
    max_batch_size: 4
    max_queue: 64
"""


def start(fresh_pg_database: Any, tmp_path: Path, step_ms: float, db_url: str | None = None, admin_key: str | None = None,
          **env: str) -> GatewayProcess:
    require_redis(REDIS_URL)
    models = tmp_path / "models.yaml"
    models.write_text(MODELS.format(step_ms=step_ms))
    return GatewayProcess(
        db_url or fresh_pg_database(), tmp_path / "data", admin_key or "sk-admin-" + uuid.uuid4().hex, REDIS_URL=REDIS_URL,
        TOLLGATE_REDIS_PREFIX=f"tgtest:se:{uuid.uuid4().hex[:8]}:", TOLLGATE_WORKERS="2", TOLLGATE_MODELS=str(models),
        TOLLGATE_EMBEDDINGS="off", TOLLGATE_REDIS_TIMEOUT_MS="1000", **env,
    ).start()


async def stream(client: httpx.AsyncClient, key: str, max_tokens: int, on_first: Any = None) -> tuple[str, int, float]:
    """One streamed completion through the openai SDK on this client's connections: (text, usage's
    completion tokens, seconds to the first content); `on_first` is told when the first content comes."""
    sdk = AsyncOpenAI(base_url=str(client.base_url) + "/v1", api_key=key, max_retries=0, http_client=client)
    started = time.perf_counter()
    first: float | None = None
    text, tokens = "", -1
    async for chunk in await sdk.chat.completions.create(model="synth", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens,
                                                         stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - started
                if on_first is not None:
                    on_first(first)
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens, first if first is not None else float("inf")


def test_two_workers_share_one_engine_process_with_exact_quota_and_ledger(fresh_pg_database: Any, tmp_path: Path) -> None:
    gw = start(fresh_pg_database, tmp_path, step_ms=2)
    try:
        assert gw.proc is not None
        workers = gw.workers()
        assert len(workers) == 2
        engines = [p for p in psutil.Process(gw.proc.pid).children(recursive=True) if "engines.backends.synthetic" in " ".join(p.cmdline())]
        assert len(engines) == 1 and engines[0].ppid() == gw.proc.pid  # one engine, the supervisor's, none per worker

        made = run_coro(gw.new_key())
        key = made["key"]
        with httpx.Client(base_url=gw.base_url, headers={"Authorization": f"Bearer {gw.admin_key}"}, timeout=30) as admin:
            assert admin.patch(f"/admin/keys/{made['id']}", json={"limits": {"rpm": 12}}).status_code == 200

        async def fire() -> list[Any]:
            clients = [await gw.client_on_worker(w, timeout=60) for w in workers]
            try:
                answers: list[Any] = []
                for _ in range(8):  # one stream on each worker at once, 16 in all against rpm 12
                    answers += await asyncio.gather(*(stream(c, key, 24) for c in clients), return_exceptions=True)
                return answers
            finally:
                for c in clients:
                    await c.aclose()

        time.sleep(seconds_to_room_in_minute(30))  # the 16 requests in one minute's window
        answers = run_coro(fire())
        served = [a for a in answers if not isinstance(a, BaseException)]
        refused = [a for a in answers if isinstance(a, BaseException)]
        assert len(served) == 12 and all(getattr(e, "status_code", None) == 429 for e in refused), refused  # one limit across both
        for text, tokens, _first in served:
            assert tokens == 24 and text and text in TEXT * 3  # the engine's ids, detokenized in the worker

        per_worker = [journal_finals(gw.data_dir / name) for name in ("journal", "journal-1")]
        assert all(per_worker) and per_worker[0].isdisjoint(per_worker[1])  # both workers served
        assert len(per_worker[0] | per_worker[1]) == 12

        async def usage() -> dict[str, Any]:
            async with gw.admin() as admin:
                deadline = time.monotonic() + 30
                while True:  # rows reach the database within the writers' linger
                    accounts = (await admin.get("/admin/accounts")).json()
                    totals: dict[str, Any] = {}
                    for account in accounts if isinstance(accounts, list) else accounts.get("data", []):
                        got = (await admin.get("/v1/usage", params={"account_id": account["id"]})).json().get("totals", {})
                        if got.get("requests"):
                            totals = got
                    if totals.get("requests") == 12 or time.monotonic() > deadline:
                        return totals
                    await asyncio.sleep(0.2)

        totals = run_coro(usage())
        assert totals["requests"] == 12 and totals["completion_tokens"] == 12 * 24, totals
    finally:
        gw.stop()


def test_the_reserve_holds_for_the_engine_as_a_whole_across_workers(fresh_pg_database: Any, tmp_path: Path) -> None:
    # A heavy account fills the engine's regular slots (3 of 4, reserve 1) through both workers; a light
    # account's request then takes the reserved slot at once. With a queue per worker each would let 3 in,
    # the batch would fill with heavy streams and the light one would wait inside the engine behind them.
    gw = start(fresh_pg_database, tmp_path, step_ms=5, TOLLGATE_SCHEDULER_RESERVE="1")
    try:
        heavy, light = run_coro(gw.new_key())["key"], run_coro(gw.new_key())["key"]

        # Four connections on each worker: both workers send the heavy account's requests.
        heavy_runs, (text, tokens, first) = run_coro(gw.heavy_then_light(
            lambda c, started: stream(c, heavy, 300, started), lambda b: stream(b, light, 8)))
        assert tokens == 8 and text
        assert all(t == 300 for _, t, _ in heavy_runs)
        # Each heavy stream runs 300 steps of 5 ms (1.5 s or more); the light one waits for none of them.
        assert first < 1.0, first
    finally:
        gw.stop()


def customer_key(db_url: str) -> str:
    """A key made in the database before the gateway starts, so that no request reaches a worker
    before the ones a test sends."""
    async def make() -> str:
        db = create_engine(db_url)
        try:
            keys = KeyStore(db, SECRET.encode())
            account = await keys.ensure_account("first-requests")
            return str((await keys.create_key(account["id"], name="first requests"))["key"])
        finally:
            await db.dispose()

    return str(run_coro(make()))


def connecting_to(path: Path) -> int:
    """Connections to the Unix socket at `path` that its listener has not accepted yet (the kernel
    lists each under the listener's path in state 02, connecting)."""
    rows = (line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:])
    return sum(1 for row in rows if len(row) == 8 and row[7] == str(path) and row[5] == "02")


async def first_request(gw: GatewayProcess, worker: psutil.Process, key: str, started: Any = None) -> httpx.Response:
    """A chat completion as the first request of a connection only `worker` can accept (the other
    workers stopped until it is answered); `started(task)` is told once the request is under way."""
    others = [p for p in gw.workers() if p.pid != worker.pid]
    async with httpx.AsyncClient(base_url=gw.base_url, limits=httpx.Limits(max_connections=1), timeout=120,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        for other in others:
            other.suspend()
        try:
            task = asyncio.create_task(client.post("/v1/chat/completions", json={
                "model": "synth", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}))
            if started is not None:
                await started(task)
            return await task
        finally:
            for other in others:
                other.resume()


# How long the test holds the engine host's answer to a new worker once that worker has connected. A
# worker that waits for its host (await_loads) passes whatever the hold; a worker that accepts before
# its host has answered takes the request within milliseconds of connecting and refuses it (503)
# while the host is held: the hold only has to outlast that.
HOLD_S = 2.0


def test_every_worker_serves_its_first_request_once_the_gateway_is_ready(fresh_pg_database: Any, tmp_path: Path) -> None:
    """--workers 2: right after /readyz answered 200 (from whichever worker took that connection),
    each worker's first request is served, no 503 engine_not_ready, and so is the first request
    of a worker uvicorn starts again while its engine host is slow to answer: a worker accepts
    only once its connection to the engine host is open (gateway/serving/engine_hosts.py:await_loads)."""
    db_url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(db_url, SECRET)
    key = customer_key(db_url)
    gw = start(fresh_pg_database, tmp_path, step_ms=1, db_url=db_url, admin_key=admin_key)
    try:
        assert gw.proc is not None
        workers = gw.workers()
        assert len(workers) == 2
        for worker in workers:
            first = run_coro(first_request(gw, worker, key))
            assert first.status_code == 200, (worker.pid, first.status_code, first.text)
            assert first.json()["choices"][0]["message"]["content"]

        # The engine host stopped (SIGSTOP): it accepts no connection, so a new worker's connection
        # waits unanswered; one worker killed, and uvicorn starts another in its place.
        host = next(p for p in psutil.Process(gw.proc.pid).children(recursive=True) if "engines.backends.synthetic" in " ".join(p.cmdline()))
        sock = (gw.data_dir / f"engine-{gw.port}-0.sock").resolve()
        assert sock.is_socket(), sorted(gw.data_dir.iterdir())
        kept, killed = workers
        host.suspend()
        try:
            os.kill(killed.pid, signal.SIGKILL)
            fresh = gw.replacement(killed, [kept])

            async def hold_the_host(task: asyncio.Task[httpx.Response]) -> None:
                deadline = time.monotonic() + 120
                while not connecting_to(sock):  # a poll of the new worker's start: connected, unanswered
                    assert not task.done(), f"answered before the new worker connected to its engine host: {task.result().status_code}"
                    assert time.monotonic() < deadline, "the new worker never connected to its engine host"
                    await asyncio.sleep(0.05)
                await asyncio.wait([task], timeout=HOLD_S)  # see HOLD_S: ends early if the worker answered
                host.resume()

            answer = run_coro(first_request(gw, fresh, key, hold_the_host))
        finally:
            host.resume()
        assert answer.status_code == 200, (answer.status_code, answer.text)  # not 503 engine_not_ready
        assert answer.json()["choices"][0]["message"]["content"]
    finally:
        gw.stop()
