"""The Batch API (docs/batches.md) against a real gateway on Postgres with the embedded model, driven
by the official openai and anthropic SDKs: files, batches, their lines' ledger rows at the batch
price, cancel, expiry, and another account's view (404)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from billing.db import create_engine
from tests.conftest import MODEL, Gateway, start_gateway, stop_server, until

PRICE = {"input_per_million": "2.000", "output_per_million": "4.000",
         "batch_input_per_million": "1.000", "batch_output_per_million": "2.000"}
NANOS_IN, NANOS_OUT = 1000, 2000  # the batch price per token, in nano-USD


@pytest.fixture(scope="module")
def batch_gateway(engine: Any, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    server, gw = start_gateway(fresh_pg_database(), engine, tmp_path_factory.mktemp("gw-batches"),
                               batches={"poll_seconds": 0.2, "concurrency": 4})
    try:
        yield gw
    finally:
        stop_server(server)


def openai_client(gw: Gateway, key: str) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=gw.v1, api_key=key, max_retries=0, timeout=60)


def chat_lines(n: int, *, max_tokens: int = 2, prefix: str = "req") -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Say the number {i}."}], "max_tokens": max_tokens, "temperature": 0},
    }).encode() + b"\n" for i in range(n))


async def priced(gw: Gateway) -> None:
    async with gw.admin_client() as c:
        r = await c.get("/admin/prices", params={"model": MODEL})
        if not r.json()["data"]:
            r = await c.post("/admin/prices", json={"model": MODEL, **PRICE})
            assert r.status_code == 201, r.text


async def rows_of(gw: Gateway, batch_id: str) -> list[dict[str, Any]]:
    await gw.flush_ledger()
    db = create_engine(gw.db_url)
    try:
        async with db.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT * FROM ledger_entries WHERE batch_id = :b"), {"b": batch_id})).mappings().all()
        return [dict(r) for r in rows]
    finally:
        await db.dispose()


async def ended(client: Any, batch_id: str, timeout: float = 240.0) -> Any:
    got: dict[str, Any] = {}

    async def done() -> bool:
        got["b"] = await client.batches.retrieve(batch_id)
        return got["b"].status in ("completed", "failed", "expired", "cancelled")

    await until(done, f"batch {batch_id} ended", timeout=timeout, every=0.25)
    return got["b"]


async def test_fifty_line_batch_completes_at_the_batch_price(batch_gateway: Gateway) -> None:
    gw = batch_gateway
    await priced(gw)
    key = (await gw.new_key())["key"]
    client = openai_client(gw, key)
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(50))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                                        metadata={"job": "fifty"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 50
    batch = await ended(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 50 and batch.request_counts.failed == 0
    assert batch.error_file_id is None and batch.metadata == {"job": "fifty"}
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(batch, stamp) is not None, stamp
    output = (await client.files.content(batch.output_file_id)).content
    lines = [json.loads(x) for x in output.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(f"req-{i}" for i in range(50))
    rows = await rows_of(gw, batch.id)
    assert len(rows) == 50 and len({r["request_id"] for r in rows}) == 50
    by_request = {r["request_id"]: r for r in rows}
    for x in lines:
        response = x["response"]
        assert response["status_code"] == 200 and x["error"] is None
        assert response["body"]["object"] == "chat.completion"
        row = by_request[response["request_id"]]
        assert response["body"]["usage"]["completion_tokens"] == row["completion_tokens"]
    for r in rows:
        assert r["api"] == "batch" and r["status"] == "completed"
        assert r["cost_nanos"] == r["prompt_tokens"] * NANOS_IN + r["completion_tokens"] * NANOS_OUT, r
