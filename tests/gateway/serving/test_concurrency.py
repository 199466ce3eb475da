"""Sixteen simultaneous streams complete with correct, distinct ledger rows."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import MODEL, Gateway


async def test_sixteen_concurrent_streams(gateway: Gateway, client_for: Any) -> None:
    keys = [await gateway.new_key() for _ in range(4)]

    async def one(i: int) -> tuple[str, dict[str, Any], int, int, str]:
        key = keys[i % 4]
        client = client_for(key["key"])
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Give me fact number {i} about the moon."}],
            max_tokens=16 + i,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
        )
        rid, usage, text = "", None, []
        async for chunk in stream:
            rid = chunk.id.split("-", 1)[1]
            if chunk.usage:
                usage = chunk.usage
            elif chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
        assert usage is not None
        return rid, key, usage.prompt_tokens, usage.completion_tokens, "".join(text)

    results = await asyncio.gather(*[one(i) for i in range(16)])
    request_ids = [r[0] for r in results]
    assert len(set(request_ids)) == 16
    for i, (rid, key, prompt_tokens, completion_tokens, _text) in enumerate(results):
        row = await gateway.ledger_row(rid)
        assert row["status"] == "completed"
        assert row["key_id"] == key["id"] and row["account_id"] == key["account_id"]
        assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt_tokens, completion_tokens)
        assert (row["prompt_tokens"], row["completion_tokens"]) == await gateway.produced.counts(rid)  # each stream's own engine ids
        assert 1 <= completion_tokens <= 16 + i
    for key in keys:
        assert await gateway.ledger_count(key_id=key["id"]) == 4
    assert gateway.engine.requests_in_flight() == 0
