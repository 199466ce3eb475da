"""Processes the reliability tests may stop, kill and restart: a private Postgres cluster (never the
shared one on 5432) and `tollgate serve` subprocesses."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from tests.conftest import SECRET, missing, run_coro


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PrivatePostgres:
    """A throwaway cluster on a free port in a temp dir (run as the `postgres` OS user when we are root)."""

    def __init__(self) -> None:
        bindir = postgres_bin()
        if bindir is None:
            missing("initdb/pg_ctl not installed (apt-get install postgresql)")
        self.bin = bindir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="tollgate-pg-"))
        self.data = self.root / "data"
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self._pg(["initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])

    def _pg(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess[bytes]:
        cmd = [str(self.bin / argv[0]), *argv[1:]]
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, timeout=120)

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off -c max_connections=100"
        self._pg(["pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "-t", "60", "start"])

    def stop(self, mode: str = "fast") -> None:
        self._pg(["pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"], check=False)

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def create_database(self, name: str) -> str:
        async def make() -> None:
            conn = await asyncpg.connect(host="127.0.0.1", port=self.port, user="postgres", database="postgres")
            try:
                await conn.execute(f'CREATE DATABASE "{name}"')
            finally:
                await conn.close()

        run_coro(make())
        return self.url(name)

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


class GatewayProcess:
    """`tollgate serve` in a subprocess, so a test can SIGKILL it and start it again on the same data."""

    def __init__(self, db_url: str, data_dir: Path, admin_key: str, **env: str) -> None:
        self.db_url = db_url
        self.data_dir = data_dir
        self.admin_key = admin_key
        self.port = free_port()
        self.env = {
            **os.environ, "DATABASE_URL": db_url, "TOLLGATE_SECRET": SECRET, "TOLLGATE_PORT": str(self.port),
            "TOLLGATE_DATA_DIR": str(data_dir), "TOLLGATE_ADMIN_KEY": admin_key, "TOLLGATE_REDIS_TIMEOUT_MS": "250",
            "TOLLGATE_WARMUP": "0", **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.logs: list[Path] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> "GatewayProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.data_dir / f"serve-{len(self.logs)}.log"
        self.logs.append(log)
        exe = Path(sys.executable).with_name("tollgate")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([str(exe), "serve", "--log-level", "info"], env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(self.base_url + "/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                self.kill()  # never leave a half-started gateway behind
                raise AssertionError("gateway did not become ready: " + log.read_text()[-2000:])
            time.sleep(0.2)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.proc = None

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def admin(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=30)

    def workers(self) -> list[Any]:
        """uvicorn's worker processes under `--workers N` (psutil.Process each); one that has ended
        (a zombie until uvicorn reaps it) is none of them."""
        import psutil

        assert self.proc is not None
        found = []
        for child in psutil.Process(self.proc.pid).children():
            try:
                if "spawn_main" in " ".join(child.cmdline()):
                    found.append(child)
            except psutil.NoSuchProcess:  # ZombieProcess too
                pass
        return found

    def replacement(self, killed: Any, kept: list[Any], timeout: float = 120) -> Any:
        """The worker uvicorn started in place of `killed` (one of `kept` and the new one running).
        Each round reads the workers once: two reads could see the killed worker still running in
        the first and ended in the second, before any new one started."""
        want = {w.pid for w in kept}
        deadline = time.monotonic() + timeout
        while True:  # a poll of uvicorn's restart
            now = self.workers()
            fresh = [w for w in now if w.pid not in want and w.pid != killed.pid]
            if len(now) == len(kept) + 1 and len(fresh) == 1:
                return fresh[0]
            assert time.monotonic() < deadline, f"uvicorn started no worker in place of {killed.pid}: {[w.pid for w in now]}"
            time.sleep(0.1)

    async def _pinned(self, worker: Any, **kw: Any) -> tuple[httpx.AsyncClient, httpx.Response]:
        """A client whose one keep-alive connection `worker` accepted, with the answer to its first
        request (a /readyz). Which worker accepts a fresh connection is the kernel's choice (on a
        quiet machine one worker's accept loop can take them all), so the other workers, our own
        children, are stopped (SIGSTOP) until that /readyz is answered."""
        others = [p for p in self.workers() if p.pid != worker.pid]
        client = httpx.AsyncClient(base_url=self.base_url, limits=httpx.Limits(max_connections=1), **kw)
        for other in others:
            other.suspend()
        try:
            return client, await client.get("/readyz")
        except BaseException:
            await client.aclose()
            raise
        finally:
            for other in others:
                other.resume()

    async def client_on_worker(self, worker: Any, **kw: Any) -> httpx.AsyncClient:
        """A client whose one keep-alive connection `worker` accepted; that connection's first
        request, a /readyz, must be answered 200. A worker accepts only once its start has ended,
        and its start awaits every model's load (gateway/serving/engine_hosts.py:await_loads: the
        engine host's hello, a remote pool's tokenizer), so a worker is ready at its first request.
        Keep the client busy: uvicorn closes an idle connection after 5 s."""
        client, ready = await self._pinned(worker, **kw)
        if ready.status_code != 200:
            await client.aclose()
            raise AssertionError(f"worker {worker.pid} answered its /readyz {ready.status_code}: {ready.text}")
        return client

    async def heavy_then_light(self, heavy: Any, light: Any, regular_slots: int = 3) -> tuple[list[Any], Any]:
        """The reserve across workers: eight connections, four on each of two workers, run
        `heavy(client, started)` (it appends to `started` when its stream starts); once
        `regular_slots` of them have started (the regular slots all taken by the heavy account),
        `light(client)` runs on a connection of the second worker's own. Returns both results."""
        workers = self.workers()
        started: list[Any] = []
        conns = [await self.client_on_worker(workers[i % 2], timeout=60) for i in range(8)]
        try:
            heavy_runs = [asyncio.create_task(heavy(c, started.append)) for c in conns]
            deadline = time.monotonic() + 30
            while len(started) < regular_slots:
                assert time.monotonic() < deadline, f"{len(started)} heavy streams started"
                await asyncio.sleep(0.01)  # a poll of the streams' progress
            b = await self.client_on_worker(workers[1], timeout=60)
            try:
                light_run = await light(b)
            finally:
                await b.aclose()
            return await asyncio.gather(*heavy_runs), light_run
        finally:
            for c in conns:
                await c.aclose()

    async def new_key(self, **fields: Any) -> dict[str, Any]:
        import uuid

        async with self.admin() as c:
            account = (await c.post("/admin/accounts", json={"name": f"acct-{uuid.uuid4().hex[:8]}"})).json()
            r = await c.post("/admin/keys", json={"account_id": account["id"], **fields})
            assert r.status_code == 201, r.text
            return r.json()
