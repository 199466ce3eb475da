"""Time to first token per account with the gateway's scheduler on and off, in one run.

    .venv/bin/python bench/fairness.py [--capacity 4] [--flood 60] [--light 5] [--tokens 16] [--every 2.0] [--rounds 2]

One hf engine (the embedded SmolLM2 on CPU, batch size `--capacity`) serves three gateways in
turn, each on a fresh SQLite ledger: the scheduler off (the engine's own first-come-first-served
queue), on with one reserved slot (the default), and on without a reserve. In each, account A
floods `--flood` streaming requests at once; a second later account B, a light user, sends
`--light` requests one every `--every` seconds. Printed: TTFT p50/p99 per account, A's tokens/s,
and B's TTFT against B alone on the idle engine. Run it from the repository root; not a test.
On a machine shared with other jobs, OMP_NUM_THREADS=1 keeps torch's threads from stalling the
engine for seconds (docs/scheduling.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import ServerThread  # noqa: E402
from billing import migrate  # noqa: E402
from billing.db import create_engine  # noqa: E402
from billing.keys.store import KeyStore  # noqa: E402
from engines.backends.hf import HFEngine  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.config import DEFAULT_MODEL_ID, Settings, default_cache_dir  # noqa: E402

SECRET = "bench-fairness-secret"


def keys_for(db_url: str, names: list[str]) -> list[str]:
    async def make() -> list[str]:
        db = create_engine(db_url)
        try:
            store = KeyStore(db, SECRET.encode())
            out = []
            for name in names:
                account = await store.create_account(name)
                out.append(str((await store.create_key(account["id"]))["key"]))
            return out
        finally:
            await db.dispose()

    return asyncio.run(make())


async def stream(client: httpx.AsyncClient, key: str, max_tokens: int, text: str) -> tuple[float, list[float]]:
    """(time sent, arrival of each content chunk)."""
    body = {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, "stream": True}
    sent, times = time.perf_counter(), []
    async with client.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                choices = orjson.loads(line[6:]).get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
    return sent, times


async def workload(base: str, a: str, b: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.flood + args.light + 10)
    async with httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as client:
        await stream(client, b, 4, "Hello.")  # warms the key cache and quota scopes
        await stream(client, a, 4, "Hello.")
        idle = [await stream(client, b, args.tokens, f"Tell me fact {i} about the moon.") for i in range(3)]
        started = time.perf_counter()
        flood = [asyncio.create_task(stream(client, a, args.tokens, f"Tell me fact {i} about the sea.")) for i in range(args.flood)]
        await asyncio.sleep(1.0)
        light = []
        for i in range(args.light):
            light.append(asyncio.create_task(stream(client, b, args.tokens, f"Tell me fact {i} about the moon.")))
            await asyncio.sleep(args.every)
        a_runs, b_runs = await asyncio.gather(*flood), await asyncio.gather(*light)
        ended = time.perf_counter()
    # A's token rate while B's requests were in flight against just before B's first one: what
    # B's presence costs A, under the same policy (the reserve's own cost is in "vs off").
    a_times = [t for _, ts in a_runs for t in ts]
    b_first, b_last = min(s for s, _ in b_runs), max(ts[-1] for _, ts in b_runs)
    a_first = min(a_times)
    before = sum(a_first <= t < b_first for t in a_times) / max(b_first - a_first, 1e-9)
    during = sum(b_first <= t < b_last for t in a_times) / max(b_last - b_first, 1e-9)
    b_tokens = sum(len(ts) for _, ts in b_runs)
    a_tokens = sum(len(t) for _, t in a_runs)
    all_tokens = a_tokens + sum(len(t) for _, t in b_runs)
    last = max(t[-1] for _, t in a_runs + b_runs)
    return {
        "a_ttft": [t[0] - s for s, t in a_runs],
        "b_ttft": [t[0] - s for s, t in b_runs],
        "b_idle_ttft": [t[0] - s for s, t in idle],
        "a_tokens_per_s": a_tokens / (max(t[-1] for _, t in a_runs) - started),
        "all_tokens_per_s": all_tokens / (last - started),
        "seconds": ended - started,
        "a_rate_before_b": before,
        "a_rate_during_b": during,
        "b_share_during": b_tokens / max(b_tokens + sum(b_first <= t < b_last for t in a_times), 1),
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_mode(engine: HFEngine, label: str, overrides: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="tollgate-fairness-"))
    db_url = f"sqlite:///{tmp / 'tollgate.db'}"
    migrate.upgrade(db_url)
    a, b = keys_for(db_url, ["flooder", "light"])
    settings = Settings(database_url=db_url, server_secret=SECRET, data_dir=tmp).with_overrides(**overrides)
    with ServerThread(create_app(settings, engines={engine.model_id: engine})) as server:
        result = asyncio.run(workload(f"http://127.0.0.1:{server.port}", a, b, args))
    result["mode"] = label
    print(f"  {label}: done in {result['seconds']:.0f}s, A {result['a_tokens_per_s']:.1f} tokens/s, all {result['all_tokens_per_s']:.1f}", flush=True)
    return result


async def warm_up(engine: HFEngine, capacity: int) -> None:
    """Runs every batch size once: the first batch of a new size is much slower on CPU."""
    from engines.base import EngineRequest

    async def one(i: int, n: int) -> None:
        request = EngineRequest(request_id=f"warm-{n}-{i}", max_tokens=4, prompt_token_ids=engine.encode_text(f"Warm up {i}."))
        async for _ in engine.stream(request):
            pass

    for n in range(1, capacity + 2):
        await asyncio.gather(*(one(i, n) for i in range(n)))


def merged(label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode over its rounds: the TTFTs pooled, tokens/s the median."""
    return {
        "mode": label,
        "a_ttft": [t for r in runs for t in r["a_ttft"]],
        "b_ttft": [t for r in runs for t in r["b_ttft"]],
        "b_idle_ttft": [t for r in runs for t in r["b_idle_ttft"]],
        "a_tokens_per_s": statistics.median(r["a_tokens_per_s"] for r in runs),
        "all_tokens_per_s": statistics.median(r["all_tokens_per_s"] for r in runs),
        "a_during_over_before": statistics.median(r["a_rate_during_b"] / r["a_rate_before_b"] for r in runs),
        "b_share_during": statistics.median(r["b_share_during"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=int, default=4, help="the engine's batch size: requests it runs at once")
    parser.add_argument("--flood", type=int, default=60, help="requests account A sends at once")
    parser.add_argument("--light", type=int, default=5, help="requests account B sends, one every --every seconds")
    parser.add_argument("--every", type=float, default=2.0)
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens of every request")
    parser.add_argument("--rounds", type=int, default=1, help="run the modes this many times, alternating; each figure is the median")
    parser.add_argument("--device", default="cpu", help="torch device of the hf engine, e.g. cuda (default cpu)")
    parser.add_argument("--model-path", help="a checkpoint directory instead of the embedded SmolLM2 (e.g. bench/gpu_fairness.sh's)")
    parser.add_argument("--json", type=Path, help="also write the per-mode figures here")
    args = parser.parse_args(argv)

    engine = HFEngine(model_id=DEFAULT_MODEL_ID, model_path=args.model_path, device=args.device, cache_dir=default_cache_dir(os.environ),
                      max_batch_size=args.capacity, max_queue=args.flood + args.light + 16)
    asyncio.run(engine.start())
    asyncio.run(warm_up(engine, args.capacity))
    patient = {"classes": "interactive:3600,batch:3600"}  # the flood queues, nothing is refused
    modes = [
        ("scheduler off", {"scheduler": {"enabled": False}}),
        ("on, reserve 1", {"scheduler": {"reserve": 1, **patient}}),
        ("on, reserve 0", {"scheduler": {"reserve": 0, **patient}}),
    ]
    print(f"hf engine on {args.device}, batch size {args.capacity}; A floods {args.flood} x {args.tokens} tokens, "
          f"B sends {args.light} one every {args.every:g}s", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in modes}
    try:
        for i in range(args.rounds):
            for label, overrides in modes if i % 2 == 0 else modes[::-1]:  # alternate, against drift in machine load
                runs[label].append(run_mode(engine, label, overrides, args))
    finally:
        asyncio.run(engine.stop())
    results = [merged(label, runs[label]) for label, _ in modes]

    off = results[0]
    print()
    print(f"{'mode':<16} {'A p50':>8} {'A p99':>8} {'B p50':>8} {'B p99':>8} {'B idle p50':>10} {'B p50/idle':>10} "
          f"{'A tok/s':>8} {'vs off':>7} {'all tok/s':>9} {'vs off':>7} {'A during/before B':>17} {'B share':>7}")
    for r in results:
        b_idle = statistics.median(r["b_idle_ttft"])
        print(
            f"{r['mode']:<16} {pct(r['a_ttft'], .5):>7.2f}s {pct(r['a_ttft'], .99):>7.2f}s {pct(r['b_ttft'], .5):>7.2f}s "
            f"{pct(r['b_ttft'], .99):>7.2f}s {b_idle:>9.2f}s {pct(r['b_ttft'], .5) / b_idle:>9.2f}x {r['a_tokens_per_s']:>8.1f} "
            f"{r['a_tokens_per_s'] / off['a_tokens_per_s']:>6.2f}x {r['all_tokens_per_s']:>9.1f} "
            f"{r['all_tokens_per_s'] / off['all_tokens_per_s']:>6.2f}x {r['a_during_over_before']:>16.2f}x {r['b_share_during'] * 100:>6.1f}%"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(orjson.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "modes": results,
                                           "rounds": runs}, option=orjson.OPT_INDENT_2).decode())
    print("\nTTFT in seconds from sending; B idle: B alone on the idle engine just before the flood, same mode.\n"
          "A tok/s: A's tokens over A's run (B's share comes out of it); all tok/s: every token over the whole run.\n"
          "A during/before B: A's tokens/s while B's requests ran over A's just before B's first, same mode; B share: B's part of\n"
          "all tokens while B ran (the issue: A is not reduced by more than that).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
