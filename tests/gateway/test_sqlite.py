"""Smoke run of the embedded default: the same gateway on a SQLite file."""

from __future__ import annotations

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
