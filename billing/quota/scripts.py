"""The quota scripts and the one client that runs them.

The Lua sources live in billing/quota/lua/ (each script is `common.lua` followed by its own file)
and are read once, when this module is imported. `ScriptClient` is the limiter's only way to
Redis: scripts go through billing/resp.py's pipelined connection where the URL allows it (the
lean path: a fraction of redis-py's CPU per call), through redis-py otherwise; the few plain
commands (epoch bumps, SCAN, counters) always go through redis-py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from billing import resp

LUA_DIR = Path(__file__).with_name("lua")


def load(name: str) -> str:
    """The source of one script: the shared preamble, then `lua/<name>.lua`."""
    return (LUA_DIR / "common.lua").read_text() + (LUA_DIR / f"{name}.lua").read_text()


RESERVE_LUA, SETTLE_LUA, SEED_LUA, REHOLD_LUA, CREDIT_LUA = (load(n) for n in ("reserve", "settle", "seed", "rehold", "credit"))


class ScriptClient:
    """Runs the quota scripts (EVALSHA, EVAL when Redis does not have one yet) and plain commands.

    `lean`: scripts through billing.resp where the URL is redis://; redis-py's Script objects
    otherwise (rediss://, unix://, or lean=False). `redis` is the redis-py client for the rest.
    """

    def __init__(self, url: str, *, timeout: float, max_connections: int = 64, lean: bool = True) -> None:
        import redis.asyncio as redis

        # A bounded pool that queues callers briefly instead of failing when all connections are busy.
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=2.0,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry_on_timeout=False,
            decode_responses=True,
        )
        self.redis: Any = redis.Redis(connection_pool=pool)
        self._runner = resp.ScriptRunner(url, timeout=timeout, connect_timeout=timeout) if lean and resp.ScriptRunner.supports(url) else None

    @property
    def lean(self) -> bool:
        return self._runner is not None

    def script(self, source: str) -> Any:
        """A handle for `run`: its SHA computed once."""
        return resp.Script(source) if self._runner is not None else self.redis.register_script(source)

    async def run(self, script: Any, args: Sequence[Any], linger: float = 0.0) -> Any:
        """One script call. `linger`: it may wait that long to share a send with the next call (lean path)."""
        if self._runner is not None:
            return await self._runner.evalsha(script, args, linger)
        return await script(keys=[], args=list(args))

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.close()
        await self.redis.aclose(close_connection_pool=True)  # the pool was passed in: aclose() alone keeps it open
