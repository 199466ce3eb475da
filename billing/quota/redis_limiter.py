"""The Redis quota backend: the Lua scripts (billing/quota/lua/) run atomically on Redis, one
round trip each for reserve and settle, shared by every gateway process.

Key layout: every key lives under one prefix on one Redis (not Redis Cluster).
  {p}{scope}:rpm:{minute}  {p}{scope}:tpm:{minute}           this minute's requests / tokens
  {p}{scope}:mtok:{month}  {p}{scope}:mspend:{month}         committed usage this month
  {p}{scope}:holds (hash rid -> "tok:nanos:minute")  {p}{scope}:hexp (zset rid -> expiry)
  {p}{scope}:held:tok  {p}{scope}:held:nanos                 sums of live holds
  {p}{scope}:synced:{month}:{epoch}                          counters valid for this month
  {p}{scope}:cred (hash credit row id -> nanos)  {p}{scope}:cred:sum  {p}{scope}:spent   prepaid balance
  {p}{scope}:bsynced:{epoch}                                 balance read from the database
  {p}proc:{id} (one per gateway process; gone = Redis lost its state, re-register live holds)
  {p}epoch (bumped to force a rebuild of every scope)   {p}settled:{rid} (settle once)
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout

from billing import resp
from billing.limits import Limits
from billing.quota.base import Hold, LedgerTotals, Limiter, QuotaUnavailable, Scope, ScopeTotals, minute_of, month_of
from billing.quota.scripts import CREDIT_LUA, REHOLD_LUA, RESERVE_LUA, SEED_LUA, SETTLE_LUA, ScriptClient

log = logging.getLogger("tollgate.quota")
# How long a settlement nobody waits for may wait to share its Redis round trip with the next call
# (usually the next request's reservation: one send and one reply read instead of two each). Its
# hold stays that much longer: conservative (never an overspend), and too short to matter to limits.
SETTLE_LINGER = 0.002


class CircuitBreaker:
    """Opens after `threshold` consecutive failures; lets one probe through after `cooldown`."""

    def __init__(self, threshold: int = 5, cooldown: float = 1.0) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.failures = 0
        self.opened_at: float | None = None

    def allow(self) -> bool:
        if self.opened_at is None:
            return True
        return time.monotonic() - self.opened_at >= self.cooldown

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None

    def failure(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            self.opened_at = time.monotonic()


class RedisLimiter(Limiter):
    def __init__(
        self,
        url: str,
        totals: LedgerTotals,
        *,
        prefix: str = "tg:q:",
        timeout: float = 0.05,
        fail_open: bool = False,
        hold_seconds: float = 900.0,
        breaker: CircuitBreaker | None = None,
        max_connections: int = 64,
        lean: bool = True,
    ) -> None:
        """`lean`: run the Lua scripts through billing.resp (one pipelined connection, a fraction of
        redis-py's CPU per call) where the URL is redis://; redis-py's scripts otherwise (rediss://,
        unix://, or lean=False). Everything else goes through redis-py either way."""
        super().__init__(totals, hold_seconds=hold_seconds)
        self.prefix = prefix
        self.fail_open = fail_open
        self.breaker = breaker or CircuitBreaker()
        self._resync_needed = False
        # Holds this process reserved and has not settled, re-registered if Redis loses them (a restart):
        # counters rebuilt from the ledger alone would not see requests still running.
        self._live: dict[str, tuple[Hold, float]] = {}
        self._proc_key = f"{prefix}proc:{uuid.uuid4().hex}"
        self._watcher: asyncio.Task[None] | None = None
        self._client = ScriptClient(url, timeout=timeout, max_connections=max_connections, lean=lean)
        self._redis = self._client.redis
        self._reserve_script, self._settle_script, self._seed_script, self._rehold_script, self._credit_script = (
            self._client.script(lua) for lua in (RESERVE_LUA, SETTLE_LUA, SEED_LUA, REHOLD_LUA, CREDIT_LUA)
        )

    @property
    def lean(self) -> bool:
        """Whether the scripts run through billing.resp rather than redis-py."""
        return self._client.lean

    async def _call(self, script: Any, args: list[Any], linger: float = 0.0) -> Any:
        """One round trip, guarded by the breaker; raises QuotaUnavailable when Redis is out.
        `linger`: the call may wait that long to leave with the next one (redis-py sends at once)."""
        if not self.breaker.allow():
            raise QuotaUnavailable("quota store unavailable (circuit open)")
        try:
            if self._resync_needed:
                # Usage admitted while Redis was unreachable is only in the ledger: rebuild every scope.
                await self._redis.incr(self.prefix + "epoch")
                self._resync_needed = False
            try:
                result = await self._client.run(script, args, linger)
            except (TimeoutError, asyncio.TimeoutError, RedisTimeout, RedisConnectionError, resp.RespConnectionError):
                # One retry: a busy event loop can miss a short deadline although Redis answered, and a
                # pooled connection to a Redis that restarted fails once before the pool reconnects.
                # Every script is idempotent by request id, so a call that did run is not counted twice.
                result = await self._client.run(script, args, 0.0)  # the retry goes at once
        except Exception as exc:  # connection refused, timeout, server error
            self.breaker.failure()
            log.warning("quota store call failed: %s", type(exc).__name__)
            raise QuotaUnavailable(str(type(exc).__name__)) from None
        self.breaker.success()
        return result

    async def _reserve(self, hold: Hold, now: float) -> tuple[Any, ...]:
        args: list[Any] = [
            self.prefix, f"{now:.3f}", hold.request_id, hold.minute, hold.month,
            f"{now + self.hold_seconds:.3f}", hold.tokens, hold.nanos, len(hold.scopes),
        ]
        for scope in hold.scopes:
            args += [scope.name, *scope.limit_args()]
        args.append(self._proc_key)
        self._watch()
        try:
            result = await self._call(self._reserve_script, args)
            if result[0] == "lost":
                await self._rehold(now)
                result = await self._call(self._reserve_script, args)
        except QuotaUnavailable:
            if self.fail_open:
                self._resync_needed = True
                return ("degraded",)
            raise
        if result[0] == "lost":
            raise QuotaUnavailable("quota store keeps losing its state")
        if result[0] == "ok":
            self._live[hold.request_id] = (hold, now + self.hold_seconds)
            return ("ok", [tuple(r) for r in result[1]])
        if result[0] == "deny":
            return ("deny", result[1], result[2], [tuple(r) for r in result[3]], int(result[4]))
        return ("sync", list(result[1]))

    async def _seed(self, scopes: list[Scope], totals: dict[str, ScopeTotals], now: float) -> None:
        args: list[Any] = [self.prefix, month_of(now), minute_of(now), len(scopes)]
        for scope in scopes:
            t = totals[scope.name]
            args += [scope.name, t.month_tokens, t.month_nanos, t.minute_requests, t.minute_tokens]
        prepaid = [s for s in scopes if s.prepaid]
        args.append(len(prepaid))
        for scope in prepaid:
            t = totals[scope.name]
            args += [scope.name, t.spent, len(t.credits), *[v for row in t.credits for v in row]]
        await self._call(self._seed_script, args)

    async def credit(self, account_id: int, entry_id: int, nanos: int) -> None:
        await self._client.run(self._credit_script, [self.prefix, Scope("account", account_id, Limits()).name, entry_id, nanos])

    async def _rehold(self, now: float) -> None:
        """Puts this process's unsettled holds back (after Redis lost them) and marks the process seen."""
        self._live = {rid: (h, exp) for rid, (h, exp) in self._live.items() if exp > now}
        args: list[Any] = [self.prefix, self._proc_key, 86400, len(self._live)]
        for hold, expiry in self._live.values():
            args += [hold.request_id, hold.tokens, hold.nanos, hold.minute, f"{expiry:.3f}", len(hold.scopes), *[s.name for s in hold.scopes]]
        await self._call(self._rehold_script, args)
        if self._live:
            log.warning("quota store lost its state: re-registered %d holds of requests still running", len(self._live))

    def _watch(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_loop(), name="quota-hold-watch")

    async def _watch_loop(self, interval: float = 1.0) -> None:
        """An idle process notices a Redis restart too, so its running requests' holds come back
        within `interval` even if it admits nothing new."""
        while True:
            await asyncio.sleep(interval)
            if not self._live or not self.breaker.allow():
                continue
            try:
                if not await self._redis.exists(self._proc_key):
                    await self._rehold(time.time())
            except Exception as exc:  # Redis still down: the next round or the next reserve retries
                log.debug("hold watch: %s", type(exc).__name__)

    async def settle(self, hold: Hold, tokens: int, nanos: int, background: bool = False) -> bool:
        self._live.pop(hold.request_id, None)
        if hold.degraded or not hold.scopes:
            return False
        # The settle-once marker lives as long as a hold does (a repeat of a settlement comes from
        # the immediate retry, never later: an interrupted request's release only follows a process
        # that never settled it), not a day: a day of markers is ~86M keys at 1,000 requests/s.
        keep = max(60, int(self.hold_seconds))
        args = [self.prefix, hold.request_id, hold.month, tokens, nanos, len(hold.scopes), *[s.name for s in hold.scopes], keep]
        try:
            return bool(await self._call(self._settle_script, args, SETTLE_LINGER if background else 0.0))
        except QuotaUnavailable:
            # The hold expires by itself; the ledger row carries the usage for the next rebuild.
            self._resync_needed = True
            return False

    async def invalidate(self, scope: Scope) -> None:
        try:
            # SCAN walks the whole keyspace: 1000 keys a round trip, not Redis's default of 10
            # (each request leaves a `settled:` marker for the hold time, so a busy Redis holds many).
            keys = [k async for k in self._redis.scan_iter(match=f"{self.prefix}{scope.name}:synced:*", count=1000)]
            if keys:
                await self._redis.delete(*keys)
        except Exception as exc:
            log.warning("could not invalidate quota counters for %s: %s", scope.name, type(exc).__name__)
            self._resync_needed = True

    async def counters(self, scope: Scope, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        k = f"{self.prefix}{scope.name}:"
        minute, month = minute_of(now), month_of(now)
        names = [f"rpm:{minute}", f"tpm:{minute}", f"mtok:{month}", f"mspend:{month}", "held:tok", "held:nanos", "cred:sum", "spent"]
        values = await self._redis.mget([k + n for n in names])
        in_flight = await self._redis.zcard(k + "hexp")
        ints = [int(v or 0) for v in values]
        return {
            "minute_requests": ints[0], "minute_tokens": ints[1], "in_flight": int(in_flight),
            "month_tokens": ints[2], "month_nanos": ints[3], "held_tokens": ints[4], "held_nanos": ints[5],
            "credits_nanos": ints[6], "spent_nanos": ints[7],
        }

    async def flush_all(self) -> None:
        """Deletes every counter under the prefix (tests and operators use it to simulate a loss)."""
        keys = [k async for k in self._redis.scan_iter(match=f"{self.prefix}*", count=1000)]
        if keys:
            await self._redis.delete(*keys)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        await self._client.close()
