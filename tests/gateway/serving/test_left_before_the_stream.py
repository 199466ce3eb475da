"""A client that leaves between its request's admission and the start of its engine stream: its
row says `cancelled`, whatever the engine would have said of the request by then, and counts no
token (no engine had it: nothing billed, nothing against its quota).

The real gateway (its guarded protocol, scheduler, meter and ledger on Postgres) over a fake
engine whose capacity the test sets; the admission is held in its quota step (Meter._reserve, after
the scheduler's place is taken) until the gateway has seen the client's connection close."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy as sa

from billing.db import create_engine

from tests.conftest import until, start_gateway, stop_server
from tests.fakes.engine import FakeEngine

MODEL = "windowed"


class Windowed(FakeEngine):
    """`full`: the engine has no room (another model that shares it took it). `completes`: a one-body
    request goes through its complete() (CompletedResponse), as an engine that completes natively."""

    def __init__(self, model_id: str, completes: bool) -> None:
        super().__init__(model_id)
        self.full = False
        self.completes = completes

    def has_capacity(self) -> bool:
        return not self.full


def held_admissions(meter: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Admissions wait in their quota step, after the engine's place is taken, until `release`;
    `reached` says one is there."""
    reached, release = threading.Event(), threading.Event()
    reserve = meter._reserve

    async def held(*args: Any, **kwargs: Any) -> Any:
        reached.set()
        await asyncio.to_thread(release.wait, 30)
        return await reserve(*args, **kwargs)

    monkeypatch.setattr(meter, "_reserve", held)
    return reached, release


async def statuses(gw: Any, key_id: int) -> list[tuple[str, str | None, int, int]]:
    """(status, finish_reason, prompt tokens, completion tokens) of the key's ledger rows."""
    db = create_engine(gw.db_url)
    try:
        async with db.connect() as conn:
            rows = await conn.execute(sa.text("SELECT status, finish_reason, prompt_tokens, completion_tokens FROM ledger_entries WHERE key_id = :k"), {"k": key_id})
            return [tuple(r) for r in rows]
    finally:
        await db.dispose()


@pytest.mark.parametrize(("stream", "completes"), [(True, False), (False, False), (False, True)],
                         ids=["stream", "one-body", "one-body-complete"])
async def test_a_client_gone_before_its_stream_starts_is_cancelled_not_an_engine_error(
    fresh_pg_database: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool,
    completes: bool,
) -> None:
    """Admitted (the scheduler holds its place), the client leaves while the admission finishes,
    and meanwhile the engine fills up from elsewhere. The response sees the client gone at once and
    cancels the request; the engine never sees it. Before, that cancel dropped the scheduler's place, so the stream that came
    next was admitted afresh, refused (engine at capacity), and its row said `error`; a request whose
    client stayed kept its place and ran."""
    engine = Windowed(MODEL, completes)
    server, gw = start_gateway(fresh_pg_database(migrated=True), engine, tmp_path)  # type: ignore[arg-type]
    try:
        key = await gw.new_key()
        reached, release = held_admissions(gw.app.state.service.meter, monkeypatch)
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream})
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {key['key']}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        await writer.drain()
        assert await asyncio.to_thread(reached.wait, 10), "the request never reached its admission's quota step"
        writer.close()
        await writer.wait_closed()
        await until(lambda: not server.server.server_state.connections, "the gateway saw the client's connection close")
        engine.full = True
        release.set()
        await until(lambda: gw.ledger_count(key_id=key["id"]), "the request's row")
        await gw.flush_ledger()
        assert await statuses(gw, key["id"]) == [("cancelled", "cancelled", 0, 0)]  # no engine had it: no token used, none billed
        assert engine.requests_in_flight() == 0
    finally:
        release.set()
        stop_server(server)
