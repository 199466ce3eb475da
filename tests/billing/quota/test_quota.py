"""Limiter semantics, run against every backend: real Redis (Lua), a real local Redis Cluster
(3 masters + 3 replicas) and the in-process limiter."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from decimal import Decimal
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from billing import migrate
from billing.db import create_engine
from billing.ledger.writer import UsageRecord, write_records
from billing.quota.limits import InvalidLimits, Limits
from billing.quota import LedgerTotals, Limiter, MemoryLimiter, QuotaExceeded, RedisLimiter, Scope, month_start
from tests.conftest import REDIS_URL, require_redis, until

NOW = 1_795_000_000.0  # a fixed instant, 2026-11: windows are driven by explicit times


@pytest.fixture(scope="module")
def ledger_url(fresh_pg_database: Any) -> str:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    return url


@pytest.fixture(params=["redis", "cluster", "memory"])
async def limiter(request: pytest.FixtureRequest, ledger_url: str) -> Any:
    db = create_engine(ledger_url)
    totals = LedgerTotals(db)
    if request.param == "redis":
        require_redis(REDIS_URL)
        lim: Limiter = RedisLimiter(REDIS_URL, totals, prefix=f"tgtest:{uuid.uuid4().hex[:8]}:", timeout=0.5)
    elif request.param == "cluster":  # Redis Cluster: every key one script touches in its account's hash slot
        url = request.getfixturevalue("redis_cluster").url
        lim = RedisLimiter(url, totals, prefix=f"tgtest:{uuid.uuid4().hex[:8]}:", timeout=0.5)
    else:
        lim = MemoryLimiter(totals)
    yield lim
    if isinstance(lim, RedisLimiter):
        await lim.flush_all()
    await lim.close()
    await db.dispose()


def scope(kind: str = "key", **limits: Any) -> Scope:
    return Scope(kind, int(uuid.uuid4().int % 10**9), Limits().patched(limits))


def rid() -> str:
    return uuid.uuid4().hex


async def reserve_many(limiter: Limiter, scopes: list[Scope], n: int, tokens: int) -> list[Any]:
    """`n` reservations at once; returns the holds, after checking every refusal is the monthly budget's."""
    results = await asyncio.gather(*[limiter.reserve(rid(), scopes, tokens, 0, now=NOW) for _ in range(n)], return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            assert isinstance(r, QuotaExceeded), r
            assert r.limit == "monthly_tokens" and r.error_type == "insufficient_quota"
    return [r for r in results if not isinstance(r, BaseException)]


async def test_concurrent_reservations_admit_exactly_the_monthly_budget(limiter: Limiter) -> None:
    """200 reservations of 100 against 2000 tokens: exactly 2000 // 100 are admitted, whatever the
    order, when each uses what it reserved (settles interleaved with the reservations)."""
    budget, per_request = 2000, 100
    key = scope(monthly_tokens=budget)

    async def one() -> bool:
        try:
            hold = await limiter.reserve(rid(), [key], per_request, 0, now=NOW)
        except QuotaExceeded as exc:
            assert exc.limit == "monthly_tokens" and exc.error_type == "insufficient_quota"
            return False
        await asyncio.sleep(0)  # let other reservations run while this one is held
        await limiter.settle(hold, per_request, 0)
        return True

    admitted = sum(await asyncio.gather(*[one() for _ in range(200)]))
    assert admitted == budget // per_request
    counters = await limiter.counters(key, now=NOW)
    assert counters["month_tokens"] == budget
    assert counters["held_tokens"] == 0 and counters["in_flight"] == 0


async def test_released_reservations_admit_exactly_what_is_left(limiter: Limiter) -> None:
    """Usage below the reservation gives the rest back, exactly: 20 of 200 holds of 100 fit in 2000;
    settled at 60 each they leave 800, so the next 200 at once admit exactly 8."""
    budget, per_request, used = 2000, 100, 60
    key = scope(monthly_tokens=budget)
    holds = await reserve_many(limiter, [key], 200, per_request)
    assert len(holds) == budget // per_request
    counters = await limiter.counters(key, now=NOW)
    assert (counters["held_tokens"], counters["in_flight"], counters["month_tokens"]) == (budget, len(holds), 0)

    await asyncio.gather(*[limiter.settle(h, used, 0) for h in holds])
    spent = len(holds) * used
    assert (await limiter.counters(key, now=NOW))["month_tokens"] == spent

    more = await reserve_many(limiter, [key], 200, per_request)
    assert len(more) == (budget - spent) // per_request
    await asyncio.gather(*[limiter.settle(h, per_request, 0) for h in more])
    counters = await limiter.counters(key, now=NOW)
    assert counters["month_tokens"] == spent + len(more) * per_request
    assert counters["held_tokens"] == 0 and counters["in_flight"] == 0
    assert await reserve_many(limiter, [key], 10, budget - counters["month_tokens"] + 1) == []


async def test_account_scope_caps_all_its_keys(limiter: Limiter) -> None:
    account = scope("account", monthly_tokens=1000)
    keys = [scope() for _ in range(5)]
    results = await asyncio.gather(
        *[limiter.reserve(rid(), [keys[i % 5], account], 100, 0, now=NOW) for i in range(40)], return_exceptions=True
    )
    admitted = [r for r in results if not isinstance(r, Exception)]
    assert len(admitted) == 10
    assert all(isinstance(r, QuotaExceeded) and r.scope.kind == "account" for r in results if isinstance(r, Exception))


async def test_all_or_nothing_across_scopes(limiter: Limiter) -> None:
    key = scope(rpm=100)
    account = scope("account", max_concurrent=1)
    await limiter.reserve(rid(), [key, account], 10, 0, now=NOW)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.reserve(rid(), [key, account], 10, 0, now=NOW)
    assert info.value.limit == "max_concurrent"
    assert (await limiter.counters(key, now=NOW))["minute_requests"] == 1  # the refused request reserved nothing


async def test_rpm_and_tpm_windows_reset(limiter: Limiter) -> None:
    key = scope(rpm=3, tpm=1000)
    for _ in range(3):
        hold = await limiter.reserve(rid(), [key], 10, 0, now=NOW)
        await limiter.settle(hold, 10, 0)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.reserve(rid(), [key], 10, 0, now=NOW + 1)
    assert info.value.limit == "rpm" and info.value.error_type == "rate_limit_exceeded"
    assert 1 <= info.value.retry_after <= 60
    await limiter.reserve(rid(), [key], 10, 0, now=NOW + 60)  # next minute

    other = scope(tpm=100)
    await limiter.reserve(rid(), [other], 80, 0, now=NOW)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.reserve(rid(), [other], 30, 0, now=NOW)
    assert info.value.limit == "tpm"
    await limiter.reserve(rid(), [other], 30, 0, now=NOW + 60)


async def test_tpm_releases_the_unused_part_of_a_reservation(limiter: Limiter) -> None:
    key = scope(tpm=100)
    hold = await limiter.reserve(rid(), [key], 90, 0, now=NOW)
    await limiter.settle(hold, 20, 0)
    await limiter.reserve(rid(), [key], 80, 0, now=NOW)  # 20 used + 80 fits


async def test_max_concurrent_and_release_on_settle(limiter: Limiter) -> None:
    key = scope(max_concurrent=2)
    a = await limiter.reserve(rid(), [key], 1, 0, now=NOW)
    await limiter.reserve(rid(), [key], 1, 0, now=NOW)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.reserve(rid(), [key], 1, 0, now=NOW)
    assert info.value.retry_after == 1
    await limiter.settle(a, 0, 0)  # cancelled before any token: releases its slot
    await limiter.reserve(rid(), [key], 1, 0, now=NOW)


async def test_settling_twice_counts_once(limiter: Limiter) -> None:
    key = scope(monthly_tokens=10_000)
    hold = await limiter.reserve(rid(), [key], 100, 0, now=NOW)
    assert await limiter.settle(hold, 40, 0) is True
    assert await limiter.settle(hold, 40, 0) is False
    assert (await limiter.counters(key, now=NOW))["month_tokens"] == 40


async def test_a_running_requests_hold_outlives_the_hold_time(limiter: Limiter) -> None:
    """A hold expires only when its process stops renewing it: one that runs past the hold time
    keeps its place (max_concurrent) and what it reserved."""
    limiter.hold_seconds = 30
    t0 = time.time()  # real time: Redis' hold watch renews on the real clock as well
    key = scope(max_concurrent=1)
    running = await limiter.reserve(rid(), [key], 100, 0, now=t0)
    assert await limiter.renew(now=t0 + 10) == 0  # more than half the hold time left
    assert await limiter.renew(now=t0 + 20) == 1  # renewed: until t0 + 50
    with pytest.raises(QuotaExceeded) as info:
        await limiter.reserve(rid(), [key], 100, 0, now=t0 + 45)  # past the first expiry (t0 + 30)
    assert info.value.limit == "max_concurrent"
    assert (await limiter.counters(key, now=t0 + 45))["in_flight"] == 1
    await limiter.settle(running, 10, 0)
    assert await limiter.renew(now=t0 + 40) == 0  # settled: nothing of it is renewed again
    await limiter.reserve(rid(), [key], 100, 0, now=t0 + 45)


@pytest.mark.parametrize("store", ["redis", "cluster"])
async def test_a_crashed_processs_holds_expire(store: str, request: pytest.FixtureRequest, ledger_url: str) -> None:
    """Holds in Redis outlive the process that took them; once it no longer renews them (it died),
    they expire after the hold time and free their place for the other processes."""
    if store == "redis":
        require_redis(REDIS_URL)
    url = REDIS_URL if store == "redis" else request.getfixturevalue("redis_cluster").url
    db = create_engine(ledger_url)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    crashed, other = (RedisLimiter(url, LedgerTotals(db), prefix=prefix, timeout=0.5, hold_seconds=30) for _ in range(2))
    try:
        t0 = time.time()
        key = scope(max_concurrent=1)
        await crashed.reserve(rid(), [key], 100, 0, now=t0)
        assert await crashed.renew(now=t0 + 20) == 1  # alive: until t0 + 50
        await crashed.close()  # then it dies without settling
        with pytest.raises(QuotaExceeded):
            await other.reserve(rid(), [key], 100, 0, now=t0 + 45)
        await other.reserve(rid(), [key], 100, 0, now=t0 + 51)
    finally:
        await other.flush_all()
        await other.close()
        await db.dispose()


async def test_the_hold_watch_renews_running_holds_on_the_clock(ledger_url: str) -> None:
    """On the real clock: a hold of 2 s is renewed by the process's hold watch while its request runs,
    is still counted after its first expiry, and expires once its process is gone."""
    require_redis(REDIS_URL)
    db = create_engine(ledger_url)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    running, other = (RedisLimiter(REDIS_URL, LedgerTotals(db), prefix=prefix, timeout=0.5, hold_seconds=2) for _ in range(2))
    client = redis_asyncio.Redis.from_url(REDIS_URL)
    alive = True
    try:
        key = scope(max_concurrent=1)
        hold = await running.reserve(rid(), [key], 100, 0)
        first_expiry = hold.at + 2
        hexp = f"{running.group(hold.tag)}{key.name}:hexp"

        async def renewed() -> bool:
            score = await client.zscore(hexp, hold.request_id)
            return score is not None and score > first_expiry and time.time() > first_expiry + 0.1

        await until(renewed, "the hold renewed and its first expiry passed")
        with pytest.raises(QuotaExceeded) as info:
            await other.reserve(rid(), [key], 100, 0)
        assert info.value.limit == "max_concurrent"
        await running.close()  # the process dies: its hold expires within 2 s
        alive = False

        async def admitted() -> bool:
            try:
                await other.reserve(rid(), [key], 100, 0)
            except QuotaExceeded:
                return False
            return True

        await until(admitted, "the dead process's hold expired", timeout=10.0)
    finally:
        await other.flush_all()
        await other.close()
        if alive:
            await running.close()
        await client.aclose()
        await db.dispose()


async def test_monthly_spend_at_exact_decimal_price(limiter: Limiter) -> None:
    # $0.15 per million input tokens -> 150 nano-USD per token; budget $0.000045 = 45,000 nanos = 300 tokens
    key = scope(monthly_spend="0.000045")
    holds = [await limiter.reserve(rid(), [key], 100, 100 * 150, now=NOW) for _ in range(3)]
    with pytest.raises(QuotaExceeded) as info:
        await limiter.reserve(rid(), [key], 1, 150, now=NOW)
    assert info.value.limit == "monthly_spend"
    for h in holds:
        await limiter.settle(h, 100, 100 * 150)
    assert (await limiter.counters(key, now=NOW))["month_nanos"] == 45_000


async def test_tpm_and_monthly_spend_admit_up_to_the_limit_and_not_one_unit_more(limiter: Limiter) -> None:
    """The limit itself is reachable, and one token (one nano-USD) past it is refused."""
    key = scope(tpm=100)
    await limiter.reserve(rid(), [key], 80, 0, now=NOW)
    await limiter.reserve(rid(), [key], 20, 0, now=NOW)  # 100 of 100
    with pytest.raises(QuotaExceeded) as info:
        await limiter.reserve(rid(), [key], 1, 0, now=NOW)
    assert info.value.limit == "tpm"

    spend = scope(monthly_spend="0.000045")  # 45,000 nano-USD
    await limiter.reserve(rid(), [spend], 100, 44_999, now=NOW)
    await limiter.reserve(rid(), [spend], 1, 1, now=NOW)  # 45,000 of 45,000
    with pytest.raises(QuotaExceeded) as info:
        await limiter.reserve(rid(), [spend], 1, 1, now=NOW)
    assert info.value.limit == "monthly_spend"


async def test_counters_are_rebuilt_from_the_ledger(limiter: Limiter, ledger_url: str) -> None:
    key = scope(monthly_tokens=1000)
    db = create_engine(ledger_url)
    try:
        created = month_start(NOW).replace(day=2)
        rows = [
            UsageRecord(request_id=rid(), account_id=1, key_id=key.id, model="m", prompt_tokens=300, completion_tokens=100,
                        status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=7, created_at=created)
            for _ in range(2)
        ]
        await write_records(db, rows)
    finally:
        await db.dispose()
    # 800 tokens already used this month according to the ledger: 300 more would overspend.
    with pytest.raises(QuotaExceeded):
        await limiter.reserve(rid(), [key], 300, 0, now=NOW)
    await limiter.reserve(rid(), [key], 200, 0, now=NOW)
    counters = await limiter.counters(key, now=NOW)
    assert counters["month_tokens"] == 800 and counters["month_nanos"] == 14


class GatedTotals:
    """The limiter's ledger read-back, held at the start of a rebuild's snapshot until released."""

    def __init__(self, inner: LedgerTotals) -> None:
        self.inner = inner
        self.gate = False
        self.inside = asyncio.Event()
        self.go = asyncio.Event()
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @contextlib.asynccontextmanager
    async def snapshot(self, scopes: list[Scope], now: float) -> Any:
        if self.gate:
            self.inside.set()
            await self.go.wait()
        async with self.inner.snapshot(scopes, now) as snap:
            if not self.gate_present:
                yield snap
                return

            async def present(request_ids: list[str]) -> set[str]:  # held on its first question
                if not self.asked.is_set():
                    self.asked.set()
                    await self.answer.wait()
                return await snap.present(request_ids)

            yield type(snap)(snap.totals, present)

    gate_present = False


async def test_usage_settled_while_its_counters_are_rebuilt_counts_once(limiter: Limiter, ledger_url: str) -> None:
    """A request that settles while its scope's counters are being rebuilt from the ledger (a limits
    change invalidated them), its row still in the writer's queue, counts once: in the rebuild, which
    its ledger read does not hold it for, and not again once its row is in the ledger. Before, the
    in-process limiter dropped it (the rebuild overwrote counters that had not taken it): a prepaid
    balance believed spent money unspent (an audit: a final balance of -200,000,000 nano-USD)."""
    account = scope("account", monthly_tokens=100_000)
    first = await limiter.reserve(rid(), [account], 100, 0, now=NOW)
    await limiter.invalidate(account)
    gated = GatedTotals(limiter.totals)
    limiter.totals = gated  # type: ignore[assignment]
    gated.gate = True
    rebuilding = asyncio.create_task(limiter.reserve(rid(), [account], 10, 0, now=NOW))
    await gated.inside.wait()
    await limiter.settle(first, 60, 0)  # its row is not in the ledger yet
    gated.go.set()
    await rebuilding
    assert (await limiter.counters(account, now=NOW))["month_tokens"] == 60
    gated.gate = False
    db = create_engine(ledger_url)
    try:
        await write_records(db, [UsageRecord(request_id=first.request_id, account_id=account.id, key_id=1, model="m", prompt_tokens=60,
                                             completion_tokens=0, status="completed", finish_reason="stop", total_ms=1.0,
                                             created_at=month_start(NOW).replace(day=2))])
    finally:
        await db.dispose()
    await limiter.invalidate(account)
    await limiter.reserve(rid(), [account], 10, 0, now=NOW)  # rebuilt again: the ledger holds it now
    assert (await limiter.counters(account, now=NOW))["month_tokens"] == 60


async def test_usage_settled_while_a_rebuild_asks_the_ledger_counts_once(limiter: Limiter, ledger_url: str) -> None:
    """A settlement that lands while the rebuild is asking the ledger which settled rows it holds,
    whose row the ledger read does hold, counts once: from the ledger. (Before, the in-process
    limiter put its new counters in place before asking, so such a settlement was added on top of a
    ledger read that already held it.)"""
    account = scope("account", monthly_tokens=100_000)
    first = await limiter.reserve(rid(), [account], 100, 0, now=NOW)
    second = await limiter.reserve(rid(), [account], 100, 0, now=NOW)
    await limiter.invalidate(account)
    await limiter.settle(first, 60, 0)  # waits for the rebuild: its row is not in the ledger
    db = create_engine(ledger_url)
    try:  # the second's row is in the ledger before the rebuild reads it; its settlement comes later
        await write_records(db, [UsageRecord(request_id=second.request_id, account_id=account.id, key_id=1, model="m",
                                             prompt_tokens=70, completion_tokens=0, status="completed", finish_reason="stop",
                                             total_ms=1.0, created_at=month_start(NOW).replace(day=2))])
    finally:
        await db.dispose()
    gated = GatedTotals(limiter.totals)
    limiter.totals = gated  # type: ignore[assignment]
    gated.gate_present = True
    rebuilding = asyncio.create_task(limiter.reserve(rid(), [account], 10, 0, now=NOW))
    await gated.asked.wait()
    await limiter.settle(second, 70, 0)  # while the rebuild asks about the first
    gated.answer.set()
    await rebuilding
    assert (await limiter.counters(account, now=NOW))["month_tokens"] == 130


async def test_a_postpaid_keys_usage_spends_no_prepaid_balance(limiter: Limiter) -> None:
    """A request authenticated as postpaid just before its account became prepaid holds no balance
    and its row is invoiced (billing/ledger/records.py: `postpaid`): its usage counts in the month's
    counters but never in the balance's `spent`, settled directly or through a rebuild (`pend`).
    Before, the limiters added every settlement to `spent` once the balance was synced, and refused
    with money left until the next rebuild."""
    account = int(uuid.uuid4().int % 10**9)
    limits = Limits(monthly_tokens=100_000)
    prepaid, postpaid = Scope("account", account, limits, True), Scope("account", account, limits, False)
    await limiter.credit(account, 1, 1_000)
    stale = await limiter.reserve(rid(), [postpaid], 10, 300, now=NOW)
    await limiter.invalidate(prepaid)  # a limits change: the next admission rebuilds from the ledger
    await limiter.settle(stale, 10, 300)  # waits for that rebuild
    held = await limiter.reserve(rid(), [prepaid], 10, 100, now=NOW)  # rebuilds the month and the balance
    late = await limiter.reserve(rid(), [postpaid], 10, 300, now=NOW)
    await limiter.settle(late, 10, 300)
    await limiter.settle(held, 10, 100)
    counters = await limiter.counters(prepaid, now=NOW)
    assert (counters["spent_nanos"], counters["month_tokens"], counters["month_nanos"]) == (100, 30, 700), counters


async def test_an_expired_grant_pays_for_nothing_before_its_expiry_row(limiter: Limiter) -> None:
    """A grant's expiry row waits until the usage admitted before the expiry is posted (minutes:
    billing/credits/balance.py:expire_grants). Until then the limiter held the grant as available,
    and requests admitted after the expiry spent it (the spend audit: a $0.01 grant, 50 requests
    admitted after it expired, the balance at -$0.01). Now none of an expired grant is available
    until its end is told (the expiry row, or that nothing was left of it)."""
    account = int(uuid.uuid4().int % 10**9)
    prepaid = Scope("account", account, Limits(monthly_tokens=100_000), True)
    await limiter.credit(account, 1, 1_000)  # bought
    await limiter.credit(account, 2, 5_000, expires_at=NOW + 60)  # granted, for a minute
    await limiter.settle(await limiter.reserve(rid(), [prepaid], 1, 4_000, now=NOW), 1, 4_000)  # the grant pays
    with pytest.raises(QuotaExceeded):  # past its expiry: what is left of it is not the account's
        await limiter.reserve(rid(), [prepaid], 1, 500, now=NOW + 61)
    await limiter.credit(account, 3, -1_000, ends_grant=2)  # its expiry row: 1,000 of it was left
    await limiter.settle(await limiter.reserve(rid(), [prepaid], 1, 1_000, now=NOW + 62), 1, 1_000)  # the bought 1,000
    with pytest.raises(QuotaExceeded):
        await limiter.reserve(rid(), [prepaid], 1, 1, now=NOW + 63)
    # A grant all used before it expired has no expiry row: its end is told without one.
    await limiter.credit(account, 4, 2_000, expires_at=NOW + 70)
    await limiter.settle(await limiter.reserve(rid(), [prepaid], 1, 2_000, now=NOW + 64), 1, 2_000)
    await limiter.credit(account, 5, 300)
    with pytest.raises(QuotaExceeded):
        await limiter.reserve(rid(), [prepaid], 1, 300, now=NOW + 71)
    await limiter.credit(account, None, 0, ends_grant=4)
    await limiter.reserve(rid(), [prepaid], 1, 300, now=NOW + 72)


async def test_unlimited_scopes_cost_nothing(limiter: Limiter) -> None:
    hold = await limiter.reserve(rid(), [scope(), scope("account")], 10**6, 10**9, now=NOW)
    assert hold.scopes == () and hold.remaining == ()
    assert await limiter.settle(hold, 5, 5) is False


async def test_ratelimit_headers(limiter: Limiter) -> None:
    from gateway.serving.ratelimit import hold_headers, refusal_headers

    key = scope(rpm=10, tpm=1000)
    account = scope("account", rpm=1)
    hold = await limiter.reserve(rid(), [key, account], 100, 0, now=NOW)
    headers = hold_headers(hold)
    assert headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "900"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    with pytest.raises(QuotaExceeded) as info:
        await limiter.reserve(rid(), [key, account], 100, 0, now=NOW)
    refused = refusal_headers(info.value)
    assert refused["Retry-After"] == str(info.value.retry_after) and refused["x-ratelimit-remaining-requests"] == "0"


@pytest.mark.parametrize(
    "bad",
    [{"rpm": -1}, {"rpm": 1.5}, {"rpm": "10"}, {"tpm": True}, {"monthly_spend": 1.25}, {"monthly_spend": "abc"},
     {"monthly_spend": "-1"}, {"monthly_spend": "0.0000000001"}, {"burst": 3}, {"monthly_tokens": 2**60}],
)
def test_invalid_limits_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidLimits):
        Limits().patched(bad)


def test_limits_patch_semantics() -> None:
    limits = Limits().patched({"rpm": 10, "monthly_spend": "25.50"})
    assert limits.monthly_spend == Decimal("25.50") and limits.monthly_spend_nanos == 25_500_000_000
    changed = limits.patched({"rpm": None, "tpm": 5})
    assert changed.view() == {"tpm": 5, "monthly_spend": "25.50"}
    assert Limits.from_json(changed.to_json()) == changed


def test_limits_are_empty_only_with_no_limit_set() -> None:
    from dataclasses import fields

    from billing.quota.limits import Limits

    assert Limits().empty
    for f in fields(Limits):  # a limit added later must make `empty` false too
        assert not Limits(**{f.name: 1}).empty, f.name


async def test_the_settle_once_marker_lives_as_long_as_a_hold(ledger_url: str) -> None:
    """Settling twice still counts once, and the marker that ensures it is gone after the hold time
    (not a day: at 1,000 requests/s a day of markers is ~86M Redis keys)."""
    require_redis(REDIS_URL)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    db = create_engine(ledger_url)
    lim = RedisLimiter(REDIS_URL, LedgerTotals(db), prefix=prefix, timeout=0.5, hold_seconds=120)
    client = redis_asyncio.Redis.from_url(REDIS_URL)
    try:
        key = scope(monthly_tokens=1000)
        hold = await lim.reserve(rid(), [key], 100, 0)
        assert await lim.settle(hold, 40, 0) is True
        assert await lim.settle(hold, 40, 0) is False  # the repeat is a no-op
        assert (await lim.counters(key))["month_tokens"] == 40
        ttl = await client.ttl(f"{lim.group(hold.tag)}settled:{hold.request_id}")  # the key's group: {k<id>}
        assert 60 <= ttl <= 120
    finally:
        await lim.flush_all()
        await lim.close()
        await client.aclose()
        await db.dispose()


async def test_background_settlements_end_and_their_failures_are_logged(limiter: Limiter, caplog: pytest.LogCaptureFixture,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # settle_later is how every request's hold is settled: each one is forgotten once done (none kept
    # for the limiter's life), and one that fails is logged by type. The memory limiter's own
    # `_settled` record once shadowed the done-callback, so neither happened there.
    key = scope(monthly_tokens=10_000)
    holds = [await limiter.reserve(rid(), [key], 100, 0, now=NOW) for _ in range(3)]
    for hold in holds[:2]:
        limiter.settle_later(hold, 40, 0)
    await limiter.drain()  # its wait's callback comes after settle_later's own on each task
    assert not limiter._settling
    assert (await limiter.counters(key, now=NOW))["month_tokens"] == 80

    async def broken(*args: Any, **kwargs: Any) -> bool:
        raise ConnectionResetError

    monkeypatch.setattr(limiter, "settle", broken)
    with caplog.at_level("ERROR", logger="tollgate.metering"):
        limiter.settle_later(holds[2], 40, 0)
        await limiter.drain()
    assert not limiter._settling
    assert [r.getMessage() for r in caplog.records if r.name == "tollgate.metering"] == ["quota settlement failed: ConnectionResetError"]


async def test_monthly_spend_counts_what_was_used_not_what_was_held(limiter: Limiter) -> None:
    """A settlement adds the request's actual cost to the month's spend and gives back the rest of its
    hold: 30,000 nanos held, 12,000 used, so 33,000 more fit a 45,000 budget exactly, and not a nano
    beyond. (Settling the hold's own figure would refuse money the account still has.)"""
    key = scope(monthly_spend="0.000045")  # 45,000 nano-USD
    hold = await limiter.reserve(rid(), [key], 100, 30_000, now=NOW)
    await limiter.settle(hold, 40, 12_000)
    counters = await limiter.counters(key, now=NOW)
    assert (counters["month_nanos"], counters["held_nanos"]) == (12_000, 0), counters
    rest = await limiter.reserve(rid(), [key], 1, 33_000, now=NOW)
    with pytest.raises(QuotaExceeded) as info:
        await limiter.reserve(rid(), [key], 1, 1, now=NOW)
    assert info.value.limit == "monthly_spend"
    await limiter.settle(rest, 1, 33_000)
    assert (await limiter.counters(key, now=NOW))["month_nanos"] == 45_000


@pytest.mark.parametrize("store", ["redis", "cluster"])
async def test_a_crashed_processs_expired_hold_gives_its_money_back(store: str, request: pytest.FixtureRequest, ledger_url: str) -> None:
    """A dead process's hold, once expired and swept, gives back its nano-USD as well as its place and
    tokens: a monthly_spend held in full by a crashed request is whole again for the other processes."""
    if store == "redis":
        require_redis(REDIS_URL)
    url = REDIS_URL if store == "redis" else request.getfixturevalue("redis_cluster").url
    db = create_engine(ledger_url)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    crashed, other = (RedisLimiter(url, LedgerTotals(db), prefix=prefix, timeout=0.5, hold_seconds=30) for _ in range(2))
    try:
        t0 = time.time()
        key = scope(monthly_spend="0.000045")  # 45,000 nano-USD
        await crashed.reserve(rid(), [key], 100, 45_000, now=t0)
        await crashed.close()  # dies without settling: its hold expires at t0 + 30
        with pytest.raises(QuotaExceeded) as info:
            await other.reserve(rid(), [key], 1, 1, now=t0 + 29)
        assert info.value.limit == "monthly_spend"
        await other.reserve(rid(), [key], 1, 45_000, now=t0 + 31)  # the whole budget again
        counters = await other.counters(key, now=t0 + 31)
        assert (counters["held_nanos"], counters["held_tokens"], counters["in_flight"]) == (45_000, 1, 1), counters
    finally:
        await other.flush_all()
        await other.close()
        await db.dispose()


async def test_a_re_registration_that_arrives_after_its_settlement_does_not_bring_the_hold_back(ledger_url: str) -> None:
    """A re-registration of this process's running holds (rehold.lua, after Redis lost them) is built
    from the holds live when it leaves; a settlement sent meanwhile may reach Redis first (another
    connection, another node). The settled request's hold must not come back: it would hold its
    place and its money until it expired, with no process to settle it."""
    require_redis(REDIS_URL)
    db = create_engine(ledger_url)
    lim = RedisLimiter(REDIS_URL, LedgerTotals(db), prefix=f"tgtest:{uuid.uuid4().hex[:8]}:", timeout=0.5)
    try:
        now = time.time()
        key = scope(max_concurrent=1, monthly_spend="0.000045")
        hold = await lim.reserve(rid(), [key], 100, 45_000, now=now)
        args, live = lim._rehold_args(hold.tag, now)  # built while the request runs
        assert [h.request_id for h in live] == [hold.request_id]
        assert await lim.settle(hold, 10, 5_000) is True  # its settlement reaches Redis first
        await lim._client.run(lim._rehold_script, lim.group(hold.tag) + "epoch", args, 0.0)
        counters = await lim.counters(key, now=now)
        assert (counters["in_flight"], counters["held_nanos"], counters["month_nanos"]) == (0, 0, 5_000), counters
        await lim.reserve(rid(), [key], 1, 40_000, now=now)  # its place and the rest of the budget are free
    finally:
        await lim.flush_all()
        await lim.close()
        await db.dispose()


async def test_usage_settled_during_a_rebuild_whose_unc_entry_is_struck_off_meanwhile_counts_once(ledger_url: str) -> None:
    """A request settles while its group waits for a rebuild (its usage filed in `pend` and `unc`); the
    rebuild's ledger read does not hold its row; the row is written and struck off `unc` (carried by
    another settlement of the account) before the rebuild finishes. The rebuild still counts it, from
    `pend`: its snapshot cannot see the row, and nothing else has it."""
    require_redis(REDIS_URL)
    db = create_engine(ledger_url)
    lim = RedisLimiter(REDIS_URL, LedgerTotals(db), prefix=f"tgtest:{uuid.uuid4().hex[:8]}:", timeout=0.5)
    try:
        account = scope("account", monthly_tokens=100_000)
        first = await lim.reserve(rid(), [account], 100, 0, now=NOW)
        other = await lim.reserve(rid(), [account], 100, 0, now=NOW)
        await lim.invalidate(account)
        assert await lim.settle(first, 60, 0) is True  # the counters wait for their rebuild: filed
        gated = GatedTotals(lim.totals)
        lim.totals = gated  # type: ignore[assignment]
        gated.gate_present = True
        rebuilding = asyncio.create_task(lim.reserve(rid(), [account], 10, 0, now=NOW))
        await gated.asked.wait()  # the rebuild's snapshot is read; it asks whether it holds `first`
        row = UsageRecord(request_id=first.request_id, account_id=account.id, key_id=1, model="m", prompt_tokens=60,
                          completion_tokens=0, status="completed", finish_reason="stop", total_ms=1.0,
                          created_at=month_start(NOW).replace(day=2))
        await write_records(db, [row])
        lim.written([row])
        await lim.settle(other, 0, 0)  # carries the strike-off of `first` from `unc`
        gated.answer.set()
        await rebuilding
        assert (await lim.counters(account, now=NOW))["month_tokens"] == 60
        lim.totals = gated.inner  # type: ignore[assignment]
        await lim.invalidate(account)
        await lim.reserve(rid(), [account], 10, 0, now=NOW)  # rebuilt again: from the ledger, which holds it now
        assert (await lim.counters(account, now=NOW))["month_tokens"] == 60
    finally:
        await lim.flush_all()
        await lim.close()
        await db.dispose()


async def test_a_renewal_that_arrives_after_its_settlement_does_not_bring_the_hold_back(ledger_url: str) -> None:
    """The hold watch renews the holds due when its round starts (renew.lua puts back one the store
    lost); a settlement of one of them may reach Redis first. The settled hold must stay gone, or it
    holds its place and money until it expires with no process to settle it."""
    require_redis(REDIS_URL)
    db = create_engine(ledger_url)
    lim = RedisLimiter(REDIS_URL, LedgerTotals(db), prefix=f"tgtest:{uuid.uuid4().hex[:8]}:", timeout=0.5)
    try:
        now = time.time()
        key = scope(max_concurrent=1, monthly_spend="0.000045")
        hold = await lim.reserve(rid(), [key], 100, 45_000, now=now)
        assert await lim.settle(hold, 10, 5_000) is True
        await lim._renew([hold], now + lim.hold_seconds)  # the round's renewal, sent before the settlement
        counters = await lim.counters(key, now=now)
        assert (counters["in_flight"], counters["held_nanos"], counters["month_nanos"]) == (0, 0, 5_000), counters
        await lim.reserve(rid(), [key], 1, 40_000, now=now)
    finally:
        await lim.flush_all()
        await lim.close()
        await db.dispose()
