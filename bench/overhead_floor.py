"""How much of what the gateway adds is work, and how much is layers: Tollgate beside a floor server.

The floor server (`--serve`, started by this script in its own process) does, per request, the work
a metered non-streaming chat completion cannot do without, with the project's own parts and none of
the request path's layers: uvicorn (httptools, uvloop), the JSON body parsed, the key's HMAC
computed (billing.keys.store.hash_key) and compared, the prompt counted with tiktoken, the quota reserved with the limiter's own Redis script through
billing.quota.resp (one round trip), the admission journaled, the upstream asked through the lean client
(engines.backends.upstream_http: streamed, 16 chunks and usage, every event parsed), the body rendered and
sent, the final row journaled and queued to the real LedgerWriter (Postgres batches), the quota
settled (lingering, as the gateway does). No Starlette, no request objects, no engine chain, no
scheduler, no metrics, no logs.

The two run against the same mock upstream, Redis and Postgres, driven alternately by the same load
generator (wrk, one connection, non-streaming), several rounds; printed: req/s, p50 and CPU per
request of each, and Tollgate's CPU over the floor's. The floor is what a request path made of
these parts could approach; the rest is the layers' cost.

    python bench/overhead_floor.py --rounds 5 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import REDIS, delete_redis_keys, free_port, mock_upstream, process, wait_http  # noqa: E402
from bench.overhead import LIMITS, drive, gateway_root, listening_pid, tollgate_as_in_production, tree_cpu_seconds  # noqa: E402

PREFIX_ENV = "FLOOR_REDIS_PREFIX"


# ---------------------------------------------------------------- the floor server

def floor_app(upstream: str, database_url: str, key: str, data_dir: Path) -> Any:
    import orjson
    from sqlalchemy import text

    from billing.quota import resp
    from billing.db import create_engine
    from billing.ledger.journal import LedgerJournal
    from billing.keys.store import hash_key
    from billing.quota.limits import Limits
    from billing.ledger.writer import LedgerWriter, UsageRecord
    from billing.quota import RESERVE_LUA, SETTLE_LUA, Hold, RedisLimiter, LedgerTotals, Scope, minute_of, month_of
    from engines.backends.openai_stream import TokenCounter
    from engines.backends.upstream_http import UpstreamPool

    state: dict[str, Any] = {}
    settling: set[asyncio.Task[Any]] = set()  # settlements in flight, held until done (as the gateway holds them)
    secret = uuid.uuid4().bytes
    key_hash = hash_key(secret, key)
    counter = TokenCounter("cl100k_base")  # offline, as the openai backend counts
    counter.load()
    url = upstream.rstrip("/") + "/chat/completions"
    up_headers = {"content-type": "application/json", "accept": "text/event-stream"}
    prefix = os.environ[PREFIX_ENV]
    reserve, settle = resp.Script(RESERVE_LUA), resp.Script(SETTLE_LUA)
    limits = Limits(rpm=LIMITS["rpm"], tpm=LIMITS["tpm"], max_concurrent=LIMITS["max_concurrent"],
                    monthly_tokens=LIMITS["monthly_tokens"])

    async def startup() -> None:
        db = create_engine(database_url)
        async with db.connect() as conn:
            row = (await conn.execute(text("SELECT id, account_id FROM api_keys ORDER BY id LIMIT 1"))).one()
        scopes = [Scope("key", row[0], limits), Scope("account", row[1], limits)]
        ledger = LedgerWriter(db, journal=LedgerJournal(data_dir / "journal"), linger=0.02)
        ledger.recover()
        ledger.start()
        limiter = RedisLimiter(REDIS, LedgerTotals(db), prefix=prefix)
        await limiter.reserve("warm-" + uuid.uuid4().hex, scopes, 1, 0)  # seeds this window's counters
        state.update(db=db, ledger=ledger, limiter=limiter, scopes=scopes, ids=(row[0], row[1]),
                     runner=resp.ScriptRunner(REDIS, timeout=0.05), pool=UpstreamPool(connect_timeout=5.0, keepalive_expiry=30.0))

    async def read_body(receive: Any) -> bytes:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                return b"".join(chunks)

    async def respond(send: Any, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async def complete(scope: dict[str, Any], receive: Any, send: Any) -> None:
        started = time.perf_counter()
        auth = dict(scope["headers"]).get(b"authorization", b"")
        if hash_key(secret, auth[7:].decode("latin-1")) != key_hash:
            await respond(send, 401, b'{"error":{"message":"bad key"}}')
            return
        req = orjson.loads(await read_body(receive))
        prompt = len(counter.encode_chat(req["messages"]))
        max_tokens = req.get("max_tokens") or 256
        rid = "floor-" + uuid.uuid4().hex  # its ledger rows are told apart by this prefix
        now = time.time()
        scopes = state["scopes"]
        minute, month = minute_of(now), month_of(now)
        group = state["limiter"].group(f"a{scopes[1].id}")  # the account's keys: one hash slot
        hold = Hold(rid, tuple(scopes), prompt + max_tokens, 0, minute, month, tag=f"a{scopes[1].id}")
        args = state["limiter"].reserve_args(hold, now)  # as the limiter sends it, process mark included
        result = await state["runner"].evalsha(reserve, args)
        if result[0] == "sync":  # a new minute: counters rebuilt through the limiter, as the gateway does
            hold = await state["limiter"].reserve(rid, scopes, prompt + max_tokens, 0)
            result = ["ok"] if not hold.degraded else ["deny"]
        if result[0] != "ok":
            await respond(send, 429, orjson.dumps({"error": {"message": f"quota: {result[0]}"}}))
            return
        key_id, account_id = state["ids"]
        record = UsageRecord(rid, account_id, key_id, "mock", prompt, 0, "interrupted", None, 0.0)
        state["ledger"].admitted(record, {"request_id": rid, "tokens": prompt + max_tokens})
        upstream_body = dict(req, model="mock", stream=True, stream_options={"include_usage": True})
        exchange = state["pool"].exchange(url, orjson.dumps(upstream_body), up_headers)
        pieces: list[str] = []
        usage: dict[str, Any] | None = None
        finish = None
        while True:
            kind, value = await exchange.queue.get()
            if kind == "events":
                for data in value:
                    if data.strip() == b"[DONE]":
                        continue
                    chunk = orjson.loads(data)
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        pieces.append(choice["delta"].get("content") or "")
                        finish = choice.get("finish_reason") or finish
            elif kind == "eof":
                break
            else:
                await exchange.close()
                await respond(send, 502, b'{"error":{"message":"upstream"}}')
                return
        await exchange.close(grace=1.0)
        usage = usage or {"prompt_tokens": prompt, "completion_tokens": len(pieces)}
        body = orjson.dumps({
            "id": "chatcmpl-" + rid, "object": "chat.completion", "created": int(now), "model": "mock",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(pieces)}, "logprobs": None,
                         "finish_reason": finish or "stop"}],
            "usage": {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
        })
        record.prompt_tokens, record.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        record.status, record.finish_reason = "completed", finish or "stop"
        record.total_ms = (time.perf_counter() - started) * 1000.0
        state["ledger"].record(record)
        settle_args = [group, rid, month, record.prompt_tokens + record.completion_tokens, 0, len(scopes),
                       *[s.name for s in scopes], 900]
        task = asyncio.get_running_loop().create_task(state["runner"].evalsha(settle, settle_args, 0.002))
        settling.add(task)
        task.add_done_callback(settling.discard)
        await respond(send, 200, body)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await startup()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await state["ledger"].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/health":
            await respond(send, 200, b"{}")
            return
        await complete(scope, receive, send)

    return app


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    app = floor_app(args.upstream, args.database_url, args.key, Path(args.data_dir))
    uvicorn.run(app, host="127.0.0.1", port=args.serve, loop="uvloop", http="httptools", access_log=False,
                log_level="warning", lifespan="on")


# ---------------------------------------------------------------- the comparison

def measure(base: str, key: str, seconds: int) -> dict[str, Any]:
    root = gateway_root(listening_pid(int(base.rsplit(":", 1)[1])))
    before = tree_cpu_seconds(root)
    result = drive(base, key, False, 1, seconds)
    result["cpu_us"] = (tree_cpu_seconds(root) - before) * 1e6 / max(1, result["requests"])
    return result


def floor_rows(database_url: str, timeout: float = 60.0) -> int:
    """The floor's completed ledger rows once its writer has flushed (the same count twice, a second apart)."""
    import asyncpg

    async def count() -> int:
        conn = await asyncpg.connect(database_url)
        try:
            return int(await conn.fetchval(
                "SELECT count(*) FROM ledger_entries WHERE request_id LIKE 'floor-%' AND status = 'completed'"))
        finally:
            await conn.close()

    deadline, last = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        now = asyncio.run(count())
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--json", default="bench/results/overhead-floor.json")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--database-url", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return

    with ExitStack() as stack:
        upstream = stack.enter_context(mock_upstream())
        db, tollgate, key = tollgate_as_in_production(stack, upstream, {})
        prefix = f"tgbench:f:{uuid.uuid4().hex[:6]}:"
        stack.callback(delete_redis_keys, prefix)
        port = free_port()
        data_dir = tempfile.mkdtemp(prefix="tollgate-floor-")
        stack.callback(shutil.rmtree, data_dir, ignore_errors=True)  # after the floor server has stopped
        cmd = [sys.executable, __file__, "--serve", str(port), "--upstream", upstream, "--database-url", db, "--key", key,
               "--data-dir", data_dir]
        proc = stack.enter_context(process(cmd, dict(os.environ, **{PREFIX_ENV: prefix}), Path(data_dir) / "floor.log"))
        floor = f"http://127.0.0.1:{port}"
        wait_http(f"{floor}/health", proc)
        targets = {"floor": floor, "tollgate": tollgate}
        floor_2xx = 0
        for name, base in targets.items():
            warm = drive(base, key, False, 1, 1)  # warm-up
            floor_2xx += warm["ok"] if name == "floor" else 0
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
        for r in range(args.rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in order:
                res = measure(targets[name], key, args.seconds)
                if res["non2xx"] or res["socket_errors"]:
                    raise SystemExit(f"{name}: {res['non2xx']} non-2xx, {res['socket_errors']} socket errors")
                runs[name].append(res)
                floor_2xx += res["ok"] if name == "floor" else 0
                print(f"round {r + 1} {name:8}: {res['rps']:7.0f} req/s  p50 {res['p50_ms']:5.2f} ms  cpu {res['cpu_us']:6.0f} us/req",
                      flush=True)
        summary = {name: {k: statistics.median(x[k] for x in rs) for k in ("rps", "p50_ms", "p99_ms", "cpu_us")} for name, rs in runs.items()}
        print(f"\nmedians of {args.rounds} rounds x {args.seconds} s, one connection, non-streaming, wrk")
        for name, s in summary.items():
            print(f"  {name:8}  {s['rps']:7.0f} req/s  p50 {s['p50_ms']:5.2f} ms  p99 {s['p99_ms']:5.2f} ms  cpu {s['cpu_us']:6.0f} us/req")
        ratio = summary["tollgate"]["cpu_us"] / summary["floor"]["cpu_us"]
        print(f"  Tollgate CPU per request / floor: x{ratio:.2f}  (layers: {summary['tollgate']['cpu_us'] - summary['floor']['cpu_us']:.0f} us/req)")
        # The floor did the work it stands for: every answer it gave has its completed ledger row (wrk
        # stops with at most one request in flight per run, which is metered too).
        rows = floor_rows(db)
        ledger_ok = floor_2xx <= rows <= floor_2xx + 1 + args.rounds
        print(f"  floor ledger: {floor_2xx} 2xx, {rows} completed rows: {'PASS' if ledger_ok else 'FAIL'}")
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rounds": runs, "medians": summary, "cpu_ratio": ratio,
                                   "floor_ledger": {"ok_2xx": floor_2xx, "rows": rows, "pass": ledger_ok}}, indent=2))
        print(f"wrote {out}")
        if not ledger_ok:
            raise SystemExit("the floor's ledger rows do not match its answers")


if __name__ == "__main__":
    main()
