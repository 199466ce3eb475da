"""Fair scheduling and admission control with the real model (issue 9).

The shared hf engine sits behind a recording wrapper, so a test can tell which requests the
engine ever received; the gateway's scheduler lets `scheduler_capacity` of them in at once.
Figures are printed (run with -s to see them).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa

from billing.db import create_engine
from engines.base import Engine, EngineOutput, EngineRequest
from engines.wrappers.scheduler import ScheduledEngine
from tests.conftest import MODEL, Gateway, run_coro, start_gateway

pytestmark = pytest.mark.solo  # TTFTs beside a flood and queue waits compared against bounds: alone on the machine (tests/conftest.py)


class Recording(Engine):
    """The real engine, noting every request id that reaches it."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.seen: list[str] = []
        self.model_id = inner.model_id
        self.context_length = inner.context_length
        self.vocab_size = inner.vocab_size

    @property
    def ready(self) -> bool:
        return self.inner.ready

    async def start(self) -> None:
        return None  # the session's engine is started and stopped by its fixture

    async def stop(self) -> None:
        return None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.inner.encode_chat(messages)

    def encode_text(self, prompt: str) -> list[int]:
        return self.inner.encode_text(prompt)

    def has_capacity(self) -> bool:
        return self.inner.has_capacity()

    def slots(self) -> int | None:
        return self.inner.slots()

    def requests_in_flight(self) -> int:
        return self.inner.requests_in_flight()

    def cancel(self, request_id: str) -> None:
        self.inner.cancel(request_id)

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.seen.append(request.request_id)
        async with aclosing(self.inner.stream(request)) as outputs:  # type: ignore[type-var]
            async for out in outputs:
                yield out


@dataclass
class Timed:
    """One streamed request as its client saw it."""

    status: int = 0
    request_id: str = ""
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    headers: dict[str, str] = field(default_factory=dict)
    answered: float = 0.0  # status line received
    error: dict[str, Any] = field(default_factory=dict)  # the error body of a refusal

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent


def auth(key: dict[str, Any]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key['key']}"}


def body(max_tokens: int, text: str = "Tell me a fact about the sea.") -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, "stream": True}


async def timed_stream(client: httpx.AsyncClient, key: dict[str, Any], payload: dict[str, Any], out: Timed | None = None) -> Timed:
    """Streams one request, noting when each content chunk arrives. Pass `out` to keep what was
    seen when the task is cancelled (the client leaving)."""
    t = out if out is not None else Timed()
    t.sent = time.perf_counter()
    async with client.stream("POST", "/chat/completions", json=payload, headers=auth(key)) as resp:
        t.status, t.answered = resp.status_code, time.perf_counter()
        t.request_id = resp.headers.get("x-request-id", "")
        t.headers = dict(resp.headers)
        if resp.status_code != 200:
            t.error = orjson.loads(await resp.aread()).get("error") or {}
            return t
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = orjson.loads(line[6:]).get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                t.token_times.append(time.perf_counter())
    return t


def client_of(gw: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gw.v1, timeout=600, limits=httpx.Limits(max_connections=300, max_keepalive_connections=300))


def scheduler_of(gw: Gateway) -> ScheduledEngine:
    engine = gw.app.state.service.engines[MODEL]
    assert isinstance(engine, ScheduledEngine)
    return engine


async def wait_for(predicate: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def rate(times: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in times) / (end - start)


def queue_waits(sched: ScheduledEngine) -> dict[str, float]:
    """Request id -> seconds it waited in the gateway's queue, from the scheduler's own events
    (they fire in the server's thread; the dict is only read after the requests are done)."""
    waits: dict[str, float] = {}
    sched.listeners.append(lambda e: waits.__setitem__(e.request_id, e.wait_s) if e.kind == "dispatched" else None)
    return waits


def stalls(runs: list[Timed], start: float, end: float) -> float:
    """The longest pause between two tokens of one stream in [start, end], in median steps: the
    shared 2-core machine stalls the engine for seconds when other jobs oversubscribe its cores."""
    gaps = [t2 - t1 for r in runs for t1, t2 in zip(r.token_times, r.token_times[1:]) if start <= t1 and t2 <= end]
    return max(gaps) / statistics.median(gaps) if gaps else 0.0


def xfail_if_unsteady(what: str, groups: list[list[float]], stall: float) -> None:
    """Timing comparisons mean nothing while the machine stalls: the test then ends as an xfail
    naming why (listed in the run's summary), never as a pass or a silent skip; the order checks
    above it still ran and passed. In strict mode (CI) the xfail is a failure (tests/conftest.py).
    `groups`: TTFTs measured alike (idle ones; ones beside the same load), each of which should
    agree within 3x; TTFTs of different groups differ by design (beside A's three requests costs
    B about 2x idle), so they are never compared with each other here."""
    spread = max(max(g) / min(g) for g in groups if g)
    if spread > 3 or stall > 8:
        pytest.xfail(f"timing not compared, machine too loaded ({what}): TTFTs {[[round(t * 1000) for t in g] for g in groups]} ms "
                     f"(spread x{spread:.1f} within a group), longest token gap {stall:.0f} steps")


async def warm_up(engine: Engine, largest: int) -> None:
    """Runs every batch size up to `largest` once: on CPU the first batch of a new size is slow."""

    async def one(i: int, n: int) -> None:
        request = EngineRequest(request_id=f"warm-{uuid.uuid4().hex}", max_tokens=4, prompt_token_ids=engine.encode_text(f"Warm up {i}."))
        async for _ in engine.stream(request):
            pass

    for n in range(1, largest + 1):
        await asyncio.gather(*(one(i, n) for i in range(n)))


@pytest.fixture(scope="module")
def recording(engine: Engine) -> Recording:
    run_coro(warm_up(engine, 6))
    return Recording(engine)


@pytest.fixture(scope="module")
def four_slots(recording: Recording, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The hf engine at capacity 4, one slot of it held for a light account; waits of up to 10
    minutes are accepted, so that a flood queues rather than being refused."""
    server, gw = start_gateway(
        fresh_pg_database(migrated=True), recording, tmp_path_factory.mktemp("sched4"),  # type: ignore[arg-type]
        scheduler={"capacity": 4, "reserve": 1, "classes": "interactive:600,batch:3600"},
    )
    try:
        yield gw
    finally:
        server.__exit__()


async def sequential_ttfts(client: httpx.AsyncClient, key: dict[str, Any], n: int, max_tokens: int) -> tuple[list[Timed], float, float]:
    started = time.perf_counter()
    runs = [await timed_stream(client, key, body(max_tokens, f"Tell me fact number {i} about the moon.")) for i in range(n)]
    assert all(r.status == 200 and r.token_times for r in runs)
    return runs, started, time.perf_counter()


async def test_a_flooding_account_does_not_hold_up_a_light_one(four_slots: Gateway, recording: Recording) -> None:
    """B's time to first token: on the idle engine; beside three of A's requests with nothing
    queued (what the engine itself costs B when it batches it with A's: no queue policy changes
    that); and with 97 more of A's requests queued. The queue must cost B next to nothing."""
    gw, sched = four_slots, scheduler_of(four_slots)
    waits = queue_waits(sched)
    a, b = await gw.new_key(), await gw.new_key()
    async with client_of(gw) as ca, client_of(gw) as cb:
        await sequential_ttfts(cb, b, 1, 8)  # warms b's key and quota scopes
        idle_before, _, _ = await sequential_ttfts(cb, b, 3, 8)
        seen_before = len(recording.seen)
        flood = [Timed() for _ in range(100)]
        tasks = [asyncio.create_task(timed_stream(ca, a, body(64, f"Story {i}."), flood[i])) for i in range(3)]
        try:
            await wait_for(lambda: all(f.token_times for f in flood[:3]), 30, "a's first three requests to run")
            beside, _, _ = await sequential_ttfts(cb, b, 3, 8)
            tasks += [asyncio.create_task(timed_stream(ca, a, body(32, f"Fact {i} about the sea."), flood[i])) for i in range(3, 100)]
            arrived = lambda: sched.queue_depth() + len(recording.seen) - seen_before  # noqa: E731
            await wait_for(lambda: arrived() >= 100, 60, "a's 100 requests to arrive")
            before_start = time.perf_counter()
            await asyncio.sleep(3.0)
            waiting_when_b_came = sched.queue_depth()
            loaded, b_start, b_end = await sequential_ttfts(cb, b, 5, 8)
            waiting_when_b_left = sched.queue_depth()
        finally:
            await cancel_all(tasks)
        await wait_for(lambda: sched.snapshot()["running"] == 0, 30, "the engine to be idle again")
        idle_after, _, _ = await sequential_ttfts(cb, b, 3, 8)  # the same idle figure after, against drift in machine load
    a_times = [t for f in flood for t in f.token_times]
    a_before, a_during = rate(a_times, before_start, b_start), rate(a_times, b_start, b_end)
    b_tokens = sum(len(r.token_times) for r in loaded)
    b_share = b_tokens / (b_tokens + sum(b_start <= t < b_end for t in a_times))
    idle_ttft = statistics.median(r.ttft for r in idle_before + idle_after)
    beside_ttft = statistics.median(r.ttft for r in beside)
    loaded_ttft = statistics.median(r.ttft for r in loaded)
    print(
        f"\nb TTFT median: idle {idle_ttft * 1000:.0f} ms {[round(r.ttft * 1000) for r in idle_before + idle_after]}; "
        f"beside 3 of a's, none queued {beside_ttft * 1000:.0f} ms (x{beside_ttft / idle_ttft:.2f}); "
        f"under a's flood of 100 {loaded_ttft * 1000:.0f} ms {[round(r.ttft * 1000) for r in loaded]} (x{loaded_ttft / idle_ttft:.2f}); "
        f"a's requests waiting {waiting_when_b_came} -> {waiting_when_b_left}\n"
        f"a's tokens/s: {a_before:.1f} before b, {a_during:.1f} while b was served ({(a_during / a_before - 1) * 100:+.0f}%); "
        f"b's share of the tokens then {b_share * 100:.0f}%"
    )
    assert waiting_when_b_left >= 50  # b was served while a's flood still queued
    assert all(waits[r.request_id] < 0.01 for r in loaded)  # b never waited for a slot: the reserve
    assert all(waits[f.request_id] > 1.0 for f in flood[3:] if f.request_id in waits)  # a's did
    xfail_if_unsteady("flood", [[r.ttft for r in idle_before + idle_after], [r.ttft for r in beside]], stalls(flood, b_start, b_end))
    # The queue never makes B wait (0 ms, checked above; one turn of A's requests would be 32 engine
    # steps, ~10x the idle TTFT). Under the flood A's slots refill as its requests end, and each
    # refill's prefill is a heavy step B's first token shares: on this 2-core CPU that puts B at up
    # to ~1.5x `beside` (394 vs 259 ms; docs/scheduling.md). README quotes the same bound.
    assert loaded_ttft <= 1.6 * beside_ttft
    # The figure: within 2x of idle. On this CPU the engine alone costs about 2x (batch of 4
    # against batch of 1: `beside`), so the bound allows the engine's own cost on top of it.
    assert loaded_ttft <= max(2.0, 1.6 * beside_ttft / idle_ttft) * idle_ttft
    # A keeps running while B is served (its three slots stay its own). It loses more than B's share
    # of the tokens: B's prefills and the batch of four cost every request steps, and B's streams
    # cost the same two cores; measured here -36% to -52% with B's share at 24-27%.
    assert a_during >= 0.35 * a_before


def steps_of(runs: list[Timed], start: float = 0.0, end: float = float("inf")) -> float:
    """The median time between two tokens of the same stream: one engine step."""
    return statistics.median(t2 - t1 for r in runs for t1, t2 in zip(r.token_times, r.token_times[1:]) if start <= t1 and t2 <= end)


async def test_batch_never_holds_up_a_later_interactive_request(four_slots: Gateway) -> None:
    gw, sched = four_slots, scheduler_of(four_slots)
    waits = queue_waits(sched)
    x, y = await gw.new_key(), await gw.new_key()
    async with gw.admin_client() as admin:
        r = await admin.patch(f"/admin/accounts/{x['account_id']}", json={"priority": "batch"})
        assert r.status_code == 200 and r.json()["priority"] == "batch"
    async with client_of(gw) as cx, client_of(gw) as cy:
        await sequential_ttfts(cy, y, 1, 6)
        idle, _, _ = await sequential_ttfts(cy, y, 3, 6)
        batch = [Timed() for _ in range(9)]
        tasks = [asyncio.create_task(timed_stream(cx, x, body(64, f"Write a long story number {i}."), batch[i])) for i in range(9)]
        try:
            await wait_for(lambda: sum(len(t.token_times) >= 2 for t in batch) >= 3, 60, "batch requests running")
            assert sched.snapshot()["waiting"]["batch"] == 6  # 3 run: batch never takes the reserved slot
            loaded, waiting = [], []
            for i in range(3):
                waiting.append(sched.snapshot()["waiting"]["batch"])
                loaded.append(await timed_stream(cy, y, body(6, f"Name fruit number {i}.")))
        finally:
            await cancel_all(tasks)
    # In engine steps, so that a change in the machine's load between the two figures cancels out.
    idle_step, loaded_step = steps_of(idle), steps_of(batch, loaded[0].sent, loaded[-1].token_times[-1])
    idle_steps = statistics.median(r.ttft for r in idle) / idle_step
    delays = [r.ttft / loaded_step - idle_steps for r in loaded]
    print(
        f"\ny TTFT (ms): idle {[round(r.ttft * 1000) for r in idle]} (step {idle_step * 1000:.0f} ms), "
        f"behind batch {[round(r.ttft * 1000) for r in loaded]} (step {loaded_step * 1000:.0f} ms); "
        f"delay in engine steps {[round(d, 1) for d in delays]} with {waiting} batch requests waiting"
    )
    for run, behind in zip(loaded, waiting):
        assert run.status == 200 and behind >= 5
        assert waits[run.request_id] < 0.01  # into the engine at once, ahead of every waiting batch request
    xfail_if_unsteady("batch", [[r.ttft for r in idle]], stalls(batch, loaded[0].sent, loaded[-1].token_times[-1]))
    for behind, delay in zip(waiting, delays):
        assert delay <= behind, f"delayed {delay:.1f} engine steps behind {behind} waiting batch requests"


@pytest.fixture
def two_slots(recording: Recording, fresh_pg_database: Any, tmp_path: Path) -> Iterator[Gateway]:
    """Capacity 2, one slot reserved; an interactive request may expect to wait 1.5 s at most."""
    server, gw = start_gateway(
        fresh_pg_database(migrated=True), recording, tmp_path,  # type: ignore[arg-type]
        scheduler={"capacity": 2, "reserve": 1, "classes": "interactive:1.5,batch:600", "max_queue": 20},
    )
    try:
        yield gw
    finally:
        server.__exit__()


async def test_queue_limits_refuse_at_once_with_retry_after(two_slots: Gateway, recording: Recording) -> None:
    gw, sched = two_slots, scheduler_of(two_slots)
    a, b = await gw.new_key(), await gw.new_key()
    async with client_of(gw) as ca, client_of(gw) as cb:
        await timed_stream(ca, a, body(16))  # the scheduler learns how long a request holds a slot
        assert sched.hold_s is not None and sched.hold_s > 0.3
        burst = await asyncio.gather(*[timed_stream(ca, a, body(16, f"Fact {i} about rain.")) for i in range(8)])
        refused = [r for r in burst if r.status != 200]
        served = [r for r in burst if r.status == 200]
        # a light account is still let in while a is being refused: the reserved slot
        light = await timed_stream(cb, b, body(4))
    slowest_refusal = max(r.answered - r.sent for r in refused)
    print(f"\nburst of 8 with hold {sched.hold_s:.2f}s: {len(served)} served, {len(refused)} refused, "
          f"slowest refusal {slowest_refusal * 1000:.0f} ms, Retry-After {sorted({r.headers['retry-after'] for r in refused})}")
    assert 1 <= len(served) <= 3 and len(refused) >= 5
    for r in refused:
        assert r.status == 429, r.error  # a's own queue is the wait
        assert r.error["code"] == "too_many_queued_requests"
        assert int(r.headers["retry-after"]) >= 1
        assert r.request_id not in recording.seen
    assert slowest_refusal < min(r.token_times[0] - r.sent for r in served[1:]) if len(served) > 1 else slowest_refusal < 1.0
    assert light.status == 200
    ids = await request_ids(gw, a["id"], 1 + len(served))
    assert len(ids) == 1 + len(served)  # a refusal leaves no row
    assert {r.request_id for r in served} <= set(ids)


@pytest.fixture
def one_slot(recording: Recording, fresh_pg_database: Any, tmp_path: Path) -> Iterator[Gateway]:
    server, gw = start_gateway(fresh_pg_database(migrated=True), recording, tmp_path, scheduler={"capacity": 1, "reserve": 0})  # type: ignore[arg-type]
    try:
        yield gw
    finally:
        server.__exit__()


async def test_abandoned_queued_requests_never_reach_the_engine(one_slot: Gateway, recording: Recording) -> None:
    gw, sched = one_slot, scheduler_of(one_slot)
    key = await gw.new_key()
    async with client_of(gw) as c:
        first = Timed()
        running = asyncio.create_task(timed_stream(c, key, body(40), first))
        await wait_for(lambda: bool(first.token_times), 30, "the first request to run")
        left = [Timed() for _ in range(3)]
        leaving = [asyncio.create_task(timed_stream(c, key, body(40, f"Story {i}."), left[i])) for i in range(3)]
        await wait_for(lambda: sched.queue_depth() == 3, 10, "three requests queued")
        await asyncio.sleep(0.3)
        await cancel_all(leaving)  # the clients leave while their requests wait
        await wait_for(lambda: sched.queue_depth() == 0, 5, "the queue to drop them")
        assert sched.snapshot()["running"] == 1  # the first is still generating
        done = await running
        after = await timed_stream(c, key, body(4))
    assert done.status == 200 and len(done.token_times) > 3 and after.status == 200
    ids = await request_ids(gw, key["id"], 5)
    assert len(ids) == 5
    reached = [rid for rid in ids if rid in recording.seen]
    assert len(reached) == 2  # the first and the one after; the three that waited never ran
    for rid in set(ids) - set(reached):
        row = await gw.ledger_row(rid)
        assert row["status"] == "cancelled" and (row["prompt_tokens"], row["completion_tokens"]) == (0, 0)  # never ran: nothing billed
        assert row["queue_ms"] >= 250  # they waited before leaving
    metrics = httpx.get(gw.base_url + "/metrics").text
    assert f'tollgate_queue_abandoned_total{{model="{MODEL}",priority="interactive"}} 3.0' in metrics


async def test_the_ledger_records_time_in_queue(one_slot: Gateway) -> None:
    gw = one_slot
    key = await gw.new_key()
    async with client_of(gw) as c:
        first, second = Timed(), Timed()
        a = asyncio.create_task(timed_stream(c, key, body(24), first))
        await wait_for(lambda: bool(first.token_times), 30, "the first request to run")
        b = asyncio.create_task(timed_stream(c, key, body(4), second))
        await asyncio.gather(a, b)
    waited = first.token_times[-1] - second.sent  # the second could only start once the first ended
    row_first, row_second = await gw.ledger_row(first.request_id), await gw.ledger_row(second.request_id)
    print(f"\nsecond request waited ~{waited * 1000:.0f} ms; ledger queue_ms {row_first['queue_ms']:.0f} / {row_second['queue_ms']:.0f}")
    assert row_second["queue_ms"] >= 0.8 * waited * 1000
    assert row_first["queue_ms"] < row_second["queue_ms"]
    assert row_second["ttft_ms"] >= row_second["queue_ms"]
    metrics = httpx.get(gw.base_url + "/metrics").text
    count_line = next(l for l in metrics.splitlines() if l.startswith(f'tollgate_queue_wait_seconds_count{{model="{MODEL}",priority="interactive"}}'))
    sum_line = next(l for l in metrics.splitlines() if l.startswith(f'tollgate_queue_wait_seconds_sum{{model="{MODEL}",priority="interactive"}}'))
    assert float(count_line.split()[-1]) >= 2 and float(sum_line.split()[-1]) >= 0.8 * waited


async def request_ids(gw: Gateway, key_id: int, expected: int) -> list[str]:
    """The key's ledger rows' request ids: once `expected` rows are there (rows of requests whose
    clients left are recorded when the server sees them go), then behind a flush of the ledger
    writer, so a row recorded by then but not expected is in the answer too, not missed by a race."""
    deadline = time.monotonic() + 10
    while await gw.ledger_count(key_id=key_id) < expected:
        assert time.monotonic() < deadline, "ledger rows missing"
        await asyncio.sleep(0.05)
    await gw.flush_ledger()
    db = create_engine(gw.db_url)
    try:
        async with db.connect() as conn:
            rows = await conn.execute(sa.text("SELECT request_id FROM ledger_entries WHERE key_id = :k ORDER BY id"), {"k": key_id})
            return [r[0] for r in rows]
    finally:
        await db.dispose()


async def test_admin_sets_and_clears_an_accounts_priority(four_slots: Gateway) -> None:
    account = await four_slots.new_account(f"plan-{uuid.uuid4().hex[:6]}")
    async with four_slots.admin_client() as admin:
        path = f"/admin/accounts/{account['id']}"
        assert account["priority"] is None
        r = await admin.patch(path, json={"priority": "express"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        r = await admin.patch(path, json={"priority": "batch", "limits": {"rpm": 5}})
        assert r.status_code == 200 and r.json()["priority"] == "batch" and r.json()["limits"]["rpm"] == 5
        r = await admin.patch(path, json={"limits": {"rpm": None}})
        assert r.json()["priority"] == "batch"  # untouched when not given
        r = await admin.patch(path, json={"priority": None})
        assert r.status_code == 200 and r.json()["priority"] is None
        assert (await admin.patch(path, json={})).status_code == 400
        assert (await admin.patch("/admin/accounts/999999", json={"priority": "batch"})).status_code == 404
