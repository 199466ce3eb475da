"""What the quota store's client costs: reserve+settle pairs per second through RedisLimiter, with the
scripts run by billing/quota/resp.py (lean) and by redis-py's Script objects, same Redis, same process.

Each pair is one reserve (RESERVE_LUA) and one settle (SETTLE_LUA) on two scopes (a key and its
account, limits high enough never to refuse), as an admitted request does, and the ledger writer's
confirmation of its row (struck off `unc` with a later settlement). `concurrency` workers
share one limiter and each runs its share of the pairs back to back. Reported: pairs/s, script
calls/s (two per pair) and this process's CPU time per pair (Redis's own work is not in it), for
redis-py and lean side by side, and lean/redis-py. The event loop is uvloop when installed (as
`tollgate serve` runs), or asyncio's with --no-uvloop. Keys live under a fresh prefix, deleted after.

    python bench/quota_client.py --pairs 20000 --concurrency 1 64
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from billing.quota.limits import Limits  # noqa: E402
from billing.quota import RedisLimiter, Scope, ScopeTotals  # noqa: E402

HIGH = Limits(rpm=10**9, tpm=10**12, max_concurrent=10**6, monthly_tokens=10**14, monthly_spend=Decimal("1000000"))


class Written(NamedTuple):
    """A ledger row as RedisLimiter.written reads it."""

    request_id: str
    account_id: int


class NoLedger:
    """Counters start from an empty ledger: the first reserve seeds them, nothing else reads it."""

    async def for_scopes(self, scopes: list[Scope], now: float) -> dict[str, ScopeTotals]:
        return {s.name: ScopeTotals() for s in scopes}


async def redis_stats(url: str) -> tuple[int, int, float]:
    """Redis' own count of bytes received and sent and its CPU seconds (INFO): every client's, so use
    a private Redis."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        stats, cpu = await client.info("stats"), await client.info("cpu")
        return int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"]), cpu["used_cpu_user"] + cpu["used_cpu_sys"]
    finally:
        await client.aclose()


NET: dict[tuple[bool, int], tuple[float, float, float]] = {}  # (lean, concurrency) -> bytes to / from Redis, its CPU s per pair


async def measure(url: str, lean: bool, pairs: int, concurrency: int) -> tuple[float, float]:
    """(pairs per second, CPU seconds per pair) for one client path at one concurrency."""
    prefix = f"tgbench:qc:{uuid.uuid4().hex[:8]}:"
    limiter = RedisLimiter(url, NoLedger(), prefix=prefix, timeout=1.0, lean=lean)  # type: ignore[arg-type]
    assert limiter.lean is lean
    scopes = [Scope("key", 1, HIGH), Scope("account", 1, HIGH)]
    run = uuid.uuid4().hex[:8]

    async def worker(w: int, count: int) -> None:
        for i in range(count):
            hold = await limiter.reserve(f"{run}-{w}-{i}", scopes, 120, 600)
            await limiter.settle(hold, 100, 500)
            limiter.written([Written(hold.request_id, 1)])  # its row confirmed, as the ledger writer says it

    try:
        await worker(-1, 50)  # seeds the counters, loads the scripts, opens connections
        await asyncio.gather(*[worker(-2 - w, 2) for w in range(concurrency)])
        share = [pairs // concurrency + (1 if w < pairs % concurrency else 0) for w in range(concurrency)]
        sent, received, redis_cpu = await redis_stats(url)
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*[worker(w, n) for w, n in enumerate(share)])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        sent2, received2, redis_cpu2 = await redis_stats(url)
        NET[(lean, concurrency)] = ((sent2 - sent) / pairs, (received2 - received) / pairs, (redis_cpu2 - redis_cpu) / pairs)
    finally:
        await limiter.flush_all()
        await limiter.close()
    return pairs / wall, cpu / pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--pairs", type=int, default=20000, help="reserve+settle pairs per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--no-uvloop", action="store_true")
    args = parser.parse_args()
    loop_name = "asyncio"
    if not args.no_uvloop:
        try:
            import uvloop

            uvloop.install()
            loop_name = "uvloop"
        except ImportError:
            pass

    print(f"{args.pairs} reserve+settle pairs per cell, 2 scopes, {loop_name}, {args.url}")
    print(f"{'conc':>5} | {'redis-py pairs/s':>16} {'calls/s':>8} {'CPU us/pair':>11} | "
          f"{'lean pairs/s':>12} {'calls/s':>8} {'CPU us/pair':>11} | {'speed x':>7} {'CPU x':>6}")
    for concurrency in args.concurrency:
        old_rate, old_cpu = asyncio.run(measure(args.url, False, args.pairs, concurrency))
        new_rate, new_cpu = asyncio.run(measure(args.url, True, args.pairs, concurrency))
        print(f"{concurrency:>5} | {old_rate:>16.0f} {2 * old_rate:>8.0f} {old_cpu * 1e6:>11.0f} | "
              f"{new_rate:>12.0f} {2 * new_rate:>8.0f} {new_cpu * 1e6:>11.0f} | "
              f"{new_rate / old_rate:>7.2f} {old_cpu / new_cpu:>6.2f}")
    for (lean, concurrency), (to_redis, from_redis, redis_cpu) in sorted(NET.items()):
        print(f"per pair ({'lean' if lean else 'redis-py'}, concurrency {concurrency}): {to_redis:,.0f} bytes to Redis, "
              f"{from_redis:,.0f} back, Redis CPU {redis_cpu * 1e6:,.0f} us (Redis' INFO: every client's; use a private Redis)")


if __name__ == "__main__":
    main()
