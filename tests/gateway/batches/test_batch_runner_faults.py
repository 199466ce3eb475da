"""The batch runner under faults (docs/batches.md), through the real runner on Postgres with the
embedded model: a line whose run raises or whose answer cannot be stored is never left claimed
(the batch ends with every line in its results, one ledger row per admitted line), and a runner
waiting on its lines keeps its lease, so a second runner cannot take the batch meanwhile."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from billing.batches.store import BatchStore, LeaseHeld
from billing.db import create_engine
from tests.conftest import Gateway, MODEL, on_server_loop, start_gateway, stop_server, until
from tests.gateway.batches.test_batches import chat_lines, ended, openai_client, rows_of

LEASE = 3.0  # seconds: the waits below last several of them (renewed every second: slack for a busy machine)
CONCURRENCY = 2


@pytest.fixture(scope="module")
def fault_gateway(engine: Any, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    server, gw = start_gateway(fresh_pg_database(migrated=True), engine, tmp_path_factory.mktemp("gw-batch-faults"),
                               batches={"poll_seconds": 0.2, "concurrency": CONCURRENCY, "lease_seconds": LEASE})
    try:
        yield gw
    finally:
        stop_server(server)


async def line_states(gw: Gateway, batch_id: str) -> dict[str, int]:
    db = create_engine(gw.db_url)
    try:
        async with db.connect() as conn:
            return dict((await conn.execute(sa.text("SELECT state, count(*) FROM batch_lines WHERE batch_id = :b GROUP BY state"),
                                            {"b": batch_id})).all())
    finally:
        await db.dispose()


def server_loop(gw: Gateway) -> asyncio.AbstractEventLoop:
    return gw.app.state.ledger._task.get_loop()  # type: ignore[no-any-return]


async def test_a_line_whose_answer_could_not_be_stored_is_stored_again(fault_gateway: Gateway) -> None:
    gw = fault_gateway
    store = gw.app.state.batch_runner._store
    real_finish = store.finish
    failed: list[str] = []

    async def finish_fails_once(line: Any, *end: Any) -> bool:  # a brief database error, once
        if not failed:
            failed.append(line.request_id)
            raise ConnectionResetError("the database connection dropped")
        return await real_finish(line, *end)

    client = openai_client(gw, (await gw.new_key())["key"])
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(4))), purpose="batch")
    store.finish = finish_fails_once
    try:
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        batch = await ended(client, batch.id, timeout=120)
    finally:
        del store.finish  # the store's own method again
    assert len(failed) == 1 and failed[0].startswith(f"{batch.id}-"), failed  # the fault hit a line of this batch
    assert await line_states(gw, batch.id) == {"done": 4}
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (4, 0), batch
    output = {x["response"]["request_id"]: x for x in map(json.loads, (await client.files.content(batch.output_file_id)).content.splitlines())}
    assert sorted(x["custom_id"] for x in output.values()) == [f"req-{i}" for i in range(4)]
    assert output[failed[0]]["response"]["status_code"] == 200  # the line whose finish failed: its real answer, stored again
    rows = await rows_of(gw, batch.id)
    assert sorted(r["request_id"] for r in rows) == sorted(f"{batch.id}-{i}" for i in range(4))  # one row each, none ran twice


async def test_a_line_whose_response_raises_ends_as_an_error_and_is_not_run_again(fault_gateway: Gateway) -> None:
    from anthropic import AsyncAnthropic

    gw = fault_gateway
    runner = gw.app.state.batch_runner
    real = runner._endpoints["/v1/messages"]
    calls: list[str] = []

    async def endpoint(request: Any) -> Any:
        response = await real(request)  # admitted: the line has its ledger row
        calls.append(request.scope["state"]["request_id"])
        if len(calls) > 1:
            return response

        async def breaking(scope: Any, receive: Any, send: Any) -> None:  # the answer's send fails midway
            async def send_fails(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.body":
                    raise RuntimeError("the answer could not be sent")
                await send(message)

            await response(scope, receive, send_fails)

        return breaking

    client = AsyncAnthropic(base_url=gw.base_url, api_key=(await gw.new_key())["key"], max_retries=0, timeout=60)
    requests = [{"custom_id": f"m-{i}", "params": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"Hi {i}"}]}}
                for i in range(3)]
    runner._endpoints["/v1/messages"] = endpoint
    try:
        batch = await client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        got: dict[str, Any] = {}

        async def done() -> bool:
            got["b"] = await client.messages.batches.retrieve(batch.id)
            return bool(got["b"].processing_status == "ended")

        await until(done, "message batch ended", timeout=120, every=0.25)
    finally:
        runner._endpoints["/v1/messages"] = real
    counts = got["b"].request_counts
    assert (counts.processing, counts.succeeded, counts.errored) == (0, 2, 1), counts
    assert await line_states(gw, batch.id) == {"done": 3}
    broken = calls[0]
    results = {r.custom_id: r.result async for r in await client.messages.batches.results(batch.id)}
    assert sorted(results) == ["m-0", "m-1", "m-2"]
    errored = results[f"m-{broken.rsplit('-', 1)[1]}"]
    assert errored.type == "errored" and "failed while running this request" in errored.error.error.message, errored  # type: ignore[union-attr]
    assert sorted(calls) == sorted(f"{batch.id}-{i}" for i in range(3))  # each line ran once: the broken one not again
    rows = await rows_of(gw, batch.id)
    assert sorted(r["request_id"] for r in rows) == sorted(calls)  # one row per admitted line, the broken one's too


async def test_a_cancelled_batch_keeps_its_lease_while_it_waits_for_its_lines(fault_gateway: Gateway) -> None:
    gw = fault_gateway
    runner = gw.app.state.batch_runner
    loop = server_loop(gw)
    gate = asyncio.Event()  # waited on on the server's loop, set from here through call_soon_threadsafe
    entered: list[str] = []
    real = runner._dispatch

    async def held(path: str, body: str, line: Any) -> Any:  # lines in flight until the test lets them go
        entered.append(line.request_id)
        await gate.wait()
        return await real(path, body, line)

    client = openai_client(gw, (await gw.new_key())["key"])
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(6))), purpose="batch")
    second_db = create_engine(gw.db_url)
    second = BatchStore(second_db)  # another runner, on its own connections
    taken: list[str | None] = []
    runner._dispatch = held
    try:
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        await until(lambda: len(entered) == CONCURRENCY, "the lines in flight", timeout=30)
        assert (await client.batches.cancel(batch.id)).status == "cancelling"
        # The runner now waits for its lines in flight, longer than its lease: all along the
        # batch stays its own (a second runner is refused), as the renewed lease row says.
        started = time.monotonic()

        async def taken_or_waited() -> bool:
            try:
                taken.append(await second.lease(batch.id, "second-runner", LEASE))
                return True
            except LeaseHeld:
                return time.monotonic() - started > 3 * LEASE

        await until(taken_or_waited, "the second runner tried for three leases", timeout=10 * LEASE, every=0.1)
        assert not taken, "the lease lapsed while the runner waited for its lines: a second runner took the batch"
        assert batch.id in runner._jobs  # still driven, by this runner
    finally:
        loop.call_soon_threadsafe(gate.set)
        del runner._dispatch
        await second_db.dispose()
    batch = await ended(client, batch.id, timeout=120)
    assert batch.status == "cancelled", batch
    # those in flight finished; the rest never ran: in the error file, but not `failed` (as at OpenAI)
    assert (batch.request_counts.completed, batch.request_counts.failed, batch.request_counts.total) == (CONCURRENCY, 0, 6), batch
    errors = [json.loads(x) for x in (await client.files.content(batch.error_file_id)).content.splitlines()]
    assert sorted(e["error"]["code"] for e in errors) == ["batch_cancelled"] * (6 - CONCURRENCY)  # the rest never ran
    assert await line_states(gw, batch.id) == {"done": 6}
    assert sorted(r["request_id"] for r in await rows_of(gw, batch.id)) == sorted(entered)  # those in flight ran, once


class HeldSlots:
    """Every run slot of the server's batch runner taken, in the server's loop, until `release()`:
    as lines of other batches would hold them. One limit serves every batch of a process, so a
    line claimed meanwhile waits for a slot."""

    def __init__(self, gw: Gateway) -> None:
        self.app, self.loop, self.slots = gw.app, server_loop(gw), gw.app.state.batch_runner._slots
        self.released = False

    async def __aenter__(self) -> "HeldSlots":
        async def take() -> None:
            for _ in range(CONCURRENCY):
                await self.slots.acquire()

        await asyncio.wait_for(on_server_loop(self.app, take()), 60)
        return self

    def release(self) -> None:
        if not self.released:
            self.released = True
            for _ in range(CONCURRENCY):
                self.loop.call_soon_threadsafe(self.slots.release)

    async def __aexit__(self, *exc: Any) -> None:
        self.release()


@pytest.mark.parametrize("change", ["cancelled", "window over", "key revoked", "server draining"])
async def test_a_line_that_waited_for_a_slot_does_not_start_once_its_batch_should_not_run(fault_gateway: Gateway, change: str) -> None:
    """Lines claimed while every slot was busy wait for one; by then their batch may be cancelled, past
    its window, its key revoked, the server draining. Such a line does not start (no row, nothing billed): it is
    pending again, and ends as its batch does (batch_cancelled, batch_expired; the key's 401) or runs after the drain."""
    gw = fault_gateway
    key = await gw.new_key()
    client = openai_client(gw, key["key"])
    reader = openai_client(gw, (await gw.new_key(key["account_id"]))["key"])  # the account's other key reads the batch
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(4))), purpose="batch")
    runner = gw.app.state.batch_runner
    async with HeldSlots(gw) as held:
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        await until(lambda: _claimed(gw, batch.id), f"{CONCURRENCY} lines claimed, waiting for a slot", timeout=60)
        if change == "cancelled":
            await client.batches.cancel(batch.id)
        elif change == "window over":
            db = create_engine(gw.db_url)
            try:
                async with db.begin() as conn:
                    await conn.execute(sa.text("UPDATE batches SET expires_at = now() - interval '1 second' WHERE id = :b"), {"b": batch.id})
            finally:
                await db.dispose()
        elif change == "key revoked":
            async with gw.admin_client() as admin:
                assert (await admin.delete(f"/admin/keys/{key['id']}")).status_code == 200
        else:
            gw.app.draining = True  # what SIGTERM sets (gateway/http/drain.py)
        held.release()
        if change == "server draining":
            try:
                await until(lambda: batch.id not in runner._jobs, "the runner let the batch go", timeout=60)
                assert await rows_of(gw, batch.id) == [] and (await line_states(gw, batch.id)).get("pending") == 4
            finally:
                gw.app.draining = False
            runner.wake()
            assert (await ended(client, batch.id, timeout=120)).status == "completed"
            assert len(await rows_of(gw, batch.id)) == 4
            return
    done = await ended(reader, batch.id, timeout=120)
    assert await rows_of(gw, batch.id) == []  # none ran
    errors = [json.loads(x) for x in (await reader.files.content(done.error_file_id)).content.splitlines()]
    codes = {e["custom_id"]: (e["error"] or e["response"]["body"]["error"])["code"] for e in errors}
    if change == "cancelled":
        assert done.status == "cancelled" and set(codes.values()) == {"batch_cancelled"} and len(codes) == 4, codes
    elif change == "window over":
        assert done.status == "expired" and set(codes.values()) == {"batch_expired"} and len(codes) == 4, codes
    else:
        assert done.status == "completed" and set(codes.values()) == {"key_revoked"} and len(codes) == 4, codes


async def _claimed(gw: Gateway, batch_id: str) -> bool:
    return (await line_states(gw, batch_id)).get("claimed", 0) == CONCURRENCY
