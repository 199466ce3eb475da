"""A worker of `tollgate serve --workers N` starts (and so accepts connections: uvicorn accepts once
the app's startup has ended) only once its hosted engines are connected to the supervisor's engine
host (gateway/serving/engine_hosts.py:await_loads). The race is made deterministic with a double in
front of the real host's socket: it takes the worker's connection and passes nothing on until the
test lets it."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import Settings
from gateway.serving import engine_hosts
from gateway.serving.engine_hosts import EngineHosts
from tests.conftest import SECRET, bootstrap
from tests.engines.conftest import upstreams  # noqa: F401  (fixture)

MODELS = "models:\n  - id: synth\n    backend: synthetic\n    step_ms: 1\n    max_batch_size: 4\n"


class HeldHost:
    """A Unix socket in front of the engine host's: accepts the worker's connection at once (`taken`),
    and connects it through to the host only once `release` is set."""

    def __init__(self, path: Path, target: str) -> None:
        self.path, self.target = str(path), target
        self.taken, self.release = threading.Event(), threading.Event()
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(self.path)
        self._listener.listen(4)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            worker, _ = self._listener.accept()
        except OSError:
            return
        self.taken.set()
        self.release.wait()
        host = socket.socket(socket.AF_UNIX)
        try:
            host.connect(self.target)
        except OSError:  # released at the test's end, the host gone with it: nothing left to connect through
            worker.close()
            host.close()
            return
        for a, b in ((worker, host), (host, worker)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self._listener.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def host(tmp_path: Path) -> Any:
    models = tmp_path / "models.yaml"
    models.write_text(MODELS)
    settings = Settings(data_dir=tmp_path / "data").with_overrides(engines={"models_file": str(models)})
    (tmp_path / "data").mkdir()
    hosts = EngineHosts(settings)
    sockets = hosts.start()
    held = HeldHost(tmp_path / "held.sock", sockets["synth"])
    try:
        yield models, held
    finally:
        held.close()
        hosts.stop()


def worker_app(fresh_pg_database: Any, tmp_path: Path, models: Path, held: HeldHost) -> Any:
    db_url = fresh_pg_database()
    bootstrap(db_url, SECRET)
    settings = Settings(database_url=db_url, server_secret=SECRET, data_dir=tmp_path / "data").with_overrides(
        engines={"models_file": str(models), "engine_hosts": {"synth": held.path}}, embeddings={"enabled": False})
    return create_app(settings)


def test_a_worker_starts_only_once_its_engine_host_has_answered(fresh_pg_database: Any, tmp_path: Path, host: Any) -> None:
    models, held = host
    app = worker_app(fresh_pg_database, tmp_path, models, held)

    async def run() -> None:
        lifespan = app.router.lifespan_context(app)
        startup = asyncio.create_task(lifespan.__aenter__())
        try:
            assert await asyncio.to_thread(held.taken.wait, 60), "the worker never connected to its engine host"
            # Connected, not answered: the start is still waiting, so uvicorn would not accept yet.
            assert not startup.done(), "the worker's start ended before its engine host answered"
            held.release.set()
            await asyncio.wait_for(startup, 60)
            # The first request after the start: its engine is connected, no 503 engine_not_ready.
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
                ready = await client.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert app.state.service.engines["synth"].ready
        finally:
            held.release.set()
            if startup.done() and startup.exception() is None:
                await lifespan.__aexit__(None, None, None)

    asyncio.run(run())


def test_a_host_that_never_answers_stops_the_workers_start_saying_so(fresh_pg_database: Any, tmp_path: Path, host: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    models, held = host
    monkeypatch.setattr(engine_hosts, "CONNECT_TIMEOUT_S", 0.5)
    app = worker_app(fresh_pg_database, tmp_path, models, held)

    async def run() -> None:
        lifespan = app.router.lifespan_context(app)
        with pytest.raises(RuntimeError, match=r"engine host of synth did not answer this worker's connection within 0.5 s"):
            await asyncio.wait_for(lifespan.__aenter__(), 60)
        assert held.taken.is_set()

    asyncio.run(run())


REMOTE = """models:
  - id: remote
    backend: openai
    context_length: 4096
    replicas: ["{url}"]
    health_path: /health
    health_interval: 3600
    health_timeout: 60
"""


def test_a_worker_of_remote_engines_starts_only_once_they_have_loaded(fresh_pg_database: Any, tmp_path: Path, upstreams: Any) -> None:
    """--workers 2 over an `openai` pool (no engine host): a worker loads the pool itself (its
    tokenizer, its first health round), and accepts only once that has ended, so its first request
    is not refused 503 engine_not_ready while another worker already says ready. The replica holds
    its health answer until the test lets it."""
    upstream, url = upstreams()
    upstream.health_open.clear()
    models = tmp_path / "remote.yaml"
    models.write_text(REMOTE.format(url=url))
    db_url = fresh_pg_database()
    bootstrap(db_url, SECRET)
    settings = Settings(database_url=db_url, server_secret=SECRET, data_dir=tmp_path / "data").with_overrides(
        engines={"models_file": str(models)}, embeddings={"enabled": False}, http={"workers": 2})
    app = create_app(settings)

    async def run() -> None:
        lifespan = app.router.lifespan_context(app)
        startup = asyncio.create_task(lifespan.__aenter__())
        try:
            while upstream.health_checks == 0:  # a poll of the pool's load reaching its health round
                assert not startup.done(), "the worker's start ended before its pool's first health round"
                await asyncio.sleep(0.01)
            # The probe is held: the pool has not loaded, so the start is still waiting.
            assert not startup.done(), "the worker's start ended before its pool had loaded"
            upstream.health_open.set()
            await asyncio.wait_for(startup, 60)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
                ready = await client.get("/readyz")
            assert ready.status_code == 200, ready.text
        finally:
            upstream.health_open.set()
            if startup.done() and startup.exception() is None:
                await lifespan.__aexit__(None, None, None)

    asyncio.run(run())
