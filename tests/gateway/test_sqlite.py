"""Smoke run of the embedded default: the same gateway on a SQLite file."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any


from tests.conftest import MODEL, Gateway


async def test_sqlite_gateway_serves_and_meters(sqlite_gateway: Gateway, client_for: Any) -> None:
    key = await sqlite_gateway.new_key()
    client = client_for(key["key"], sqlite_gateway)
    resp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=10, temperature=0)
    stream = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    row = await sqlite_gateway.ledger_row(resp.id.split("-", 1)[1])
    assert row["status"] == "completed"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (resp.usage.prompt_tokens, resp.usage.completion_tokens)
    assert (row["prompt_tokens"], row["completion_tokens"]) == await sqlite_gateway.produced.counts(resp.id.split("-", 1)[1])
    row2 = await sqlite_gateway.ledger_row(chunks[0].id.split("-", 1)[1])
    assert row2["completion_tokens"] == chunks[-1].usage.completion_tokens == 5
    assert (row2["prompt_tokens"], row2["completion_tokens"]) == await sqlite_gateway.produced.counts(chunks[0].id.split("-", 1)[1])


async def test_a_time_with_an_offset_is_kept_as_that_instant(sqlite_gateway: Gateway) -> None:
    """SQLite keeps a time's clock reading and drops its offset: a key's expiry given at +09:00 is
    stored in UTC, so it ends at that instant, not nine hours later; one already past is refused."""
    account = await sqlite_gateway.new_account()
    async with sqlite_gateway.admin_client() as admin:
        r = await admin.post("/admin/keys", json={"account_id": account["id"], "expires_at": "2030-01-01T00:00:00+09:00"})
        assert r.status_code == 201, r.status_code
        key = r.json()
        assert key["expires_at"] == "2029-12-31T15:00:00+00:00"
        assert (await admin.get(f"/admin/keys/{key['id']}")).json()["expires_at"] == "2029-12-31T15:00:00+00:00"
        # an hour ago, written in a zone 14 hours ahead: already past, so refused (read as UTC it
        # would be 13 hours ahead, and taken)
        past = (datetime.now(timezone(timedelta(hours=14))) - timedelta(hours=1)).isoformat()
        r = await admin.post("/admin/keys", json={"account_id": account["id"], "expires_at": past})
        assert r.status_code == 400 and r.json()["error"]["param"] == "expires_at", r.text
