"""A client that leaves mid-stream cancels its engine request and still gets its ledger row."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL, Gateway

LONG = [{"role": "user", "content": "Write a very long story about a lighthouse keeper and the sea."}]


async def wait_engine_idle(gateway: Gateway, within: float) -> float:
    started = time.monotonic()
    while gateway.engine.requests_in_flight() > 0:
        if time.monotonic() - started > within:
            raise AssertionError(f"engine still holds {gateway.engine.requests_in_flight()} requests after {within}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_disconnect_after_three_chunks_records_cancelled_row(gateway: Gateway, customer: dict[str, Any]) -> None:
    max_tokens = 200
    body = {"model": MODEL, "messages": LONG, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {customer['key']}"}, timeout=60) as c:
        async with c.stream("POST", "/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            request_id = resp.headers["x-request-id"]
            content_chunks = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    content_chunks += 1
                    if content_chunks == 3:
                        break
        # leaving the `stream` block closes the connection mid-generation
    freed_after = await wait_engine_idle(gateway, within=2.0)
    assert freed_after <= 2.0
    row = await gateway.ledger_row(request_id)
    assert row["status"] == "cancelled"
    assert row["finish_reason"] == "cancelled"
    assert 3 <= row["completion_tokens"] < max_tokens
    assert row["prompt_tokens"] > 0


@pytest.mark.parametrize("padding", [0, 300_000], ids=["small-body", "large-body"])
async def test_disconnect_of_non_streaming_request_is_cancelled(gateway: Gateway, customer: dict[str, Any], padding: int) -> None:
    # A body past uvicorn's 64 KiB high-water mark pauses reading while it arrives; reading resumes
    # once the request is whole, so the client leaving is still seen while the engine runs.
    body = {"model": MODEL, "messages": LONG, "max_tokens": 400, "temperature": 0, **({"user": "u" * padding} if padding else {})}
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {customer['key']}"}, timeout=0.8) as c:
        try:
            await c.post("/chat/completions", json=body)
            raise AssertionError("expected the client to time out")
        except httpx.ReadTimeout:
            pass
    await wait_engine_idle(gateway, within=2.0)
    rows_deadline = time.monotonic() + 5
    while await gateway.ledger_count(key_id=customer["id"], status="cancelled") != 1:
        assert time.monotonic() < rows_deadline, "no cancelled row for the abandoned request"
        await asyncio.sleep(0.05)


async def test_server_keeps_serving_after_disconnects(gateway: Gateway, customer: dict[str, Any], client_for: Any) -> None:
    body = {"model": MODEL, "messages": LONG, "max_tokens": 100, "stream": True}
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {customer['key']}"}, timeout=60) as c:
        for _ in range(4):
            async with c.stream("POST", "/chat/completions", json=body) as resp:
                async for _line in resp.aiter_lines():
                    break
    await wait_engine_idle(gateway, within=2.0)
    resp = await client_for(customer["key"]).chat.completions.create(model=MODEL, messages=LONG, max_tokens=3)
    assert resp.usage.completion_tokens == 3
