"""Soak: a `tollgate serve` process under ~80% of its measured capacity for a while, with mixed
streaming, non-streaming, cancelled and over-quota requests; then the checks of issue 8.

    .venv/bin/python bench/soak.py [--duration 600] [--load 0.8] [--database-url postgresql://...]

1. Starts the gateway (real model, SQLite in a temp dir unless --database-url) in a subprocess.
2. Measures capacity: requests/s of the served mix with --concurrency clients in a closed loop.
3. Soaks: open-loop Poisson arrivals at --load x capacity for --duration seconds. The mix:
   40% streaming, 30% non-streaming, 15% cancelled after the first chunk, 15% over quota (429).
4. Samples the server process every --sample seconds: RSS, open fds, TCP connections, threads,
   engine requests in flight and ledger backlog (/metrics).
5. Checks at the end: no 5xx; RSS growth after warm-up under 10%; no engine slot, connection or
   fd left over once the clients are gone; every admitted request has exactly one ledger row.

Prints a summary, writes every sample to --json; the exit status is 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import sqlalchemy as sa

from billing.db import create_engine
from gateway.config import DEFAULT_MODEL_ID

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "soak.json"
MIX = (("stream", 0.40), ("json", 0.30), ("cancel", 0.15), ("over_quota", 0.15))
TOPICS = ["a lighthouse", "a lost robot", "the sea", "a dragon", "two bakers", "a train", "a library", "a comet"]


@dataclass
class Sample:
    t: float
    rss_mb: float
    fds: int
    client_connections: int
    db_connections: int
    threads: int
    engine_in_flight: float
    ledger_backlog: float
    requests_done: int


@dataclass
class Report:
    capacity_rps: float = 0.0
    target_rps: float = 0.0
    duration_s: float = 0.0
    sent: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    samples: list[Sample] = field(default_factory=list)
    baseline: Sample | None = None
    warm: Sample | None = None
    end: Sample | None = None
    ledger_rows: int = 0
    admitted_ids: int = 0
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(self.checks.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    def __init__(self, database_url: str | None, data_dir: Path, extra_env: dict[str, str]) -> None:
        self.port = free_port()
        self.admin_key = "sk-" + secrets.token_urlsafe(32)
        self.database_url = database_url or f"sqlite:///{data_dir / 'tollgate.db'}"
        self.log = data_dir / "serve.log"
        env = {**os.environ, "DATABASE_URL": self.database_url, "TOLLGATE_DATA_DIR": str(data_dir), "TOLLGATE_PORT": str(self.port),
               "TOLLGATE_ADMIN_KEY": self.admin_key, "TOLLGATE_SECRET": secrets.token_hex(16), **extra_env}
        exe = Path(sys.executable).with_name("tollgate")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([str(exe), "serve", "--log-level", "warning"], env=env, stdout=out, stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit("gateway exited:\n" + self.log.read_text()[-3000:])
            try:
                if httpx.get(self.base_url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("gateway did not become ready")
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def sample(self, t: float, done: int, metrics: dict[str, float]) -> Sample:
        procs = [self.ps, *self.ps.children(recursive=True)]
        conns = [c for p in procs for c in p.net_connections(kind="tcp")]
        db_port = _port_of(self.database_url)
        return Sample(
            t=round(t, 1),
            rss_mb=round(sum(p.memory_info().rss for p in procs) / 2**20, 1),
            fds=sum(p.num_fds() for p in procs),
            client_connections=sum(1 for c in conns if c.laddr and c.laddr.port == self.port and c.status == psutil.CONN_ESTABLISHED),
            db_connections=sum(1 for c in conns if db_port and c.raddr and c.raddr.port == db_port and c.status == psutil.CONN_ESTABLISHED),
            threads=sum(p.num_threads() for p in procs),
            engine_in_flight=metrics.get("tollgate_engine_requests_in_flight", 0.0),
            ledger_backlog=metrics.get("tollgate_ledger_backlog_rows", 0.0),
            requests_done=done,
        )


def _port_of(url: str) -> int | None:
    match = re.search(r"@[^:/]+:(\d+)/", url)
    return int(match.group(1)) if match else (5432 if url.startswith("postgres") else None)


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("tollgate_engine_requests_in_flight", "tollgate_ledger_backlog_rows", "tollgate_engine_queue_depth")):
            name, _, value = line.partition(" ")
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


class Load:
    def __init__(self, base_url: str, keys: dict[str, str], max_tokens: int, seed: int) -> None:
        self.base_url = base_url
        self.keys = keys
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.report_statuses: Counter[str] = Counter()
        self.admitted: set[str] = set()  # request ids the gateway admitted (answered 200)
        self.done = 0
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300, connect=10), limits=limits)

    def pick(self) -> str:
        r, acc = self.rng.random(), 0.0
        for kind, share in MIX:
            acc += share
            if r < acc:
                return kind
        return MIX[-1][0]

    async def one(self, kind: str) -> None:
        key = self.keys["over_quota" if kind == "over_quota" else "main"]
        body: dict[str, Any] = {
            "model": DEFAULT_MODEL_ID, "max_tokens": self.rng.randint(max(1, self.max_tokens // 2), self.max_tokens),
            "messages": [{"role": "user", "content": f"Tell me about {self.rng.choice(TOPICS)}."}],
        }
        if kind in ("stream", "cancel", "over_quota"):
            body.update(stream=True, stream_options={"include_usage": True})
        headers = {"Authorization": f"Bearer {key}"}
        try:
            async with self.client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                status = r.status_code
                if status == 200:
                    self.admitted.add(r.headers["x-request-id"])
                if kind == "cancel" and status == 200:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            break  # leave mid-stream: closing the response drops the connection
                else:
                    await r.aread()
        except httpx.HTTPError as exc:
            status = f"client:{type(exc).__name__}"
        self.report_statuses[f"{kind}:{status}"] += 1
        self.done += 1

    async def aclose(self) -> None:
        await self.client.aclose()


async def measure_capacity(load: Load, seconds: float, concurrency: int) -> float:
    stop = time.monotonic() + seconds
    served = 0

    async def worker() -> None:
        nonlocal served
        while time.monotonic() < stop:
            await load.one(load.rng.choice(["stream", "json"]))
            served += 1

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return served / (time.monotonic() - started)


async def setup_keys(gw: Gateway) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {gw.admin_key}"}, timeout=30) as c:
        account = (await c.post("/admin/accounts", json={"name": f"soak-{secrets.token_hex(3)}"})).json()
        await c.post("/admin/prices", json={"model": DEFAULT_MODEL_ID, "input_per_million": "0.150", "output_per_million": "0.600"})
        main = (await c.post("/admin/keys", json={"account_id": account["id"], "name": "soak"})).json()
        over = (await c.post("/admin/keys", json={"account_id": account["id"], "name": "over-quota"})).json()
        await c.patch(f"/admin/keys/{over['id']}", json={"limits": {"monthly_tokens": 1}})
        return {"main": main["key"], "over_quota": over["key"]}


async def ledger_rows(database_url: str) -> int:
    db = create_engine(database_url)
    try:
        async with db.connect() as conn:
            return int((await conn.execute(sa.text("SELECT count(*) FROM ledger_entries"))).scalar_one())
    finally:
        await db.dispose()


async def run(args: argparse.Namespace) -> Report:
    report = Report(duration_s=args.duration)
    data_dir = Path(tempfile.mkdtemp(prefix="tollgate-soak-"))
    gw = Gateway(args.database_url, data_dir, {"TOLLGATE_MAX_QUEUE": "1024"})
    try:
        gw.wait_ready()
        keys = await setup_keys(gw)
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as probe:
            report.baseline = gw.sample(0, 0, await scrape(probe))
        load = Load(gw.base_url, keys, args.max_tokens, args.seed)
        report.capacity_rps = await measure_capacity(load, args.calibrate, args.concurrency)
        report.target_rps = args.load * report.capacity_rps
        log(f"capacity {report.capacity_rps:.2f} req/s with {args.concurrency} clients; soaking at {report.target_rps:.2f} req/s "
            f"for {args.duration:.0f}s")
        await soak(gw, load, report, args)
        await load.aclose()
        report.statuses = load.report_statuses
        await settle(gw, report, load, args)
    finally:
        gw.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    return report


async def soak(gw: Gateway, load: Load, report: Report, args: argparse.Namespace) -> None:
    started = time.monotonic()
    tasks: set[asyncio.Task[None]] = set()
    next_sample = 0.0
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as probe:
        while (elapsed := time.monotonic() - started) < args.duration:
            if elapsed >= next_sample:
                report.samples.append(gw.sample(elapsed, load.done, await scrape(probe)))
                next_sample = elapsed + args.sample
            kind = load.pick()
            report.sent[kind] += 1
            task = asyncio.create_task(load.one(kind))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(load.rng.expovariate(report.target_rps))
        if tasks:
            await asyncio.wait(tasks, timeout=600)
        report.samples.append(gw.sample(time.monotonic() - started, load.done, await scrape(probe)))


async def settle(gw: Gateway, report: Report, load: Load, args: argparse.Namespace) -> None:
    """After the clients are gone: wait for the engine and the ledger to drain, then check."""
    async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as probe:
        deadline = time.monotonic() + 60
        while True:
            m = await scrape(probe)
            if (m.get("tollgate_engine_requests_in_flight", 0) == 0 and m.get("tollgate_ledger_backlog_rows", 0) == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)  # let the server notice the closed keep-alive sockets
    report.end = gw.sample(report.samples[-1].t if report.samples else 0, load.done, m)
    warm_t = min(args.warmup, args.duration / 3)
    report.warm = next((s for s in report.samples if s.t >= warm_t), report.samples[0])
    report.ledger_rows = await ledger_rows(gw.database_url)
    report.admitted_ids = len(load.admitted)
    base, warm, end = report.baseline, report.warm, report.end
    assert base is not None and warm is not None and end is not None
    after_warm = [s.rss_mb for s in report.samples if s.t >= warm.t]
    peak = max([*after_warm, end.rss_mb])
    report.checks = {
        "no 5xx": not any(k.split(":", 1)[1].startswith("5") for k in report.statuses),
        "no client errors (timeouts, resets)": not any(":client:" in f":{k}" for k in report.statuses),
        "over-quota requests refused with 429": all(k.endswith(":429") for k in report.statuses if k.startswith("over_quota")),
        "memory growth after warm-up < 10%": peak <= warm.rss_mb * 1.10,
        "no engine slot left": end.engine_in_flight == 0,
        "ledger drained": end.ledger_backlog == 0,
        "no client connection left": end.client_connections == 0,
        "database connections within the pool": end.db_connections <= 20,
        "no fd leak": end.fds <= warm.fds + 5,
        "one ledger row per admitted request": report.ledger_rows == report.admitted_ids,
    }
    report.notes.append(f"rss warm {warm.rss_mb} MB at t={warm.t}s, peak after warm-up {peak} MB, end {end.rss_mb} MB; "
                        f"fds baseline {base.fds} warm {warm.fds} end {end.fds}")


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600, help="soak seconds (default 600)")
    p.add_argument("--load", type=float, default=0.8, help="fraction of measured capacity (default 0.8)")
    p.add_argument("--calibrate", type=float, default=30, help="seconds of capacity measurement (default 30)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients while measuring capacity (default 8)")
    p.add_argument("--max-tokens", type=int, default=24, help="max_tokens of a request: half to all of it (default 24)")
    p.add_argument("--warmup", type=float, default=60, help="seconds before memory is baselined (default 60, at most a third)")
    p.add_argument("--sample", type=float, default=5, help="seconds between samples (default 5)")
    p.add_argument("--database-url", default=None, help="ledger database (default: SQLite in a temp dir)")
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="samples and results (default bench/results/soak.json)")
    return p.parse_args(argv)


def summary(report: Report) -> str:
    lines = [
        f"capacity {report.capacity_rps:.2f} req/s, soak at {report.target_rps:.2f} req/s for {report.duration_s:.0f}s",
        f"sent {dict(report.sent)}",
        f"answers {dict(sorted(report.statuses.items()))}",
        f"ledger rows {report.ledger_rows} for {report.admitted_ids} admitted requests",
        *report.notes,
        "memory (t s: RSS MB): " + ", ".join(f"{s.t:.0f}: {s.rss_mb:.0f}" for s in report.samples[:: max(1, len(report.samples) // 12)]),
        *[f"  {'ok  ' if ok else 'FAIL'} {name}" for name, ok in report.checks.items()],
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    print(summary(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        **{k: v for k, v in vars(report).items() if k not in ("sent", "statuses", "samples", "baseline", "warm", "end")},
        "sent": dict(report.sent), "statuses": dict(report.statuses), "samples": [asdict(s) for s in report.samples],
        **{k: asdict(v) if v else None for k, v in (("baseline", report.baseline), ("warm", report.warm), ("end", report.end))},
        "ok": report.ok, "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.json.write_text(json.dumps(payload, indent=1, default=str))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
