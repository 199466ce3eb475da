"""Fixtures for the engine backends: scripted upstream servers, and Tollgates configured by a
models.yaml (the production path: file -> registry -> engines started in the app's lifespan)."""

from __future__ import annotations

import socket
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.base import Engine
from gateway.app import create_app
from gateway.config import EngineSettings, Settings
from tests.conftest import SECRET, Gateway, ServerThread, bootstrap
from tests.fakes.upstream import ScriptedUpstream


@pytest.fixture
def upstreams() -> Iterator[Callable[..., tuple[ScriptedUpstream, str]]]:
    """Starts scripted OpenAI-compatible servers; returns (server, base URL ending in /v1)."""
    running: list[ServerThread] = []

    def start(name: str = "upstream") -> tuple[ScriptedUpstream, str]:
        upstream = ScriptedUpstream(name)
        server = ServerThread(upstream).__enter__()
        running.append(server)
        return upstream, f"http://127.0.0.1:{server.port}/v1"

    yield start
    for server in running:
        server.__exit__()


@pytest.fixture
def unresponsive_port() -> Iterator[int]:
    """A port whose listen queue is full: connecting to it hangs until the client times out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(s)
    time.sleep(0.1)
    yield port
    for s in fillers:
        s.close()
    listener.close()


def closed_port() -> int:
    """A port nothing listens on (connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class ModelsGateway(Gateway):
    """A Tollgate whose models come from a models.yaml."""

    def engines(self) -> dict[str, Engine]:
        return self.app.state.service.engines

    def pool(self, model: str) -> Any:
        """The replica pool behind a model (its own engine, the first of its candidates)."""
        return self.engines()[model].candidates[0].unwrapped().pool  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def models_db(fresh_pg_database: Any) -> str:
    return fresh_pg_database(migrated=True)


@pytest.fixture
def tollgate_with(models_db: str, tmp_path: Path) -> Iterator[Callable[..., ModelsGateway]]:
    """Starts a Tollgate on Postgres serving the models of a models.yaml text; waits until ready.
    `environ`: the environment it started with, where the file's `api_key_env` names are looked up."""
    running: list[ServerThread] = []

    def start(models_yaml: str, environ: dict[str, str] | None = None) -> ModelsGateway:
        path = tmp_path / f"models-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(textwrap.dedent(models_yaml))
        admin_key = bootstrap(models_db, SECRET)
        engines = EngineSettings(models_file=str(path), environ=dict(environ or {}))
        settings = Settings(database_url=models_db, server_secret=SECRET, data_dir=tmp_path, engines=engines)
        app = create_app(settings)
        server = ServerThread(app).__enter__()
        running.append(server)
        gw = ModelsGateway(f"http://127.0.0.1:{server.port}", settings, admin_key, None, app, models_db)  # type: ignore[arg-type]
        deadline = time.monotonic() + 60
        while httpx.get(gw.base_url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the gateway's models did not get ready"
            time.sleep(0.05)
        return gw

    yield start
    for server in running:
        server.__exit__()
