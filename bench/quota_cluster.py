"""What Redis Cluster costs the quota client: reserve+settle pairs through RedisLimiter on one
Redis (lean scripts, billing/quota/resp.py), on one Redis through redis-py, and on a private local Redis
Cluster (3 masters + 3 replicas started here, tests/redis_topologies.py) through redis-py, same
process, same run. Reported: pairs/s and this process's CPU time per pair (Redis' own work is not
in it). Keys live under a fresh prefix, deleted after.

    python bench/quota_cluster.py --pairs 3000 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.quota_client import HIGH, NoLedger  # noqa: E402
from billing.quota import RedisLimiter, Scope  # noqa: E402


async def pairs(url: str, lean: bool, n: int, concurrency: int) -> tuple[float, float]:
    lim = RedisLimiter(url, NoLedger(), prefix=f"tgbench:{uuid.uuid4().hex[:8]}:", timeout=1.0, lean=lean)  # type: ignore[arg-type]
    scopes = [Scope("key", 1, HIGH), Scope("account", 1, HIGH)]
    try:
        await lim.reserve("warm-" + uuid.uuid4().hex, scopes, 1, 0)  # seeds the counters, loads the scripts

        async def worker() -> None:
            for _ in range(n // concurrency):
                hold = await lim.reserve(uuid.uuid4().hex, scopes, 10, 0)
                await lim.settle(hold, 5, 0)

        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        done = n // concurrency * concurrency
        return done / (time.perf_counter() - wall), (time.process_time() - cpu) / done
    finally:
        await lim.flush_all()
        await lim.close()


def main() -> None:
    from tests.redis_topologies import LocalCluster

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0", help="the one Redis")
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="tg-cluster-"))).start()
    try:
        base = None
        for name, url, lean in (("one Redis, lean", args.url, True), ("one Redis, redis-py", args.url, False),
                                ("Redis Cluster, redis-py", cluster.url, False)):
            rate, cpu = asyncio.run(pairs(url, lean, args.pairs, args.concurrency))
            base = base or cpu
            print(f"{name:24s} {rate:8,.0f} pairs/s  {cpu * 1e6:6.0f} us CPU/pair  ({cpu / base:.2f}x lean)")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
