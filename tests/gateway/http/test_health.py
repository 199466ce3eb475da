from __future__ import annotations

import httpx

from tests.conftest import Gateway


async def test_healthz_and_readyz(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url) as c:
        assert (await c.get("/healthz")).json() == {"status": "ok"}
        ready = await c.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["status"] == "ready"
        assert ready.json()["quota_store"] == "in-process"  # this gateway has no REDIS_URL

