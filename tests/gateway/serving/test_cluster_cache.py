"""The response cache on Redis Cluster (issue 24): with REDIS_URL naming the local cluster, a
cacheable request's second answer is a hit served from entries the cluster holds."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from tests.conftest import MODEL, Gateway

ON = {"X-Tollgate-Cache": "on"}


async def test_the_response_cache_lives_on_the_cluster(cluster_gateway: Gateway, client_for: Any, redis_cluster: Any) -> None:
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    client = client_for((await cluster_gateway.new_key())["key"], cluster_gateway)
    msgs = [{"role": "user", "content": f"Count from one to five. ({uuid.uuid4().hex[:6]})"}]

    async def chat() -> Any:
        raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                                                     extra_headers=ON)
        return raw.parse(), raw.headers

    first, h1 = await chat()
    assert h1.get("x-tollgate-cache") is None
    cluster = RedisCluster(startup_nodes=[ClusterNode(h, int(p)) for h, p in
                                          (n.split(":") for n in redis_cluster.url.removeprefix("redis+cluster://").split(","))])
    try:
        pattern = f"{cluster_gateway.settings.redis.prefix}rc:*"
        deadline = time.monotonic() + 10
        while not [k async for k in cluster.scan_iter(match=pattern)]:  # the entry is written after the answer
            assert time.monotonic() < deadline, "no cache entry on the cluster"
            await asyncio.sleep(0.05)
    finally:
        await cluster.aclose()
    second, h2 = await chat()
    assert h2.get("x-tollgate-cache") == "hit"
    assert second.choices[0].message.content == first.choices[0].message.content
