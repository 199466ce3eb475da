"""Processes the benchmarks start: a fresh Postgres database, the mock upstream, a Tollgate
gateway (`tollgate serve` in a subprocess, as in production), and keys made through its admin API."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parent.parent
PG = os.environ.get("TOLLGATE_BENCH_PG", "postgresql://postgres@127.0.0.1:5432")
REDIS = os.environ.get("TOLLGATE_BENCH_REDIS", "redis://127.0.0.1:6379/0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# `tollgate` run from whichever tree PYTHONPATH names first (`-P`: not this checkout ahead of it), so
# that bench/overhead.py --rev and bench/overhead_ab.py can serve any revision's code; revisions from
# before gateway/cli/ was a folder have their entry point at gateway.cli:main.
TOLLGATE = """import sys
try:
    from gateway.cli.main import main
except ModuleNotFoundError:
    from gateway.cli import main
sys.argv[0] = "tollgate"
sys.exit(main())
"""


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout}s")


async def _sql(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG + "/postgres")
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextmanager
def fresh_database() -> Iterator[str]:
    name = f"tollgate_bench_{uuid.uuid4().hex[:10]}"
    asyncio.run(_sql(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{PG}/{name}"
    finally:
        asyncio.run(_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def delete_redis_keys(prefix: str) -> int:
    """Removes what a bench run left under its Redis prefix (quota counters, `settled:` markers)."""
    import redis

    client = redis.Redis.from_url(REDIS)
    removed = 0
    try:
        batch: list[bytes] = []
        for key in client.scan_iter(match=prefix + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                removed += client.unlink(*batch)
                batch.clear()
        if batch:
            removed += client.unlink(*batch)
    finally:
        client.close()
    return removed


@contextmanager
def process(args: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log:
            out.close()  # type: ignore[union-attr]


@contextmanager
def mock_upstream() -> Iterator[str]:
    port = free_port()
    with process([sys.executable, str(ROOT / "bench" / "mock_upstream.py"), "--port", str(port)]) as proc:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}/v1"


@contextmanager
def gateway(database_url: str, upstream: str | None, *, extra_env: dict[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """A gateway serving model `mock` (openai backend -> upstream) or, without upstream, the hf model."""
    tmp = Path(tempfile.mkdtemp(prefix="tollgate-bench-"))
    port = free_port()
    admin = "sk-bench-admin-" + uuid.uuid4().hex
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url, TOLLGATE_PORT=str(port), TOLLGATE_DATA_DIR=str(tmp),
        TOLLGATE_ADMIN_KEY=admin, TOLLGATE_SECRET="bench-secret-" + uuid.uuid4().hex,
    )
    if upstream:
        models = tmp / "models.yaml"
        models.write_text(
            "models:\n  - id: mock\n    backend: openai\n    replicas: [\"%s\"]\n    context_length: 4096\n"
            "    health_path: null\n    max_connections: 256\n" % upstream
        )
        env["TOLLGATE_MODELS"] = str(models)
    env.update(extra_env or {})
    with process([sys.executable, "-P", "-c", TOLLGATE, "serve", "--log-level", "warning"], env, tmp / "serve.log") as proc:
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz", proc)
        except RuntimeError:
            try:
                why = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).text
            except httpx.HTTPError as exc:
                why = repr(exc)
            log = (tmp / "serve.log").read_text(errors="replace").splitlines()[-30:]
            print(f"the gateway did not get ready: {why}\n" + "\n".join(log), file=sys.stderr, flush=True)
            raise
        yield f"http://127.0.0.1:{port}", admin


def make_key(base: str, admin: str, *, limits: dict[str, Any] | None = None) -> str:
    h = {"Authorization": f"Bearer {admin}"}
    account = httpx.post(f"{base}/admin/accounts", json={"name": "bench-" + uuid.uuid4().hex[:8]}, headers=h).json()
    key = httpx.post(f"{base}/admin/keys", json={"account_id": account["id"]}, headers=h).json()
    if limits:
        r = httpx.patch(f"{base}/admin/keys/{key['id']}", json={"limits": limits}, headers=h)
        r.raise_for_status()
    return str(key["key"])


class ServerThread:
    """An ASGI app under uvicorn on an ephemeral port, in a thread with its own event loop, speaking
    the protocol `tollgate serve` runs (the in-process benches, and the tests through tests/conftest.py)."""

    def __init__(self, app: Any, **protocol_limits: Any) -> None:
        from gateway.http.hardening import guarded_http_protocol

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        http = guarded_http_protocol(**protocol_limits)  # the protocol `tollgate serve` runs
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5, http=http))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()
