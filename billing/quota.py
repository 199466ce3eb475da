"""Quotas and rate limits with no overspend under concurrency.

Admission reserves the worst case (prompt tokens + max_tokens, and its price) on every scope
(the key and its account) in ONE atomic step: everything is reserved or nothing is. Settlement
commits the actual usage and releases the rest; it is idempotent by request_id. Holds expire by
themselves, so a crashed gateway's reservations free up. When a scope's counters are missing
(Redis restarted or flushed, a new process, limits just changed) they are rebuilt from the
ledger before more traffic is admitted.

Backends: `RedisLimiter` (Lua scripts, one round trip each for reserve and settle) and
`MemoryLimiter` (one process, same semantics) for the embedded default.

A prepaid account's scope also holds its balance (billing/credits.py): credits (each credit-ledger
row applied once, by id) minus usage settled since it became prepaid. Admission reserves the worst
case against credits - spent - held in the same atomic step; settlement adds the actual cost to
spent and releases the rest.
"""

from __future__ import annotations

import abc
import asyncio
import calendar
import functools
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout
from sqlalchemy.ext.asyncio import AsyncEngine

from billing import resp
from billing.credits import prepaid_totals
from billing.limits import Limits
from billing.models import LedgerEntry

log = logging.getLogger("tollgate.quota")
LEDGER = LedgerEntry.__table__
UNLIMITED = -1
MONTHLY = ("monthly_tokens", "monthly_spend")
BALANCE = "insufficient_quota"  # a prepaid account's balance is too low for the worst case (OpenAI's code)
# How long a settlement nobody waits for may wait to share its Redis round trip with the next call
# (usually the next request's reservation: one send and one reply read instead of two each). Its
# hold stays that much longer: conservative (never an overspend), and too short to matter to limits.
SETTLE_LINGER = 0.002


@dataclass(frozen=True)
class Scope:
    kind: str  # "key" | "account"
    id: int
    limits: Limits
    prepaid: bool = False  # an account that spends its prepaid balance

    @property
    def name(self) -> str:
        return f"{self.kind[0]}{self.id}"

    @property
    def limited(self) -> bool:
        return self.prepaid or not self.limits.empty

    def limit_args(self) -> tuple[int, ...]:
        return _limit_args(self.limits, self.prepaid)


@functools.lru_cache(maxsize=4096)
def _limit_args(lim: Limits, prepaid: bool = False) -> tuple[int, ...]:
    """A key's limits as the scripts take them, and 1 for a scope that spends a prepaid balance, once
    per distinct (Limits, prepaid) (the spend limit is Decimal arithmetic; keys' limits change rarely
    and the principal cache hands out the same object)."""
    values = (lim.rpm, lim.tpm, lim.max_concurrent, lim.monthly_tokens, lim.monthly_spend_nanos)
    return (*(UNLIMITED if v is None else int(v) for v in values), 1 if prepaid else 0)


@dataclass
class Hold:
    """What admission reserved for one request."""

    request_id: str
    scopes: tuple[Scope, ...]
    tokens: int
    nanos: int
    minute: int
    month: str
    degraded: bool = False  # admitted without a reservation (fail-open while the store was down)
    headers: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """What settling needs later (the ledger journal keeps it for a crashed request)."""
        return {
            "request_id": self.request_id, "scopes": [[s.kind, s.id] for s in self.scopes], "tokens": self.tokens,
            "nanos": self.nanos, "minute": self.minute, "month": self.month, "degraded": self.degraded,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "Hold":
        scopes = tuple(Scope(str(kind), int(sid), Limits()) for kind, sid in raw["scopes"])
        return cls(raw["request_id"], scopes, int(raw["tokens"]), int(raw["nanos"]), int(raw["minute"]), str(raw["month"]),
                   bool(raw.get("degraded", False)))


class QuotaExceeded(Exception):
    def __init__(self, scope: Scope, limit: str, retry_after: int, headers: dict[str, str], balance: int | None = None) -> None:
        self.scope = scope
        self.limit = limit
        self.retry_after = retry_after
        self.headers = headers
        self.error_type = "insufficient_quota" if limit in MONTHLY or limit == BALANCE else "rate_limit_exceeded"
        owner = "API key" if scope.kind == "key" else "account"
        if limit == BALANCE:
            super().__init__(f"The account's prepaid balance (${usd(balance or 0)} available) is too low for this "
                             "request's worst-case cost; add credit to continue.")
            return
        value = scope.limits.view().get(limit)
        super().__init__(f"The {owner}'s {limit} limit ({value}) is reached.")


def usd(nanos: int) -> str:
    """Exact nano-USD as dollars with 9 places."""
    sign = "-" if nanos < 0 else ""
    return f"{sign}{abs(nanos) // 10**9}.{abs(nanos) % 10**9:09d}"


class QuotaUnavailable(Exception):
    """The quota store is unreachable and the policy is fail-closed."""


def minute_of(now: float) -> int:
    return int(now // 60)


def month_of(now: float) -> str:
    return _month_of_minute(int(now // 60))  # every request asks; the month changes on a minute's boundary


@functools.lru_cache(maxsize=4)
def _month_of_minute(minute: int) -> str:
    return time.strftime("%Y%m", time.gmtime(minute * 60))


def month_start(now: float) -> datetime:
    t = time.gmtime(now)
    return datetime(t.tm_year, t.tm_mon, 1, tzinfo=timezone.utc)


def seconds_to_next_month(now: float) -> int:
    t = time.gmtime(now)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return max(1, math.ceil(calendar.timegm((year, month, 1, 0, 0, 0)) - now))


def retry_after(limit: str, now: float) -> int:
    if limit == BALANCE:
        return 60  # until someone adds credit
    if limit in MONTHLY:
        return seconds_to_next_month(now)
    if limit == "max_concurrent":
        return 1
    return max(1, math.ceil(60 - now % 60))


def ratelimit_headers(scopes: tuple[Scope, ...], remaining: list[tuple[int, int]], now: float) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers from the tightest scope, where rpm/tpm limits are set."""
    headers: dict[str, str] = {}
    reset = f"{max(1, math.ceil(60 - now % 60))}s"
    for kind, index, limit_attr in (("requests", 0, "rpm"), ("tokens", 1, "tpm")):
        best: tuple[int, int] | None = None
        for scope, rem in zip(scopes, remaining):
            limit = getattr(scope.limits, limit_attr)
            if limit is not None and (best is None or rem[index] < best[1]):
                best = (limit, rem[index])
        if best is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(best[0])
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, best[1]))
            headers[f"x-ratelimit-reset-{kind}"] = reset
    return headers


@dataclass
class ScopeTotals:
    month_tokens: int = 0
    month_nanos: int = 0
    minute_requests: int = 0
    minute_tokens: int = 0
    credits: tuple[tuple[int, int], ...] = ()  # prepaid: (credit row id, nano-USD) of every non-usage row
    spent: int = 0  # prepaid: cost of usage since the account became prepaid


class LedgerTotals:
    """Reads current-window usage back from the ledger, to rebuild lost counters."""

    def __init__(self, engine: AsyncEngine, flush: Callable[[], Awaitable[None]] | None = None) -> None:
        self._engine = engine
        self._flush = flush

    async def for_scopes(self, scopes: list[Scope], now: float) -> dict[str, ScopeTotals]:
        if self._flush is not None:
            try:
                await self._flush()
            except asyncio.TimeoutError:
                log.warning("rebuilding quota counters while ledger rows are still pending")
        start = month_start(now)
        minute_start = datetime.fromtimestamp(minute_of(now) * 60, tz=timezone.utc)
        tokens = LEDGER.c.prompt_tokens + LEDGER.c.completion_tokens
        out: dict[str, ScopeTotals] = {}
        async with self._engine.connect() as conn:
            for scope in scopes:
                column = LEDGER.c.key_id if scope.kind == "key" else LEDGER.c.account_id
                month = (
                    await conn.execute(
                        sa.select(sa.func.coalesce(sa.func.sum(tokens), 0), sa.func.coalesce(sa.func.sum(LEDGER.c.cost_nanos), 0)).where(
                            column == scope.id, LEDGER.c.admitted_at >= start
                        )
                    )
                ).one()
                minute = (
                    await conn.execute(
                        sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(tokens), 0)).where(
                            column == scope.id, LEDGER.c.admitted_at >= minute_start
                        )
                    )
                ).one()
                out[scope.name] = ScopeTotals(int(month[0]), int(month[1]), int(minute[0]), int(minute[1]))
                if scope.prepaid:
                    out[scope.name].credits, out[scope.name].spent = await prepaid_totals(conn, scope.id)
        return out


class Limiter(abc.ABC):
    """Shared admission logic; backends implement the atomic steps."""

    def __init__(self, totals: LedgerTotals, *, hold_seconds: float = 900.0) -> None:
        self.totals = totals
        self.hold_seconds = hold_seconds

    async def reserve(self, request_id: str, scopes: list[Scope], tokens: int, nanos: int, now: float | None = None) -> Hold:
        now = time.time() if now is None else now
        limited = tuple(s for s in scopes if s.limited)
        hold = Hold(request_id, limited, tokens, nanos, minute_of(now), month_of(now))
        if not limited:
            return hold
        for _ in range(3):
            outcome = await self._reserve(hold, now)
            if outcome[0] == "ok":
                hold.headers = ratelimit_headers(limited, outcome[1], now)
                return hold
            if outcome[0] == "degraded":
                hold.degraded = True
                return hold
            if outcome[0] == "deny":
                scope = next(s for s in limited if s.name == outcome[1])
                limit = outcome[2]
                raise QuotaExceeded(scope, limit, retry_after(limit, now), ratelimit_headers(limited, outcome[3], now),
                                    int(outcome[4]) if len(outcome) > 4 else None)
            # "sync": some scopes have no counters for this window; rebuild them from the ledger.
            missing = [s for s in limited if s.name in outcome[1]]
            try:
                totals = await self.totals.for_scopes(missing, now)
            except Exception as exc:  # the ledger database is unreachable: no counters to trust
                raise QuotaUnavailable(f"ledger unreachable: {type(exc).__name__}") from None
            await self._seed(missing, totals, now)
        raise QuotaUnavailable("quota counters could not be rebuilt")

    @abc.abstractmethod
    async def _reserve(self, hold: Hold, now: float) -> tuple[Any, ...]: ...

    @abc.abstractmethod
    async def _seed(self, scopes: list[Scope], totals: dict[str, ScopeTotals], now: float) -> None: ...

    @abc.abstractmethod
    async def settle(self, hold: Hold, tokens: int, nanos: int, background: bool = False) -> bool:
        """Commits actual usage and releases the rest. False when already settled. `background`:
        nobody waits for the answer, so the store's round trip may be shared with the next call
        (RedisLimiter: up to SETTLE_LINGER seconds)."""

    @abc.abstractmethod
    async def credit(self, account_id: int, entry_id: int, nanos: int) -> None:
        """A credit-ledger row (not usage) changed a prepaid balance: applied once per row id."""

    @abc.abstractmethod
    async def invalidate(self, scope: Scope) -> None:
        """Limits changed: rebuild this scope's counters from the ledger next time."""

    @abc.abstractmethod
    async def counters(self, scope: Scope, now: float | None = None) -> dict[str, int]: ...

    async def close(self) -> None:
        return None


# --------------------------------------------------------------------------------------------
# In-process backend


@dataclass
class _ScopeState:
    month: str = ""
    month_tokens: int = 0
    month_nanos: int = 0
    minutes: dict[int, list[int]] = field(default_factory=dict)  # minute -> [requests, tokens]
    holds: dict[str, tuple[int, int, int, float]] = field(default_factory=dict)  # rid -> tokens, nanos, minute, expiry
    balance_synced: bool = False  # prepaid: credits and spent read from the database
    credits: dict[int, int] = field(default_factory=dict)  # credit row id -> nano-USD
    spent: int = 0

    def held(self) -> tuple[int, int]:
        return sum(h[0] for h in self.holds.values()), sum(h[1] for h in self.holds.values())


class MemoryLimiter(Limiter):
    """One process: the same semantics as Redis, state in dicts (the event loop serialises it)."""

    def __init__(self, totals: LedgerTotals, *, hold_seconds: float = 900.0) -> None:
        super().__init__(totals, hold_seconds=hold_seconds)
        self._scopes: dict[str, _ScopeState] = {}
        self._settled: dict[str, float] = {}

    async def _reserve(self, hold: Hold, now: float) -> tuple[Any, ...]:
        missing = [s.name for s in hold.scopes if s.name not in self._scopes or self._scopes[s.name].month != hold.month
                   or (s.prepaid and not self._scopes[s.name].balance_synced)]
        if missing:
            return ("sync", missing)
        remaining: list[tuple[int, int]] = []
        for scope in hold.scopes:
            state = self._scopes[scope.name]
            for rid in [r for r, h in state.holds.items() if h[3] <= now]:
                del state.holds[rid]
            rpm, tpm, conc, mtok, mspend, prepaid = scope.limit_args()
            requests, tokens = state.minutes.get(hold.minute, [0, 0])
            held_tok, held_nanos = state.held()
            available = sum(state.credits.values()) - state.spent - held_nanos
            denied = (
                "rpm" if rpm >= 0 and requests + 1 > rpm else
                "tpm" if tpm >= 0 and tokens + hold.tokens > tpm else
                "max_concurrent" if conc >= 0 and len(state.holds) + 1 > conc else
                "monthly_tokens" if mtok >= 0 and state.month_tokens + held_tok + hold.tokens > mtok else
                "monthly_spend" if mspend >= 0 and state.month_nanos + held_nanos + hold.nanos > mspend else
                BALANCE if prepaid and hold.nanos > available else
                None
            )
            if denied:
                return ("deny", scope.name, denied, [(max(0, rpm - requests), max(0, tpm - tokens)) for _ in hold.scopes],
                        max(0, available))
            remaining.append((rpm - requests - 1, tpm - tokens - hold.tokens))
        expiry = now + self.hold_seconds
        for scope in hold.scopes:
            state = self._scopes[scope.name]
            window = state.minutes.setdefault(hold.minute, [0, 0])
            window[0] += 1
            window[1] += hold.tokens
            for old in [m for m in state.minutes if m < hold.minute - 1]:
                del state.minutes[old]
            state.holds[hold.request_id] = (hold.tokens, hold.nanos, hold.minute, expiry)
        return ("ok", remaining)

    async def _seed(self, scopes: list[Scope], totals: dict[str, ScopeTotals], now: float) -> None:
        month, minute = month_of(now), minute_of(now)
        for scope in scopes:
            current = self._scopes.get(scope.name)
            t = totals[scope.name]
            if current is None or current.month != month:
                state = _ScopeState(month=month, month_tokens=t.month_tokens, month_nanos=t.month_nanos)
                state.minutes[minute] = [t.minute_requests, t.minute_tokens]
                if current is not None:
                    state.holds = current.holds
                    state.balance_synced, state.credits, state.spent = current.balance_synced, current.credits, current.spent
                self._scopes[scope.name] = state
            state = self._scopes[scope.name]
            if scope.prepaid and not state.balance_synced:
                state.credits.update(t.credits)  # rows applied meanwhile stay applied once
                state.spent, state.balance_synced = t.spent, True

    async def settle(self, hold: Hold, tokens: int, nanos: int, background: bool = False) -> bool:
        if hold.degraded or not hold.scopes or hold.request_id in self._settled:
            return False
        now = time.time()
        self._settled[hold.request_id] = now + max(60.0, self.hold_seconds)  # as long as Redis keeps its marker
        if len(self._settled) > 100_000:
            self._settled = {r: t for r, t in self._settled.items() if t > now}
        for scope in hold.scopes:
            state = self._scopes.get(scope.name)
            if state is None:
                continue  # rebuilt later from the ledger, which will hold this row
            held = state.holds.pop(hold.request_id, None)
            if held is not None and held[0] > tokens and held[2] in state.minutes:
                state.minutes[held[2]][1] -= held[0] - tokens
            if state.month == hold.month:
                state.month_tokens += tokens
                state.month_nanos += nanos
            if state.balance_synced:
                state.spent += nanos
        return True

    async def credit(self, account_id: int, entry_id: int, nanos: int) -> None:
        state = self._scopes.setdefault(Scope("account", account_id, Limits()).name, _ScopeState())
        state.credits.setdefault(entry_id, nanos)

    async def invalidate(self, scope: Scope) -> None:
        state = self._scopes.get(scope.name)
        if state is not None:
            state.month = ""  # counters rebuilt from the ledger at the next admission; holds kept
            state.balance_synced = False

    async def counters(self, scope: Scope, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        state = self._scopes.get(scope.name)
        if state is None:
            return {}
        requests, tokens = state.minutes.get(minute_of(now), [0, 0])
        held_tok, held_nanos = state.held()
        return {
            "minute_requests": requests, "minute_tokens": tokens, "in_flight": len(state.holds),
            "month_tokens": state.month_tokens, "month_nanos": state.month_nanos,
            "held_tokens": held_tok, "held_nanos": held_nanos,
            "credits_nanos": sum(state.credits.values()), "spent_nanos": state.spent,
        }


# --------------------------------------------------------------------------------------------
# Redis backend: every key lives under one prefix on one Redis (not Redis Cluster).
#   {p}{scope}:rpm:{minute}  {p}{scope}:tpm:{minute}           this minute's requests / tokens
#   {p}{scope}:mtok:{month}  {p}{scope}:mspend:{month}         committed usage this month
#   {p}{scope}:holds (hash rid -> "tok:nanos:minute")  {p}{scope}:hexp (zset rid -> expiry)
#   {p}{scope}:held:tok  {p}{scope}:held:nanos                 sums of live holds
#   {p}{scope}:synced:{month}:{epoch}                          counters valid for this month
#   {p}{scope}:cred (hash credit row id -> nanos)  {p}{scope}:cred:sum  {p}{scope}:spent   prepaid balance
#   {p}{scope}:bsynced:{epoch}                                 balance read from the database
#   {p}proc:{id} (one per gateway process; gone = Redis lost its state, re-register live holds)
#   {p}epoch (bumped to force a rebuild of every scope)   {p}settled:{rid} (settle once)

_LUA_COMMON = """
local p = ARGV[1]
local epoch = redis.call('GET', p .. 'epoch') or '0'
local function num(key) return tonumber(redis.call('GET', key) or '0') end
"""

RESERVE_LUA = _LUA_COMMON + """
local now = tonumber(ARGV[2]); local rid = ARGV[3]; local minute = ARGV[4]; local month = ARGV[5]
local expiry = tonumber(ARGV[6]); local tok = tonumber(ARGV[7]); local nanos = tonumber(ARGV[8])
local n = tonumber(ARGV[9])
-- This process's marker gone: Redis lost its state; re-register our live holds before anything else.
if redis.call('EXISTS', ARGV[10 + n * 7]) == 0 then return {'lost'} end
local scopes = {}
local missing = {}
for i = 0, n - 1 do
  local b = 10 + i * 7
  local s = {name = ARGV[b], rpm = tonumber(ARGV[b + 1]), tpm = tonumber(ARGV[b + 2]), conc = tonumber(ARGV[b + 3]),
             mtok = tonumber(ARGV[b + 4]), mspend = tonumber(ARGV[b + 5]), prepaid = ARGV[b + 6] == '1'}
  s.k = p .. s.name .. ':'
  scopes[#scopes + 1] = s
  if redis.call('EXISTS', s.k .. 'synced:' .. month .. ':' .. epoch) == 0
     or (s.prepaid and redis.call('EXISTS', s.k .. 'bsynced:' .. epoch) == 0) then missing[#missing + 1] = s.name end
end
if #missing > 0 then return {'sync', missing} end
-- A retried call for a request already reserved changes nothing.
if redis.call('HEXISTS', scopes[1].k .. 'holds', rid) == 1 then
  local again = {}
  for i, s in ipairs(scopes) do
    again[i] = {s.rpm - num(s.k .. 'rpm:' .. minute), s.tpm - num(s.k .. 'tpm:' .. minute)}
  end
  return {'ok', again}
end
for _, s in ipairs(scopes) do
  for _, h in ipairs(redis.call('ZRANGEBYSCORE', s.k .. 'hexp', '-inf', now)) do
    local v = redis.call('HGET', s.k .. 'holds', h)
    if v then
      local t, c = string.match(v, '^(%d+):(%d+)')
      redis.call('DECRBY', s.k .. 'held:tok', t)
      redis.call('DECRBY', s.k .. 'held:nanos', c)
      redis.call('HDEL', s.k .. 'holds', h)
    end
    redis.call('ZREM', s.k .. 'hexp', h)
  end
end
local remaining = {}
local denied = nil
local available = 0
for _, s in ipairs(scopes) do
  local requests = num(s.k .. 'rpm:' .. minute)
  local tokens = num(s.k .. 'tpm:' .. minute)
  if not denied then
    if s.rpm >= 0 and requests + 1 > s.rpm then denied = {s.name, 'rpm'}
    elseif s.tpm >= 0 and tokens + tok > s.tpm then denied = {s.name, 'tpm'}
    elseif s.conc >= 0 and redis.call('ZCARD', s.k .. 'hexp') + 1 > s.conc then denied = {s.name, 'max_concurrent'}
    elseif s.mtok >= 0 and num(s.k .. 'mtok:' .. month) + num(s.k .. 'held:tok') + tok > s.mtok then denied = {s.name, 'monthly_tokens'}
    elseif s.mspend >= 0 and num(s.k .. 'mspend:' .. month) + num(s.k .. 'held:nanos') + nanos > s.mspend then denied = {s.name, 'monthly_spend'}
    elseif s.prepaid then
      available = num(s.k .. 'cred:sum') - num(s.k .. 'spent') - num(s.k .. 'held:nanos')
      if nanos > available then denied = {s.name, 'insufficient_quota'} end
    end
  end
  remaining[#remaining + 1] = {s.rpm - requests, s.tpm - tokens}
end
if denied then return {'deny', denied[1], denied[2], remaining, math.max(0, available)} end
for i, s in ipairs(scopes) do
  redis.call('INCR', s.k .. 'rpm:' .. minute)
  redis.call('EXPIRE', s.k .. 'rpm:' .. minute, 180)
  redis.call('INCRBY', s.k .. 'tpm:' .. minute, tok)
  redis.call('EXPIRE', s.k .. 'tpm:' .. minute, 180)
  redis.call('HSET', s.k .. 'holds', rid, tok .. ':' .. nanos .. ':' .. minute)
  redis.call('ZADD', s.k .. 'hexp', expiry, rid)
  redis.call('INCRBY', s.k .. 'held:tok', tok)
  redis.call('INCRBY', s.k .. 'held:nanos', nanos)
  remaining[i] = {remaining[i][1] - 1, remaining[i][2] - tok}
end
return {'ok', remaining}
"""

SETTLE_LUA = _LUA_COMMON + """
local rid = ARGV[2]; local month = ARGV[3]; local tok = tonumber(ARGV[4]); local nanos = tonumber(ARGV[5])
local n = tonumber(ARGV[6])
local keep = tonumber(ARGV[7 + n]) or 86400
if not redis.call('SET', p .. 'settled:' .. rid, '1', 'NX', 'EX', keep) then return 0 end
for i = 0, n - 1 do
  local k = p .. ARGV[7 + i] .. ':'
  local v = redis.call('HGET', k .. 'holds', rid)
  if v then
    local t, c, m = string.match(v, '^(%d+):(%d+):(%d+)')
    redis.call('HDEL', k .. 'holds', rid)
    redis.call('ZREM', k .. 'hexp', rid)
    redis.call('DECRBY', k .. 'held:tok', t)
    redis.call('DECRBY', k .. 'held:nanos', c)
    if tonumber(t) > tok and redis.call('EXISTS', k .. 'tpm:' .. m) == 1 then
      redis.call('DECRBY', k .. 'tpm:' .. m, tonumber(t) - tok)
    end
  end
  -- Counters that were lost are rebuilt from the ledger, which will hold this request's row.
  if redis.call('EXISTS', k .. 'synced:' .. month .. ':' .. epoch) == 1 then
    redis.call('INCRBY', k .. 'mtok:' .. month, tok)
    redis.call('INCRBY', k .. 'mspend:' .. month, nanos)
  end
  if redis.call('EXISTS', k .. 'bsynced:' .. epoch) == 1 then redis.call('INCRBY', k .. 'spent', nanos) end
end
return 1
"""

REHOLD_LUA = _LUA_COMMON + """
local proc = ARGV[2]; local ttl = tonumber(ARGV[3]); local n = tonumber(ARGV[4])
local i = 5
for _ = 1, n do
  local rid = ARGV[i]; local tok = ARGV[i + 1]; local nanos = ARGV[i + 2]; local minute = ARGV[i + 3]
  local expiry = ARGV[i + 4]; local k = tonumber(ARGV[i + 5])
  if redis.call('EXISTS', p .. 'settled:' .. rid) == 0 then
    for j = 1, k do
      local s = p .. ARGV[i + 5 + j] .. ':'
      if redis.call('HEXISTS', s .. 'holds', rid) == 0 then
        redis.call('HSET', s .. 'holds', rid, tok .. ':' .. nanos .. ':' .. minute)
        redis.call('ZADD', s .. 'hexp', expiry, rid)
        redis.call('INCRBY', s .. 'held:tok', tok)
        redis.call('INCRBY', s .. 'held:nanos', nanos)
      end
    end
  end
  i = i + 6 + k
end
redis.call('SET', proc, '1', 'EX', ttl)
return 1
"""

SEED_LUA = _LUA_COMMON + """
local month = ARGV[2]; local minute = ARGV[3]; local n = tonumber(ARGV[4])
local ttl = 40 * 86400
for i = 0, n - 1 do
  local b = 5 + i * 5
  local k = p .. ARGV[b] .. ':'
  local synced = k .. 'synced:' .. month .. ':' .. epoch
  if redis.call('EXISTS', synced) == 0 then
    redis.call('SET', k .. 'mtok:' .. month, ARGV[b + 1], 'EX', ttl)
    redis.call('SET', k .. 'mspend:' .. month, ARGV[b + 2], 'EX', ttl)
    if redis.call('EXISTS', k .. 'rpm:' .. minute) == 0 then
      redis.call('SET', k .. 'rpm:' .. minute, ARGV[b + 3], 'EX', 180)
      redis.call('SET', k .. 'tpm:' .. minute, ARGV[b + 4], 'EX', 180)
    end
    redis.call('SET', synced, '1', 'EX', ttl)
  end
end
-- Prepaid balances: each credit row once (HSETNX keeps rows credited meanwhile), spent from the ledger.
local i = 5 + n * 5
for _ = 1, tonumber(ARGV[i] or '0') do
  local k = p .. ARGV[i + 1] .. ':'
  local rows = tonumber(ARGV[i + 3])
  if redis.call('EXISTS', k .. 'bsynced:' .. epoch) == 0 then
    for j = 0, rows - 1 do redis.call('HSETNX', k .. 'cred', ARGV[i + 4 + j * 2], ARGV[i + 5 + j * 2]) end
    local sum = 0
    for _, v in ipairs(redis.call('HVALS', k .. 'cred')) do sum = sum + tonumber(v) end
    redis.call('SET', k .. 'cred:sum', sum)
    redis.call('SET', k .. 'spent', ARGV[i + 2])
    redis.call('SET', k .. 'bsynced:' .. epoch, '1')
  end
  i = i + 4 + rows * 2
end
return 1
"""

CREDIT_LUA = _LUA_COMMON + """
local k = p .. ARGV[2] .. ':'
if redis.call('HSETNX', k .. 'cred', ARGV[3], ARGV[4]) == 1 then redis.call('INCRBY', k .. 'cred:sum', ARGV[4]) end
return 1
"""


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


def _run_redis_py_script(script: Any, args: list[Any], linger: float = 0.0) -> Awaitable[Any]:
    return script(keys=[], args=args)  # type: ignore[no-any-return]


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
        import redis.asyncio as redis

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
        self._redis = redis.Redis(connection_pool=pool)
        self._runner: resp.ScriptRunner | None = None
        self._reserve_script: Any
        self._settle_script: Any
        self._seed_script: Any
        self._rehold_script: Any
        self._invoke: Callable[[Any, list[Any], float], Awaitable[Any]]
        if lean and resp.ScriptRunner.supports(url):
            self._runner = resp.ScriptRunner(url, timeout=timeout, connect_timeout=timeout)
            self._reserve_script, self._settle_script, self._seed_script, self._rehold_script = (
                resp.Script(lua) for lua in (RESERVE_LUA, SETTLE_LUA, SEED_LUA, REHOLD_LUA)
            )
            self._invoke = self._runner.evalsha
        else:
            self._reserve_script, self._settle_script, self._seed_script, self._rehold_script = (
                self._redis.register_script(lua) for lua in (RESERVE_LUA, SETTLE_LUA, SEED_LUA, REHOLD_LUA)
            )
            self._invoke = _run_redis_py_script

    @property
    def lean(self) -> bool:
        """Whether the scripts run through billing.resp rather than redis-py."""
        return self._runner is not None

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
                result = await self._invoke(script, args, linger)
            except (TimeoutError, asyncio.TimeoutError, RedisTimeout, RedisConnectionError, resp.RespConnectionError):
                # One retry: a busy event loop can miss a short deadline although Redis answered, and a
                # pooled connection to a Redis that restarted fails once before the pool reconnects.
                # Every script is idempotent by request id, so a call that did run is not counted twice.
                result = await self._invoke(script, args, 0.0)  # the retry goes at once
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
        await self._redis.eval(CREDIT_LUA, 0, self.prefix, Scope("account", account_id, Limits()).name, entry_id, nanos)

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
        if self._runner is not None:
            await self._runner.close()
        await self._redis.aclose(close_connection_pool=True)  # the pool was passed in: aclose() alone keeps it open
