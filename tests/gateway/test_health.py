from __future__ import annotations

import httpx

from tests.conftest import Gateway


async def test_healthz_and_readyz(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url) as c:
        assert (await c.get("/healthz")).json() == {"status": "ok"}
        ready = await c.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["status"] == "ready"


async def test_readyz_waits_for_embedding_models_too() -> None:
    import asyncio
    from types import SimpleNamespace

    from starlette.requests import Request

    from gateway.app import readyz

    loading = asyncio.get_running_loop().create_future()
    state = SimpleNamespace(service=SimpleNamespace(engines={}), embeddings=SimpleNamespace(models={"minilm": object()}),
                            embeddings_loading=loading)
    request = Request({"type": "http", "app": SimpleNamespace(state=state), "headers": []})
    waiting = await readyz(request)
    assert waiting.status_code == 503 and b"minilm" in waiting.body
    loading.set_result(None)
    assert (await readyz(request)).status_code == 200
