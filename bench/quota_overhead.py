"""What quotas cost: requests/s and p50/p99 latency with limits on vs off, same gateway, same run.

The gateway runs as in production (`tollgate serve`, Postgres ledger, Redis quotas) in front of
a fast mock upstream (openai backend), so the engine costs ~nothing and the gateway's own work
shows. "off": a key with no limits (no Redis call). "on": a key with rpm, tpm, max_concurrent,
monthly_tokens and monthly_spend set high enough never to refuse. Rounds alternate the order;
figures are medians over rounds. Redis round trips per request come from INFO commandstats.

    python bench/quota_overhead.py --rounds 3 --seconds 5 --connections 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import loadgen  # noqa: E402
from bench.harness import REDIS, fresh_database, gateway, make_key, mock_upstream  # noqa: E402

LIMITS = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6, "monthly_tokens": 10**14, "monthly_spend": "1000000"}


def evalsha_calls(r: redis.Redis) -> int:
    stats = r.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def measure(base: str, key: str, connections: int, seconds: float) -> loadgen.Result:
    url = urlparse(base)
    body = json.dumps({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}).encode()
    request = loadgen.build_request(url.hostname or "127.0.0.1", url.port or 80, "/v1/chat/completions", body,
                                    {"authorization": f"Bearer {key}"})
    return asyncio.run(loadgen.run(url.hostname or "127.0.0.1", url.port or 80, request, connections, seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--json", default="bench/results/quota_overhead.json")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    prefix = "tgbench:q:"
    r = redis.Redis.from_url(REDIS)
    with fresh_database() as db, mock_upstream() as upstream, gateway(
        db, upstream, extra_env={"REDIS_URL": REDIS, "TOLLGATE_REDIS_PREFIX": prefix}
    ) as (base, admin):
        keys = {"off": make_key(base, admin), "on": make_key(base, admin, limits=LIMITS)}
        httpx.post(f"{base}/admin/prices", headers={"Authorization": f"Bearer {admin}"},
                   json={"model": "mock", "input_per_million": "0.150", "output_per_million": "0.600"}).raise_for_status()
        for mode in ("off", "on"):
            measure(base, keys[mode], args.connections, 1.0)  # warm up
        runs: dict[str, list[loadgen.Result]] = {"off": [], "on": []}
        trips: list[float] = []
        for i in range(args.rounds):
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                before = evalsha_calls(r)
                result = measure(base, keys[mode], args.connections, args.seconds)
                # Settlements finish just after their response; let them land before reading the counter.
                asyncio.run(asyncio.sleep(0.3))
                calls = evalsha_calls(r) - before
                runs[mode].append(result)
                if mode == "on":
                    trips.append(calls / max(1, len(result.latencies)))
                print(f"round {i + 1} {mode:3}: {result.rps:8.0f} req/s  p50 {result.p50 * 1e3:6.2f} ms  "
                      f"p99 {result.pct(0.99) * 1e3:6.2f} ms  statuses {result.statuses}  redis scripts {calls}", flush=True)

    summary: dict[str, Any] = {}
    for mode, results in runs.items():
        summary[mode] = {
            "rps": statistics.median(x.rps for x in results),
            "p50_ms": statistics.median(x.p50 for x in results) * 1e3,
            "p99_ms": statistics.median(x.pct(0.99) for x in results) * 1e3,
            "non_200": sum(n for x in results for s, n in x.statuses.items() if s != 200),
        }
    ratio = summary["on"]["rps"] / summary["off"]["rps"]
    summary["throughput_ratio_on_off"] = ratio
    summary["redis_round_trips_per_request"] = statistics.median(trips)
    print(f"\n{'limits':8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for mode in ("off", "on"):
        s = summary[mode]
        print(f"{mode:8} {s['rps']:>9.0f} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f}")
    print(f"\nthroughput with limits / without: {ratio:.3f}  (target >= 0.85: {'PASS' if ratio >= 0.85 else 'FAIL'})")
    print(f"Redis round trips per request (reserve + settle): {summary['redis_round_trips_per_request']:.2f}  "
          f"(target <= 2: {'PASS' if summary['redis_round_trips_per_request'] <= 2.01 else 'FAIL'})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
