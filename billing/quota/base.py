"""What every quota backend shares: scopes, holds, refusals, the ledger read-back, and the
`Limiter` interface the gateway calls (billing/quota/memory.py and billing/quota/redis_limiter.py
implement it).

The guarantees (one atomic reservation over every scope, idempotent settlement, holds that
expire, counters rebuilt from the ledger) are in billing/quota/__init__.py's docstring.

A prepaid account's scope also holds its balance (billing/credits/balance.py): credits (each credit-ledger
row applied once, by id) minus usage settled since it became prepaid. Admission reserves the worst
case against credits - spent - held in the same atomic step; settlement adds the actual cost to
spent and releases the rest.
"""

from __future__ import annotations

import abc
import asyncio
import calendar
import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.credits.balance import prepaid_totals
from billing.quota.limits import Limits
from billing.models import ApiKey, LedgerEntry

log = logging.getLogger("tollgate.quota")
settle_log = logging.getLogger("tollgate.metering")  # where a failed settlement has always been told
LEDGER = LedgerEntry.__table__
KEYS = ApiKey.__table__
UNLIMITED = -1
MONTHLY = ("monthly_tokens", "monthly_spend")
BALANCE = "insufficient_quota"  # a prepaid account's balance is too low for the worst case (OpenAI's code)


@dataclass(frozen=True)
class Scope:
    kind: str  # "key" | "account"
    id: int
    limits: Limits
    prepaid: bool = False  # an account that spends its prepaid balance
    account: int | None = None  # a key's account, where the caller knows it (reads of a key's counters)

    @property
    def name(self) -> str:
        return f"{self.kind[0]}{self.id}"

    @property
    def tag(self) -> str:
        """The group this scope's counters share a Redis Cluster hash slot with: its account's
        (a key whose account is unknown is a group of its own)."""
        if self.kind == "account":
            return f"a{self.id}"
        return f"a{self.account}" if self.account is not None else self.name

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


def _row_of(hold_id: str) -> str:
    """The row id of a hold journaled without one (before `row_id`): a batch line's run holds under
    `<request id>/<run>`, and no other request id has a '/'."""
    return hold_id.split("/", 1)[0] if "/" in hold_id else ""


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
    tag: str = ""  # the account group every scope's counters live in (Scope.tag), "" when nothing is limited
    # (requests, tokens) left this minute on each scope, after this reservation; gateway/serving/ratelimit.py
    # turns them into x-ratelimit-* headers.
    remaining: tuple[tuple[int, int], ...] = ()
    at: float = 0.0  # when it was reserved
    # The ledger row's request id where the hold has an id of its own (a batch line's run): usage
    # settled but not yet in the ledger is filed under the row's id, which a rebuild looks up.
    row_id: str = ""

    @property
    def row(self) -> str:
        """The request id of the ledger row this hold's usage lands in."""
        return self.row_id or self.request_id

    def to_json(self) -> dict[str, Any]:
        """What settling needs later (the ledger journal keeps it for a crashed request)."""
        out = {
            "request_id": self.request_id, "scopes": [[s.kind, s.id] for s in self.scopes], "tokens": self.tokens,
            "nanos": self.nanos, "minute": self.minute, "month": self.month, "degraded": self.degraded, "tag": self.tag,
        }
        if self.row_id:
            out["row_id"] = self.row_id
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "Hold":
        scopes = tuple(Scope(str(kind), int(sid), Limits()) for kind, sid in raw["scopes"])
        tag = str(raw.get("tag") or group_tag(scopes))  # a journal written before hash tags has none
        return cls(raw["request_id"], scopes, int(raw["tokens"]), int(raw["nanos"]), int(raw["minute"]), str(raw["month"]),
                   bool(raw.get("degraded", False)), tag, row_id=str(raw.get("row_id") or _row_of(str(raw["request_id"]))))


def group_tag(scopes: Any) -> str:
    """The tag of one request's scopes: its account's where an account scope is among them."""
    first = ""
    for scope in scopes:
        if scope.kind == "account" or scope.account is not None:
            return scope.tag
        first = first or scope.tag
    return first


class QuotaExceeded(Exception):
    def __init__(self, scope: Scope, limit: str, retry_after: int, scopes: tuple[Scope, ...] = (),
                 remaining: tuple[tuple[int, int], ...] = (), at: float = 0.0, balance: int | None = None) -> None:
        self.scope = scope
        self.limit = limit
        self.retry_after = retry_after
        self.scopes = scopes  # every limited scope of the request, and what each has left this minute
        self.remaining = remaining
        self.at = at
        self.error_type = "insufficient_quota" if limit in MONTHLY or limit == BALANCE else "rate_limit_exceeded"
        owner = "API key" if scope.kind == "key" else "account"
        if limit == BALANCE:
            left = balance or 0
            super().__init__(f"The account's prepaid balance ({'-' if left < 0 else ''}${usd(abs(left))} available) is too low for this "
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


@dataclass
class ScopeTotals:
    month_tokens: int = 0
    month_nanos: int = 0
    minute_requests: int = 0
    minute_tokens: int = 0
    # prepaid: (credit row id, nano-USD, a pending grant's expiry or None) of every non-usage row
    credits: tuple[tuple[int, int, float | None], ...] = ()
    spent: int = 0  # prepaid: cost of usage since the account became prepaid


@dataclass
class Snapshot:
    """A rebuild's view of the ledger (LedgerTotals.snapshot): totals, and which request ids it holds."""

    totals: dict[str, ScopeTotals]
    present: Callable[[list[str]], Awaitable[set[str]]]


@contextlib.asynccontextmanager
async def ledger_snapshot(totals: Any, scopes: list[Scope], now: float) -> AsyncIterator[Snapshot]:
    """`totals.snapshot(...)` where it has one (LedgerTotals); a read-back that only has `for_scopes`
    (benches and tests that start from an empty ledger) holds no row."""
    if hasattr(totals, "snapshot"):
        async with totals.snapshot(scopes, now) as snap:
            yield snap
        return

    async def none(request_ids: list[str]) -> set[str]:
        return set()

    yield Snapshot(await totals.for_scopes(scopes, now), none)


class LedgerTotals:
    """Reads current-window usage back from the ledger, to rebuild lost counters."""

    def __init__(
        self,
        engine: AsyncEngine,
        flush: Callable[[], Awaitable[None]] | None = None,
        pending: Callable[[], list[Any]] | None = None,
    ) -> None:
        """`flush`: this process's ledger rows to the database; `pending`: its rows not known to be
        there yet (the ledger writer's UsageRecords; billing.ledger.writer.LedgerWriter.unconfirmed)."""
        self._engine = engine
        self._flush = flush
        self._pending = pending

    def pending(self) -> list[Any]:
        """This process's ledger rows that may not be in the database yet (a Postgres outage, a
        journal replayed at start): a rebuild after a failover counts them (Redis' `pend` hashes)."""
        return self._pending() if self._pending is not None else []

    async def flush(self) -> None:
        """This process's pending ledger rows reach the database (up to the writer's timeout)."""
        if self._flush is not None:
            try:
                await self._flush()
            except asyncio.TimeoutError:
                log.warning("rebuilding quota counters while ledger rows are still pending")

    async def for_scopes(self, scopes: list[Scope], now: float, conn: Any = None) -> dict[str, ScopeTotals]:
        """Each scope's usage this month and minute. `conn`: read inside that connection's
        transaction (`snapshot`); else this process's rows are flushed first and a connection opened."""
        if conn is None:
            await self.flush()
            async with self._engine.connect() as own:
                return await self.for_scopes(scopes, now, own)
        start = month_start(now)
        minute_start = datetime.fromtimestamp(minute_of(now) * 60, tz=timezone.utc)
        tokens = LEDGER.c.prompt_tokens + LEDGER.c.completion_tokens
        out: dict[str, ScopeTotals] = {}
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

    @contextlib.asynccontextmanager
    async def snapshot(self, scopes: list[Scope], now: float) -> AsyncIterator[Snapshot]:
        """The scopes' totals and a `present(request_ids)` check, both read in one snapshot of the
        database (REPEATABLE READ on Postgres): a rebuild that adds the usage of rows not yet in the
        ledger (Redis' `pend`) asks which of them the totals already hold, and gets an answer
        consistent with the totals whatever commits meanwhile."""
        await self.flush()
        async with self._engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                await conn.execution_options(isolation_level="REPEATABLE READ")
            async with conn.begin():
                totals = await self.for_scopes(scopes, now, conn)

                async def present(request_ids: list[str]) -> set[str]:
                    found: set[str] = set()
                    for i in range(0, len(request_ids), 1000):
                        query = sa.select(LEDGER.c.request_id).where(LEDGER.c.request_id.in_(request_ids[i:i + 1000]))
                        found.update(str(r) for r in (await conn.execute(query)).scalars())
                    return found

                yield Snapshot(totals, present)

    async def account_of_key(self, key_id: int) -> int | None:
        """A key's account from the database (None for an unknown key)."""
        async with self._engine.connect() as conn:
            row = (await conn.execute(sa.select(KEYS.c.account_id).where(KEYS.c.id == key_id))).first()
        return None if row is None else int(row[0])


class Limiter(abc.ABC):
    """Shared admission logic; backends implement the atomic steps."""

    def __init__(self, totals: LedgerTotals, *, hold_seconds: float = 900.0) -> None:
        self.totals = totals
        self.hold_seconds = hold_seconds
        self._settling: set[asyncio.Task[Any]] = set()
        # The holds of this process's requests still running (reserved, not settled), each with when
        # it expires in the store: `renew` keeps them there for as long as their requests run.
        self._live: dict[str, tuple[Hold, float]] = {}
        self._earliest = math.inf  # no live hold expires before this: most calls of `_due` look no further

    @property
    def holding(self) -> bool:
        """Whether any request of this process still holds (reserved, not settled)."""
        return bool(self._live)

    async def reachable(self) -> bool | None:
        """Whether the shared store answers now (/readyz says so); None: the counters are this process's."""
        return None

    def _due(self, now: float) -> list[Hold]:
        """Live holds with less than half the hold time left."""
        soon = now + self.hold_seconds / 2
        if soon <= self._earliest:
            return []
        due = [hold for hold, expiry in self._live.values() if expiry < soon]
        if not due:
            self._earliest = min((expiry for _, expiry in self._live.values()), default=math.inf)
        return due

    def _renewed(self, holds: list[Hold], expiry: float) -> None:
        for hold in holds:
            if hold.request_id in self._live:  # not settled meanwhile
                self._live[hold.request_id] = (hold, expiry)
        self._earliest = min((e for _, e in self._live.values()), default=math.inf)

    async def renew(self, now: float | None = None) -> int:
        """Extends each hold of a request this process still runs that has less than half the hold
        time left to a full hold time from `now`, and returns how many it extended. A hold expires
        once its process stops renewing it (a crash: its requests are gone), not under a request
        that runs longer than the hold time, as long as its gateway reaches the store (one cut off
        from Redis for more than half the hold time can have its running holds swept; they come back
        at its next round). The Redis limiter's hold watch calls it every round; the in-process
        limiter before each reservation."""
        now = time.time() if now is None else now
        due = self._due(now)
        if due:
            await self._renew(due, now + self.hold_seconds)
            self._renewed(due, now + self.hold_seconds)
        return len(due)

    @abc.abstractmethod
    async def _renew(self, holds: list[Hold], expiry: float) -> None:
        """Moves the expiry of these holds, where the store still has them, to `expiry`."""

    def settle_later(self, hold: Hold, tokens: int, nanos: int) -> None:
        """`settle()` in the background (never awaited inside a request's `finally`); a failure is
        logged, by type only. `drain()` waits for the ones under way."""
        task = asyncio.get_running_loop().create_task(self.settle(hold, tokens, nanos, background=True))
        self._settling.add(task)
        task.add_done_callback(self._settled_later)

    def _settled_later(self, task: asyncio.Task[Any]) -> None:
        self._settling.discard(task)
        if not task.cancelled() and task.exception() is not None:
            settle_log.error("quota settlement failed: %s", type(task.exception()).__name__)

    async def drain(self, timeout: float = 10.0) -> None:
        """Waits for the background settlements under way (shutdown and tests)."""
        if self._settling:
            await asyncio.wait(list(self._settling), timeout=timeout)

    async def reserve(self, request_id: str, scopes: list[Scope], tokens: int, nanos: int, now: float | None = None) -> Hold:
        now = time.time() if now is None else now
        limited = tuple(s for s in scopes if s.limited)
        hold = Hold(request_id, limited, tokens, nanos, minute_of(now), month_of(now))
        if not limited:
            return hold
        hold.tag = group_tag(scopes)  # every scope passed, limited or not: the account scope names the group
        self._grouped(scopes, hold.tag)
        for _ in range(3):
            outcome = await self._reserve(hold, now)
            if outcome[0] == "ok":
                hold.remaining, hold.at = tuple(outcome[1]), now
                self._live[request_id] = (hold, now + self.hold_seconds)
                self._earliest = min(self._earliest, now + self.hold_seconds)
                return hold
            if outcome[0] == "degraded":
                hold.degraded = True
                return hold
            if outcome[0] == "deny":
                scope = next(s for s in limited if s.name == outcome[1])
                limit = outcome[2]
                raise QuotaExceeded(scope, limit, retry_after(limit, now), limited, tuple(outcome[3]), now,
                                    int(outcome[4]) if len(outcome) > 4 else None)
            # "sync": some scopes have no counters for this window; rebuild them from the ledger.
            missing = [s for s in limited if s.name in outcome[1]]
            try:
                async with ledger_snapshot(self.totals, missing, now) as snap:
                    await self._seed(hold, missing, snap.totals, now, snap.present)
            except QuotaUnavailable:
                raise
            except Exception as exc:  # the ledger database is unreachable: no counters to trust
                raise QuotaUnavailable(f"ledger unreachable: {type(exc).__name__}") from None
        raise QuotaUnavailable("quota counters could not be rebuilt")

    def _grouped(self, scopes: list[Scope], tag: str) -> None:
        """A reservation showed which group these scopes belong to (RedisLimiter remembers it)."""

    @abc.abstractmethod
    async def _reserve(self, hold: Hold, now: float) -> tuple[Any, ...]: ...

    @abc.abstractmethod
    async def _seed(self, hold: Hold, scopes: list[Scope], totals: dict[str, ScopeTotals], now: float,
                    present: Callable[[list[str]], Awaitable[set[str]]] | None = None) -> None:
        """Sets the scopes' counters from the ledger's `totals` (read at the time of `present`, which
        says which request ids those totals hold)."""

    @abc.abstractmethod
    async def settle(self, hold: Hold, tokens: int, nanos: int, background: bool = False) -> bool:
        """Commits actual usage and releases the rest. False when already settled. `background`:
        nobody waits for the answer, so the store's round trip may be shared with the next call
        (RedisLimiter: up to SETTLE_LINGER seconds)."""

    @abc.abstractmethod
    async def credit(self, account_id: int, entry_id: int | None, nanos: int, *, expires_at: float | None = None,
                     ends_grant: int | None = None) -> None:
        """A credit-ledger row (not usage) changed a prepaid balance: applied once per row id.
        `expires_at` (epoch seconds): the row is a grant that expires then; from then on none of it is
        available until its end is told: `ends_grant`, its id (its expiry row; or `entry_id` None when
        nothing was left of it to expire)."""

    @abc.abstractmethod
    async def invalidate(self, scope: Scope) -> None:
        """Limits changed: rebuild this scope's counters from the ledger next time."""

    async def invalidate_account(self, account_id: int) -> None:
        """The account's counters and balance are rebuilt from the ledger at its next admission (a
        credit the store did not take when it was made); never raises."""
        await self.invalidate(Scope("account", account_id, Limits()))

    @abc.abstractmethod
    async def counters(self, scope: Scope, now: float | None = None) -> dict[str, int]: ...

    async def close(self) -> None:
        return None
