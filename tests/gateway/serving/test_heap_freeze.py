"""The server's processes freeze their heap out of the cyclic collector's scans once started and
again when the models loading in the background are in (gateway.app.freeze_heap): what starting
up built is then never scanned by the full collections that request garbage triggers under load
(~160 ms each with the event loop stopped before this; docs/performance.md)."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import httpx

from gateway.app import create_app
from gateway.config import Settings
from tests.conftest import SECRET, ServerThread, bootstrap


def in_collected_generations(obj: Any) -> bool:
    """Whether the collector's generations 0-2 hold `obj` (frozen objects are in none of them)."""
    return any(o is obj for o in gc.get_objects())


async def test_what_startup_and_background_loads_built_is_frozen(fresh_pg_database: Any, tmp_path: Path) -> None:
    db_url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(db_url, SECRET)
    settings = Settings(database_url=db_url, server_secret=SECRET, data_dir=tmp_path)
    frozen_before = gc.get_freeze_count()
    app = create_app(settings, engines={}, freeze_gc=True)
    try:
        with ServerThread(app) as server:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}",
                                         headers={"Authorization": f"Bearer {admin_key}"}) as admin:
                assert (await admin.get("/healthz")).status_code == 200
            assert gc.get_freeze_count() > frozen_before
            service = app.state.service  # built by the lifespan, before the first freeze
            assert gc.is_tracked(service) and not in_collected_generations(service)
            loading = app.state.embeddings_loading
            for _ in range(600):  # the embedding model loads in the background
                if loading.done():
                    break
                await asyncio.sleep(0.1)
            assert loading.done()
            await asyncio.sleep(0.2)  # the freeze runs in the task's done callback
            models = list(app.state.embeddings.models.values())
            assert models and all(m.ready for m in models)
            for model in models:  # its torch module was built by the load, after the first freeze
                assert gc.is_tracked(model._model) and not in_collected_generations(model._model)
            # Request garbage is still collected: a cycle made now is found by the collector.
            cycle: list[Any] = []
            cycle.append(cycle)
            assert in_collected_generations(cycle)
    finally:
        gc.unfreeze()  # the test process's objects back under the collector
        # What became garbage while frozen (earlier tests' leftovers) is collected here, not at some
        # later test's allocation (an unclosed client stream's finalizer once warned in test_quotas).
        gc.collect()


async def test_without_the_flag_nothing_is_frozen(fresh_pg_database: Any, tmp_path: Path) -> None:
    db_url = fresh_pg_database(migrated=True)
    bootstrap(db_url, SECRET)
    gc.unfreeze()
    app = create_app(Settings(database_url=db_url, server_secret=SECRET, data_dir=tmp_path), engines={})
    with ServerThread(app) as server:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            assert (await client.get("/healthz")).status_code == 200
        assert gc.get_freeze_count() == 0
        assert in_collected_generations(app.state.service)
