"""The `hf` engine alone against the same engine behind `tollgate serve`, side by side in one run.

    python bench/gpu_gateway_vs_engine.py --model smollm2=/path/to/ckpt --model llama1b=/path \\
        [--device cuda] [--levels 1,16,64,256] [--isl 512] [--osl 256] [--variants engine,gateway,inproc]

For each model and each level of concurrent streams, the same requests (ISL random prompt token
ids, OSL output tokens, greedy) go
  engine   straight into an `HFEngine` (its own process: this script re-run with `engine-alone`),
           with the settings `tollgate serve` gives it: the engine's own rate;
  gateway  through `tollgate serve` (its own process; the default engine layout for the device:
           on CUDA the model in an engine process of its own), full metering: SQLite ledger,
           in-process limits on the key, a price, the scheduler on;
  inproc   the same with TOLLGATE_ENGINE_PROCESS=0: the model in the gateway's process (the
           layout before issue 26), for the before/after comparison (levels: --inproc-levels);
  nosched  inproc with TOLLGATE_SCHEDULER=0 too (where issue 26 saw a stream dropped).
The load for the gateway comes from this process (raw HTTP/1.1 SSE clients, one connection per
request), as real clients do. Printed per cell: aggregate output tokens/s, TTFT p50/p99, the gap
between token-bearing deliveries (ITL) p50/p99, and the gateway's CPU seconds per 1,000 streamed
tokens (its own process, and the engine process's beside it); then the ratios gateway/engine.
Every gateway run checks its ledger: one `completed` row per request, tokens equal to usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import free_port, wait_http  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


# one request ---------------------------------------------------------------------------------
class Timing:
    __slots__ = ("start", "sent", "first", "last", "gaps", "tokens", "error", "queue_ms")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.sent: float | None = None  # through the gateway: the request written to its connection
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.tokens = 0
        self.error: str | None = None
        self.queue_ms: float | None = None  # the engine alone: its output's queue_ms

    def delivery(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)  # type: ignore[operator]
        self.last = now


def prompts(n: int, isl: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(isl)] for _ in range(n)]


def requests_at(level: int) -> int:
    """Two waves of requests per stream (one at 256 streams, where one wave is already ~65k tokens)."""
    return 4 if level == 1 else level if level >= 256 else 2 * level


async def run_level(level: int, batch: list[list[int]], one: Any) -> tuple[list[Timing], float]:
    """`level` streams at once, each taking the next prompt as its previous request ends."""
    todo = list(enumerate(batch))
    results: list[Timing] = []

    async def worker() -> None:
        while todo:
            i, ids = todo.pop(0)
            results.append(await one(i, ids))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(level)))
    return results, time.perf_counter() - started


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def summarize(results: list[Timing], wall: float, cpu: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttft = [(r.first - r.start) * 1000 for r in ok if r.first is not None]
    gaps = [g * 1000 for r in ok for g in r.gaps]
    cell: dict[str, Any] = {
        "requests": len(results), "errors": len(results) - len(ok), "error_samples": sorted({r.error for r in results if r.error})[:3],
        "output_tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1) if wall else None,
        "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99), "itl_p50_ms": pct(gaps, 0.5), "itl_p99_ms": pct(gaps, 0.99),
    }
    sent = [(r.sent - r.start) * 1000 for r in ok if r.sent is not None]
    if sent:  # the client's own part of TTFT: connecting and writing the request (a burst's takes longest)
        cell["client_send_p50_ms"] = pct(sent, 0.5)
        cell["ttft_from_sent_p50_ms"] = pct([(r.first - r.sent) * 1000 for r in ok if r.first is not None and r.sent is not None], 0.5)
    queued = [r.queue_ms for r in ok if r.queue_ms is not None]
    if queued:
        cell["ledger_queue_p50_ms"] = pct(queued, 0.5)  # the engine alone: the same measure the ledger row keeps
    if cpu is not None and tokens:
        cell.update({f"{name}_cpu_s_per_1k_tokens": round(seconds * 1000 / tokens, 4) for name, seconds in cpu.items()})
    return cell


# the engine alone ------------------------------------------------------------------------------
def engine_kwargs(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    """What `tollgate serve` gives the hf engine for the TOLLGATE_* settings of `gateway_env`."""
    from gateway.config import default_cache_dir

    return dict(model_path=model_path, device=args.device, max_batch_size=args.batch_size, max_queue=args.max_queue,
                kv_cache_tokens=args.kv_cache_tokens, max_batch_tokens=args.max_batch_tokens, warmup=True,
                cache_dir=default_cache_dir(os.environ))


def models_file(args: argparse.Namespace, model_path: str) -> str:
    """The models-file entry for what `gateway_env` sets: the form `tollgate serve --workers N` needs."""
    return ("models:\n  - id: bench\n    backend: hf\n    process: true\n"
            f"    model_path: {json.dumps(model_path)}\n    device: {json.dumps(args.device)}\n    max_batch_size: {args.batch_size}\n"
            f"    max_queue: {args.max_queue}\n    kv_cache_tokens: {args.kv_cache_tokens}\n    max_batch_tokens: {args.max_batch_tokens}\n")


def fresh_postgres(server: str) -> str:
    """A new database on the Postgres server at `server` (postgresql://user@host:port) for one gateway's ledger."""
    import asyncpg

    name = f"tollgate_gpu_{uuid.uuid4().hex[:10]}"

    async def create() -> None:
        conn = await asyncpg.connect(server + "/postgres")
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    return f"{server}/{name}"


def ledger_query(database: str | Path, sql: str) -> list[tuple[Any, ...]]:
    """Rows of `sql` from the gateway's ledger: a SQLite file, or a Postgres URL."""
    if isinstance(database, Path):
        with sqlite3.connect(database) as conn:
            return conn.execute(sql).fetchall()
    import asyncpg

    async def fetch() -> list[tuple[Any, ...]]:
        conn = await asyncpg.connect(database)
        try:
            return [tuple(r) for r in await conn.fetch(sql)]
        finally:
            await conn.close()

    return asyncio.run(fetch())


def gateway_env(args: argparse.Namespace, model_path: str) -> dict[str, str]:
    return {"TOLLGATE_MODEL_PATH": model_path, "TOLLGATE_MODEL_ID": "bench", "TOLLGATE_DEVICE": args.device,
            "TOLLGATE_MAX_BATCH_SIZE": str(args.batch_size), "TOLLGATE_MAX_QUEUE": str(args.max_queue),
            "TOLLGATE_KV_CACHE_TOKENS": str(args.kv_cache_tokens), "TOLLGATE_MAX_BATCH_TOKENS": str(args.max_batch_tokens)}


async def engine_alone(args: argparse.Namespace) -> dict[str, Any]:
    """Every level of `args.levels` once, in this process; or, with `args.serve`, the levels the
    parent names on stdin (one JSON line each, answered by one cell line) until it says stop."""
    from engines.backends.hf import HFEngine

    engine = HFEngine(model_id="bench", **engine_kwargs(args, args.model_path))
    await engine.start()
    vocab = int(engine.vocab_size or 32000)
    config = engine._model.config.to_dict()
    head = {"vocab": vocab, "config": {k: config.get(k) for k in CONFIG_KEYS}}
    cells = {}
    if getattr(args, "serve", False):
        print(json.dumps(head), flush=True)
        loop = asyncio.get_running_loop()
        while (line := await loop.run_in_executor(None, sys.stdin.readline)).strip() not in ("", "stop"):
            order = json.loads(line)
            cell = await engine_level(engine, args, vocab, order["level"], order["seed"])
            print(json.dumps(cell), flush=True)
    else:
        for level in args.levels:
            cells[str(level)] = await engine_level(engine, args, vocab, level, seed=level)
            print(f"  engine alone, {level} streams: {cells[str(level)]['tok_s']} tok/s", file=sys.stderr, flush=True)
    await engine.stop()
    return {**head, "cells": cells}


async def engine_level(engine: Any, args: argparse.Namespace, vocab: int, level: int, seed: int) -> dict[str, Any]:
    from engines.base import EngineRequest, SamplingParams

    async def one(i: int, ids: list[int]) -> Timing:
        t = Timing()
        request = EngineRequest(request_id=uuid.uuid4().hex, max_tokens=args.osl, sampling=SamplingParams(temperature=0.0), prompt_token_ids=ids)
        async for out in engine.stream(request):
            if out.text:  # what a client sees: a delivery is text (the gateway sends no empty deltas)
                t.delivery()
            if out.finished:
                t.tokens, t.queue_ms = out.completion_tokens, out.queue_ms
                if out.finish_reason == "error":
                    t.error = out.error
        return t

    batch = prompts(requests_at(level), args.isl, vocab, seed=seed)
    before = os.times()
    results, wall = await run_level(level, batch, one)
    after = os.times()
    return summarize(results, wall, {"engine": (after.user - before.user) + (after.system - before.system)})


class EngineWorker:
    """The engine alone in a process of its own (this script, `engine-alone --serve`), kept loaded
    while the gateway runs beside it, so that the two sides can take turns level by level."""

    def __init__(self, args: argparse.Namespace, model_path: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "engine-alone", "--serve", *engine_argv(args, model_path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.head: dict[str, Any] | None = None

    def _line(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the engine-alone process ended (rc {self.proc.wait()})")
        return json.loads(line)

    def ready(self) -> dict[str, Any]:
        if self.head is None:
            self.head = self._line()
        return self.head

    def run(self, level: int, seed: int) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"level": level, "seed": seed}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._line()

    def close(self) -> None:
        try:
            self.proc.stdin.write("stop\n")  # type: ignore[union-attr]
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def engine_argv(args: argparse.Namespace, model_path: str) -> list[str]:
    return ["--model-path", model_path, "--device", args.device, "--levels", ",".join(map(str, args.levels)), "--isl", str(args.isl),
            "--osl", str(args.osl), "--batch-size", str(args.batch_size), "--max-queue", str(args.max_queue),
            "--kv-cache-tokens", str(args.kv_cache_tokens), "--max-batch-tokens", str(args.max_batch_tokens)]


# through the gateway ---------------------------------------------------------------------------
async def sse_request(port: int, key: str, ids: list[int], osl: int) -> Timing:
    """One streamed text completion over a raw HTTP/1.1 connection: every SSE event that carries
    text is a delivery; the usage event gives the exact token count."""
    t = Timing()
    body = json.dumps({"model": "bench", "prompt": ids, "max_tokens": osl, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    except OSError as exc:
        t.error = f"connect: {exc}"
        return t
    try:
        writer.write(head + body)
        t.sent = time.perf_counter()
        status = await reader.readline()
        if b" 200 " not in status:
            t.error = f"status {status.decode().strip()}: {(await reader.read(2000))[-300:]!r}"
            return t
        await reader.readuntil(b"\r\n\r\n")
        buf = b""
        done = False
        while not done:
            data = await reader.read(1 << 16)
            if not data:
                t.error = "the connection closed before [DONE]"
                break
            buf += data
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if b"[DONE]" in event:
                    done = True
                elif b'"usage":{' in event:
                    t.tokens = json.loads(event[event.index(b"data: ") + 6 :])["usage"]["completion_tokens"]
                elif b'"error"' in event:
                    t.error = event[-300:].decode(errors="replace")
                elif b'"text":""' not in event:
                    t.delivery()
    except Exception as exc:  # noqa: BLE001 - a broken stream is a result to report
        t.error = f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()
    return t


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def child_pids(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def split_processes(pid: int) -> tuple[list[int], list[int]]:
    """(the engine process, every gateway process) under `tollgate serve` at `pid`: with `--workers N`
    the supervisor's children are the engine host and the workers."""
    engine, gateway, todo = [], [pid], child_pids(pid)
    while todo:
        child = todo.pop()
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"engines.backends.hf_process" in cmdline:
            engine.append(child)
        else:
            gateway.append(child)
            todo.extend(child_pids(child))
    return engine, gateway


class GatewayRun:
    """`tollgate serve` in its own process with full metering; `run(level, seed)` measures one level
    through it; `finish()` checks the ledger of every request sent."""

    def __init__(self, args: argparse.Namespace, model_path: str, label: str, extra_env: dict[str, str], workers: int = 1) -> None:
        self.args, self.label, self.workers = args, label, workers
        self.tmp = Path(tempfile.mkdtemp(prefix="tollgate-gpu-bench-"))
        self.port, admin = free_port(), "sk-bench-admin-" + uuid.uuid4().hex
        self.database = fresh_postgres(args.postgres) if args.postgres else None
        env = dict(os.environ, TOLLGATE_PORT=str(self.port), TOLLGATE_DATA_DIR=str(self.tmp), TOLLGATE_ADMIN_KEY=admin,
                   DATABASE_URL=self.database or f"sqlite:///{self.tmp}/ledger.db", TOLLGATE_SECRET="bench-" + uuid.uuid4().hex)
        if args.postgres:  # as `--workers N` runs: a models file (the hf engine process the workers share), Redis quotas
            models = self.tmp / "models.yaml"
            models.write_text(models_file(args, model_path))
            env.update(TOLLGATE_MODELS=str(models), REDIS_URL=args.redis, TOLLGATE_REDIS_PREFIX=f"tgbench:g:{uuid.uuid4().hex[:6]}:",
                       TOLLGATE_WORKERS=str(workers))
        else:
            env.update(gateway_env(args, model_path))
        env.update(extra_env)
        self.admin = admin
        self.log = open(self.tmp / "serve.log", "wb")
        exe = Path(sys.executable).with_name("tollgate")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "import sys; from gateway.cli.main import main; sys.exit(main())"]
        self.proc = subprocess.Popen([*cmd, "serve", "--log-level", "warning"], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.runs: list[tuple[int, int, int]] = []  # (level, requests, usage tokens) in the order run, the warm-up first
        self.engine_pids: list[int] = []

    def start(self, vocab: int) -> None:
        wait_http(f"http://127.0.0.1:{self.port}/readyz", self.proc, timeout=900)
        h = {"Authorization": f"Bearer {self.admin}"}
        base = f"http://127.0.0.1:{self.port}"
        httpx.post(f"{base}/admin/prices", json={"model": "bench", "input_per_million": "0.10", "output_per_million": "0.40"}, headers=h).raise_for_status()
        account = httpx.post(f"{base}/admin/accounts", json={"name": "bench"}, headers=h).json()
        self.key = httpx.post(f"{base}/admin/keys", json={"account_id": account["id"]}, headers=h).json()
        httpx.patch(f"{base}/admin/keys/{self.key['id']}", json={"limits": {"rpm": 1_000_000, "tpm": 1_000_000_000, "monthly_tokens": 10_000_000_000}},
                    headers=h).raise_for_status()
        self.engine_pids, self.gateway_pids = split_processes(self.proc.pid)
        self.vocab = vocab
        # One request first, as the engine alone has its warm-up: the gateway's first request reads
        # the key, the prices and the quota counters from the database (once per process). With
        # --workers N, 2N - 1 of them so that every worker has served one, most likely (the kernel
        # picks the worker of each fresh connection). None is retried: a worker accepts only once
        # its engine connection is open (gateway/serving/engine_hosts.py:await_loads).
        warm_ups = 2 * self.workers - 1
        tokens = 0
        for n in range(warm_ups):
            warm = asyncio.run(self._one(-1, prompts(1, self.args.isl, vocab, seed=n)[0]))
            if warm.error:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
            tokens += warm.tokens
        self.runs.append((0, warm_ups, tokens))

    async def _one(self, i: int, ids: list[int]) -> Timing:
        return await sse_request(self.port, self.key["key"], ids, self.args.osl)

    def run(self, level: int, seed: int) -> dict[str, Any]:
        batch = prompts(requests_at(level), self.args.isl, self.vocab, seed=seed)
        before = {"gateway": sum(cpu_seconds(p) for p in self.gateway_pids), "engine_process": sum(cpu_seconds(p) for p in self.engine_pids)}
        results, wall = asyncio.run(run_level(level, batch, self._one))
        cpu = {"gateway": sum(cpu_seconds(p) for p in self.gateway_pids) - before["gateway"]}
        if self.engine_pids:
            cpu["engine_process"] = sum(cpu_seconds(p) for p in self.engine_pids) - before["engine_process"]
        cell = summarize(results, wall, cpu)
        cell["usage_tokens"] = sum(r.tokens for r in results)
        self.runs.append((level, len(batch), cell["usage_tokens"]))
        print(f"  {self.label}, {level} streams: {cell['tok_s']} tok/s, errors {cell['errors']}", file=sys.stderr, flush=True)
        return cell

    def finish(self, cells: list[dict[str, Any]]) -> dict[str, Any]:
        """The ledger's verdict over every request sent; each cell (in the order run, without the
        warm-up) gets the gateway's own TTFT and queue p50 from its rows."""
        db = self.database or self.tmp / "ledger.db"
        ledger = ledger_check(db, sum(n for _, n, _ in self.runs), sum(t for _, _, t in self.runs))
        for cell, (ttft, queue) in zip(cells, ledger_timings(db, [n for _, n, _ in self.runs[1:]], skip=self.runs[0][1])):
            cell["ledger_ttft_p50_ms"], cell["ledger_queue_p50_ms"] = ttft, queue
        return ledger

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        lines = (self.tmp / "serve.log").read_text(errors="replace").splitlines()
        warnings = [line for line in lines if any(w in line.lower() for w in ('"level":"warning"', '"level":"error"', "traceback"))]
        if warnings:
            print(f"  server log: {len(warnings)} warning/error lines, the first ones:\n    " + "\n    ".join(warnings[:8]), file=sys.stderr)


def through_gateway(args: argparse.Namespace, model_path: str, vocab: int, label: str, extra_env: dict[str, str]) -> dict[str, Any]:
    """Every level of the variant once, one after another, through one `tollgate serve`."""
    gw = GatewayRun(args, model_path, label, extra_env)
    try:
        gw.start(vocab)
        cells = {str(level): gw.run(level, seed=level) for level in args.levels_for(label)}
        ledger = gw.finish(list(cells.values()))
        return {"cells": cells, "ledger": ledger, "engine_process": bool(gw.engine_pids)}
    finally:
        gw.close()


def ledger_timings(db: Path | str, counts: list[int], skip: int = 0) -> list[tuple[float | None, float | None]]:
    """Per level (rows in insertion order after `skip` warm-up rows, levels one after another): the
    gateway's own view of the first token (ttft_ms, from the parsed request) and of the time queued
    (queue_ms), p50."""
    rows = ledger_query(db, "SELECT ttft_ms, queue_ms FROM ledger_entries ORDER BY id")
    out, start = [], skip
    for n in counts:
        part = rows[start : start + n]
        start += n
        out.append((pct([r[0] for r in part if r[0] is not None], 0.5), pct([r[1] for r in part if r[1] is not None], 0.5)))
    return out


def ledger_check(db: Path | str, requests: int, usage_tokens: int) -> dict[str, Any]:
    """The ledger's rows once the writer has caught up (bounded wait: it flushes every few ms)."""
    deadline = time.monotonic() + 30
    while True:
        rows = ledger_query(db, "SELECT status, count(*), coalesce(sum(completion_tokens), 0) FROM ledger_entries GROUP BY status")
        total = sum(r[1] for r in rows)
        if total >= requests or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    by_status = {r[0]: {"rows": int(r[1]), "completion_tokens": int(r[2])} for r in rows}
    completed = by_status.get("completed", {"rows": 0, "completion_tokens": 0})
    return {"rows": by_status, "exact": total == requests and completed["rows"] == requests and completed["completion_tokens"] == usage_tokens}


# the decode roofline --------------------------------------------------------------------------
HBM_BYTES_PER_S = 4.8e12  # H200
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "tie_word_embeddings")


def llama_bytes(config: dict[str, Any], dtype_bytes: int = 2) -> tuple[int, int]:
    """(bytes of weights, bytes of K and V per token of context) of a Llama-architecture model."""
    h, i, v, layers = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * i + 2 * h
    params = v * h * (1 if config.get("tie_word_embeddings") else 2) + layers * per_layer + h
    return params * dtype_bytes, layers * 2 * kv * hd * dtype_bytes


def roofline_tok_s(config: dict[str, Any], streams: int, isl: int, osl: int) -> float:
    """Output tokens/s if every decode step only read the weights and each stream's KV cache (mean
    context isl + osl/2) at the HBM bandwidth: the most a decode-bound engine can make."""
    weights, kv_per_token = llama_bytes(config)
    step_s = (weights + streams * (isl + osl / 2) * kv_per_token) / HBM_BYTES_PER_S
    return streams / step_s


def roofline_table(name: str, result: dict[str, Any], isl: int, osl: int) -> str:
    config = result["engine"].get("config")
    if not config:
        return f"(no model config recorded for {name}: pass --config {name}=DIR/config.json)"
    weights, kv = llama_bytes(config)
    lines = [f"decode roofline of {name}: {weights / 1e6:,.0f} MB of bf16 weights + {kv:,} B of KV per token of context, "
             f"read every step at {HBM_BYTES_PER_S / 1e12:.1f} TB/s",
             "| streams | engine tok/s | roofline tok/s | engine / roofline |", "|---:|---:|---:|---:|"]
    for level, cell in result["engine"]["cells"].items():
        roof = roofline_tok_s(config, int(level), isl, osl)
        lines.append(f"| {level} | {fmt(cell['tok_s'])} | {fmt(roof, 0)} | {cell['tok_s'] / roof:.2%} |")
    return "\n".join(lines)


# the report ------------------------------------------------------------------------------------
def fmt(v: Any, nd: int = 1) -> str:
    return "-" if v is None else (f"{v:,.{nd}f}" if isinstance(v, float) else str(v))


def table(name: str, result: dict[str, Any], args: argparse.Namespace) -> str:
    eng = result["engine"]["cells"]
    lines = [f"\n## {name}  (ISL {args.isl}, OSL {args.osl}, batch {args.batch_size}, {args.device})",
             "| variant | streams | tok/s | x engine | TTFT p50 ms | +ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ITL p99 x | gw CPU s/1k tok | engine proc CPU s/1k tok | errors | ledger TTFT p50 | ledger queue p50 | client send p50 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    gateways = [v for v in result if v.startswith("gateway")]
    for variant in ["engine", *gateways, *[v for v in ("inproc", "nosched") if v in result]]:
        for level, cell in result[variant]["cells"].items():
            base = eng.get(level, {})
            ratio = cell["tok_s"] / base["tok_s"] if variant != "engine" and base.get("tok_s") else None
            added = cell["ttft_p50_ms"] - base["ttft_p50_ms"] if variant != "engine" and base.get("ttft_p50_ms") is not None and cell["ttft_p50_ms"] is not None else None
            itl = cell["itl_p99_ms"] / base["itl_p99_ms"] if variant != "engine" and base.get("itl_p99_ms") and cell["itl_p99_ms"] else None
            cpu = cell.get("gateway_cpu_s_per_1k_tokens", cell.get("engine_cpu_s_per_1k_tokens"))
            lines.append(f"| {variant} | {level} | {fmt(cell['tok_s'])} | {fmt(ratio, 3)} | {fmt(cell['ttft_p50_ms'])} | {fmt(added)} | "
                         f"{fmt(cell['ttft_p99_ms'])} | {fmt(cell['itl_p50_ms'], 2)} | {fmt(cell['itl_p99_ms'], 2)} | {fmt(itl, 2)} | "
                         f"{fmt(cpu, 3)} | {fmt(cell.get('engine_process_cpu_s_per_1k_tokens'), 3)} | {cell['errors']} | "
                         f"{fmt(cell.get('ledger_ttft_p50_ms'))} | {fmt(cell.get('ledger_queue_p50_ms'))} | {fmt(cell.get('client_send_p50_ms'))} |")
    for variant in (*gateways, "inproc", "nosched"):
        if variant in result:
            lines.append(f"ledger ({variant}): {json.dumps(result[variant]['ledger'])}")
    return "\n".join(lines)


# side by side ----------------------------------------------------------------------------------
def interleaved(args: argparse.Namespace, name: str, path: str, report: dict[str, Any], json_path: Path) -> dict[str, Any]:
    """The engine alone and `tollgate serve` both loaded; for each level, `rounds` turns of each, the
    first side alternating, the same prompts on both sides of a round. Each side's cell is the median
    over its rounds; `paired` holds the round-by-round ratios and differences."""
    worker = EngineWorker(args, path)
    gateways = {gateway_label(n): GatewayRun(args, path, gateway_label(n), {}, workers=n) for n in args.gateway_workers}
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {"engine": {}, **{label: {} for label in gateways}}
    in_order: dict[str, list[dict[str, Any]]] = {label: [] for label in gateways}
    ledgers: dict[str, dict[str, Any]] = {}
    try:
        head = worker.ready()
        for gw in gateways.values():
            gw.start(head["vocab"])
        for level, count in zip(args.levels, args.rounds):
            for r in range(count):
                seed = level * 1000 + r
                sides = ["engine", *gateways]
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    if side == "engine":
                        cell = worker.run(level, seed)
                        print(f"  engine alone, {level} streams, round {r + 1}: {cell['tok_s']} tok/s", file=sys.stderr, flush=True)
                    else:
                        cell = gateways[side].run(level, seed)
                        in_order[side].append(cell)
                    rounds[side].setdefault(str(level), []).append(cell)
                report.setdefault("partial", {})[name] = rounds  # kept if the run is cut short
                json_path.parent.mkdir(parents=True, exist_ok=True)
                json_path.write_text(json.dumps(report, indent=1))
        for label, gw in gateways.items():
            ledgers[label] = gw.finish(in_order[label])
    finally:
        for gw in gateways.values():
            gw.close()
        worker.close()
    report.get("partial", {}).pop(name, None)
    result: dict[str, Any] = {"engine": {**head, "cells": {lv: median_cell(cs) for lv, cs in rounds["engine"].items()}, "rounds": rounds["engine"]}}
    for label, gw in gateways.items():
        result[label] = {"cells": {lv: median_cell(cs) for lv, cs in rounds[label].items()}, "rounds": rounds[label],
                         "ledger": ledgers[label], "engine_process": bool(gw.engine_pids), "workers": gw.workers,
                         "ledger_database": "postgres" if gw.database else "sqlite"}
        result[paired_key(label)] = {lv: paired(rounds["engine"][lv], rounds[label][lv]) for lv in rounds[label]}
    return result


def gateway_label(workers: int) -> str:
    return "gateway" if workers == 1 else f"gateway-w{workers}"


def paired_key(label: str) -> str:
    return "paired" if label == "gateway" else f"paired-{label.removeprefix('gateway-')}"


def median_cell(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell for several rounds: medians of the figures, errors summed."""
    out: dict[str, Any] = {"rounds": len(cells)}
    for key, first in cells[0].items():
        values = [c.get(key) for c in cells]
        if key in ("errors", "requests", "output_tokens", "usage_tokens"):
            out[key] = sum(v or 0 for v in values)
        elif key == "error_samples":
            out[key] = sorted({e for c in cells for e in c[key]})[:3]
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
        else:
            out[key] = first
    return out


def paired(engine: list[dict[str, Any]], gateway: list[dict[str, Any]]) -> dict[str, Any]:
    """Round by round, the gateway against the engine alone of the same round (same prompts)."""
    def each(f: Any) -> list[float | None]:
        return [f(e, g) for e, g in zip(engine, gateway)]

    rows = {"tok_s_x": each(lambda e, g: g["tok_s"] / e["tok_s"] if e.get("tok_s") and g.get("tok_s") else None),
            "ttft_added_ms": each(lambda e, g: g["ttft_p50_ms"] - e["ttft_p50_ms"] if None not in (e.get("ttft_p50_ms"), g.get("ttft_p50_ms")) else None),
            "itl_p99_x": each(lambda e, g: g["itl_p99_ms"] / e["itl_p99_ms"] if e.get("itl_p99_ms") and g.get("itl_p99_ms") else None)}
    return {**rows, "median": {k: statistics.median([v for v in vs if v is not None]) if any(v is not None for v in vs) else None
                               for k, vs in rows.items()}}


def paired_table(result: dict[str, Any], key: str = "paired") -> str:
    label = "gateway" if key == "paired" else "gateway-" + key.removeprefix("paired-")
    lines = [f"paired by round ({label} vs the engine alone of the same round; median, then each round):",
             "| streams | rounds | tok/s x engine | TTFT p50 +ms | ITL p99 x |", "|---:|---:|---|---|---|"]
    for level, p in result[key].items():
        def show(key: str, nd: int) -> str:
            return f"**{fmt(p['median'][key], nd)}** (" + ", ".join(fmt(v, nd) for v in p[key]) + ")"
        lines.append(f"| {level} | {len(p['tok_s_x'])} | {show('tok_s_x', 3)} | {show('ttft_added_ms', 1)} | {show('itl_p99_x', 2)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "engine-alone"])
    parser.add_argument("--model", action="append", default=[], help="NAME=PATH (a checkpoint directory); repeatable")
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--levels", default="1,16,64,256")
    parser.add_argument("--inproc-levels", default="64,256", help="levels for the in-process (before) layout; '' skips it")
    parser.add_argument("--isl", type=int, default=512)
    parser.add_argument("--osl", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--kv-cache-tokens", type=int, default=0)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--variants", default="engine,gateway,inproc")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "gpu_gateway_vs_engine.json"))
    parser.add_argument("--report", metavar="JSON", help="print the tables of a recorded run instead of measuring")
    parser.add_argument("--config", action="append", default=[], help="NAME=config.json for a recorded run without one (--report)")
    parser.add_argument("--rounds", help="N or one N per level (e.g. 1,1,3,3): the engine alone and the gateway loaded side by side, "
                                         "taking turns N times per level (who goes first alternates); medians and paired differences")
    parser.add_argument("--gateway-workers", default="1", help="with --rounds: one gateway side per count, e.g. 1,2 (`tollgate serve "
                                                                "--workers N` over one engine process; N > 1 needs --postgres and --redis)")
    parser.add_argument("--postgres", help="postgresql://user@host:port: each gateway's ledger in a fresh database there, its engine from a "
                                           "models file (as --workers needs), quotas in --redis; default: SQLite, TOLLGATE_* settings")
    parser.add_argument("--redis", help="redis://host:port/db for the gateways' quotas (with --postgres)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # engine-alone: levels named on stdin
    args = parser.parse_args(argv)
    if args.report:
        return report_of(args)
    args.levels = [int(x) for x in args.levels.split(",") if x]
    inproc_levels = [int(x) for x in args.inproc_levels.split(",") if x]
    args.levels_for = lambda label: args.levels if label == "gateway" else inproc_levels
    args.gateway_workers = [int(x) for x in args.gateway_workers.split(",")]
    if max(args.gateway_workers) > 1 and not (args.postgres and args.redis and args.rounds):
        parser.error("--gateway-workers above 1 needs --rounds, --postgres and --redis (several workers share one ledger and quotas)")
    if args.rounds:
        counts = [int(x) for x in args.rounds.split(",")]
        args.rounds = counts * len(args.levels) if len(counts) == 1 else counts
        if len(args.rounds) != len(args.levels) or min(args.rounds) < 1:
            parser.error("--rounds takes one count, or one per level")
        if args.kv_cache_tokens == 0 and args.mode == "compare":
            # Two engines share the GPU: neither may size its KV cache from all the free memory.
            args.kv_cache_tokens = -(-max(args.levels) * (args.isl + args.osl) * 5 // 4 // 4096) * 4096
            print(f"side by side: both engines get a KV cache of {args.kv_cache_tokens} tokens (--kv-cache-tokens)", file=sys.stderr)
    if args.mode == "engine-alone":
        print(json.dumps(asyncio.run(engine_alone(args))))
        return 0
    variants = args.variants.split(",")
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k not in ("levels_for", "model_path")}, "models": {}}
    for spec in args.model:
        name, _, path = spec.partition("=")
        if args.rounds:
            print(f"{name}: the engine alone and tollgate serve side by side, {args.rounds} rounds per level", file=sys.stderr, flush=True)
            result = interleaved(args, name, path, report, Path(args.json))
            vocab = result["engine"]["vocab"]
        else:
            print(f"{name}: engine alone", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "engine-alone", *engine_argv(args, path)], stdout=subprocess.PIPE, check=True)
            result = {"engine": json.loads(out.stdout.decode().strip().splitlines()[-1])}
            vocab = result["engine"]["vocab"]
            if "gateway" in variants:
                print(f"{name}: through tollgate serve", file=sys.stderr, flush=True)
                result["gateway"] = through_gateway(args, path, vocab, "gateway", {})
        for variant, env in (("inproc", {"TOLLGATE_ENGINE_PROCESS": "0"}), ("nosched", {"TOLLGATE_ENGINE_PROCESS": "0", "TOLLGATE_SCHEDULER": "0"})):
            if variant in variants and inproc_levels:
                print(f"{name}: through tollgate serve, {variant} ({env})", file=sys.stderr, flush=True)
                result[variant] = through_gateway(args, path, vocab, variant, env)
        report["models"][name] = result
        print(table(name, result, args), flush=True)
        for key in (k for k in result if k.startswith("paired")):
            print(paired_table(result, key), flush=True)
        print(roofline_table(name, result, args.isl, args.osl), flush=True)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {args.json}")
    return 0


def report_of(args: argparse.Namespace) -> int:
    recorded = json.loads(Path(args.report).read_text())
    settings = argparse.Namespace(**{**recorded["settings"], **{k: v for k, v in vars(args).items() if k == "report"}})
    configs = dict(spec.partition("=")[::2] for spec in args.config)
    for name, result in recorded["models"].items():
        if not result["engine"].get("config") and name in configs:
            full = json.loads(Path(configs[name]).read_text())
            result["engine"]["config"] = {k: full.get(k) for k in CONFIG_KEYS}
        print(table(name, result, settings))
        for key in (k for k in result if k.startswith("paired")):
            print(paired_table(result, key))
        print(roofline_table(name, result, settings.isl, settings.osl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
