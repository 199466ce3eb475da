"""The quota scripts and the one client that runs them.

The Lua sources live in billing/quota/lua/ (each script is `common.lua` followed by its own file)
and are read once, when this module is imported. `ScriptClient` is the limiter's only way to
Redis: scripts go through billing/quota/resp.py's pipelined connection where the URL allows it (the
lean path: a fraction of redis-py's CPU per call), through redis-py otherwise; the few plain
commands (epoch bumps, SCAN, counters) always go through redis-py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

from billing.quota import redis_url, resp

LUA_DIR = Path(__file__).with_name("lua")


def load(name: str) -> str:
    """The source of one script: the shared preamble, then `lua/<name>.lua`."""
    return (LUA_DIR / "common.lua").read_text() + (LUA_DIR / f"{name}.lua").read_text()


RESERVE_LUA, SETTLE_LUA, SEED_LUA, REHOLD_LUA, CREDIT_LUA, RECOVER_LUA, RENEW_LUA, FORGET_LUA = (
    load(n) for n in ("reserve", "settle", "seed", "rehold", "credit", "recover", "renew", "forget"))


class ScriptClient:
    """Runs the quota scripts (EVALSHA, EVAL when Redis does not have one yet) and plain commands.

    `url`: any form billing/quota/redis_url.py reads (one Redis, Redis Cluster, Sentinel). `lean`: scripts
    through billing.quota.resp where the URL is redis://; redis-py's Script objects otherwise (rediss://,
    unix://, Cluster, Sentinel, or lean=False). `redis` is the redis-py client for the rest.
    """

    def __init__(self, url: str, *, timeout: float, max_connections: int = 64, lean: bool = True) -> None:
        target = redis_url.parse(url)
        self.redis: Any = redis_url.connect(target, timeout=timeout, max_connections=max_connections, decode_responses=True,
                                            blocking_pool=True)
        self._replicated = target.replicated
        self._kind = target.kind
        # Cluster and Sentinel pools refuse a call beyond max_connections (one Redis's blocking pool
        # queues it): callers queue here instead.
        self._gate = asyncio.Semaphore(max_connections) if target.replicated else None
        self._started: asyncio.Task[None] | None = None
        self._scripts: list[Any] = []
        lean = lean and target.kind == "single" and resp.ScriptRunner.supports(url)
        self._runner = resp.ScriptRunner(url, timeout=timeout, connect_timeout=timeout) if lean else None
        if self._runner is not None:
            self.run = self._run_lean  # type: ignore[method-assign]  # every reserve and settle: no coroutine layer of its own

    @property
    def lean(self) -> bool:
        return self._runner is not None

    def script(self, source: str) -> Any:
        """A handle for `run`: its SHA computed once."""
        if self._runner is not None:
            return resp.Script(source)
        script = self.redis.register_script(source)
        self._scripts.append(script)
        return script

    @property
    def cluster(self) -> bool:
        """Redis Cluster: a script reaches only its group's hash slot (no key shared by every group)."""
        return self._kind == "cluster"

    @property
    def replicated(self) -> bool:
        """Whether a failover may hand the keys to another master (Cluster, Sentinel)."""
        return self._replicated

    async def run(self, script: Any, key: str, args: Sequence[Any], linger: float = 0.0) -> Any:
        """One script call. `key`: one key of the group the script touches (it routes the call on a
        cluster; the script builds its other key names from its arguments, all in that key's slot).
        `linger`: it may wait that long to share a send with the next call (lean path)."""
        if self._runner is not None:
            return await self._runner.evalsha(script, args, linger)
        if self._gate is None:
            return await script(keys=[key], args=list(args))
        if self._started is None or self._started.get_loop() is not asyncio.get_running_loop():
            self._started = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._started)
        async with self._gate:
            return await script(keys=[key], args=list(args))

    def _run_lean(self, script: Any, key: str, args: Sequence[Any], linger: float = 0.0) -> Awaitable[Any]:
        """`run` on the lean path: billing.quota.resp's EVALSHA coroutine itself (`key` routes nothing on one Redis)."""
        return self._runner.evalsha(script, args, linger)  # type: ignore[union-attr]

    async def _start(self) -> None:
        """Cluster / Sentinel: the first calls of a burst would each discover the topology and load
        the scripts; done once here instead (redis-py loses connections when many race to do it)."""
        try:
            if self._kind == "cluster":
                await self.redis.initialize()
            for script in self._scripts:
                await self.redis.script_load(script.script)
        except Exception:
            self._started = None  # the next call tries again; this one fails as Redis is out
            raise

    async def incr_all(self, keys: Sequence[str]) -> None:
        """INCR of each key (the groups' epochs), pipelined; on a cluster grouped by node."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.incr(key)
            await pipe.execute()

    async def lost_groups(self, prefixes: Sequence[str], tags: Sequence[str], proc: str, now: float) -> list[str]:
        """The tags of the groups where process `proc` is no longer registered (Redis lost it)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for prefix in prefixes:
                pipe.zscore(prefix + "procs", proc)
            scores = await pipe.execute()
        return [tag for tag, score in zip(tags, scores) if score is None or float(score) < now]

    async def delete_matching(self, pattern: str) -> None:
        """Deletes every key matching `pattern` (on a cluster, on every master)."""
        keys = [k async for k in self.redis.scan_iter(match=pattern, count=1000)]
        for i in range(0, len(keys), 1000):
            await self.redis.delete(*keys[i:i + 1000])

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.close()
        if self._kind == "cluster":
            await self.redis.aclose()
        else:
            await self.redis.aclose(close_connection_pool=True)  # the pool was passed in: aclose() alone keeps it open
