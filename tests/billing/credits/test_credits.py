"""Prepaid credit (issue 25): the credit ledger (grants before purchased credit, expiry by a row,
balance == the ledger's sum once usage is posted) and the limiter's balance check, in-process and
on Redis with two limiters sharing it (two gateway processes), exact to the nano; a hypothesis
property over concurrent requests, top-ups, process restarts and lost counters."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from billing import migrate
from billing.credits.balance import CreditBook, CreditError, parse_usd
from billing.db import create_engine
from billing.ledger.writer import UsageRecord, write_records
from billing.quota.limits import Limits
from billing.models import utcnow
from billing.quota import LedgerTotals, Limiter, MemoryLimiter, QuotaExceeded, RedisLimiter, Scope
from tests.billing.invoice_helpers import new_account
from tests.conftest import REDIS_URL, require_redis, run_coro

CENT = 10_000_000  # $0.01 in nano-USD


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest, fresh_pg_database: Any, migrated_sqlite: Any, tmp_path: Path) -> str:
    url = fresh_pg_database(migrated=True) if request.param == "postgres" else migrated_sqlite(tmp_path / 'c.db')
    migrate.upgrade(url)
    return url


async def spend(db: Any, account: int, nanos: int, when: Any = None) -> str:
    rid = uuid.uuid4().hex
    await write_records(db, [UsageRecord(
        request_id=rid, account_id=account, key_id=1, model="m", prompt_tokens=1, completion_tokens=1,
        status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=nanos, created_at=when or utcnow(),
    )])
    return rid


async def ledger_sum(db: Any, account: int) -> int:
    async with db.connect() as conn:
        return int((await conn.execute(sa.text("SELECT coalesce(sum(amount_nanos), 0) FROM credit_entries WHERE account_id = :a"),
                                       {"a": account})).scalar_one())


def test_amounts_are_exact_and_floats_refused() -> None:
    assert parse_usd("0.01") == CENT and parse_usd(3) == 3 * 10**9 and parse_usd("-2.5", signed=True) == -2_500_000_000
    for bad in (0.01, "0.0000000001", "0", "-1", True, "abc", "1e400"):
        with pytest.raises(CreditError):
            parse_usd(bad)


async def test_grants_are_spent_first_and_expire_by_a_row(db_url: str) -> None:
    db = create_engine(db_url)
    try:
        book = CreditBook(db, settle_seconds=0)
        a = await new_account(db)
        await book.set_mode(a, "prepaid")
        now = utcnow()
        await book.add(a, "topup", 1_000 * CENT, external_id="cs_test_1")
        assert await book.add(a, "topup", 1_000 * CENT, external_id="cs_test_1") is None  # the same session again: nothing
        late = await book.add(a, "grant", 300 * CENT, expires_at=now + timedelta(days=30))
        soon = await book.add(a, "grant", 200 * CENT, expires_at=now + timedelta(hours=1))
        assert late and soon
        await spend(db, a, 250 * CENT)
        posted = await book.post_usage(a)
        # the grant that expires first is used first, then the next one; purchased credit untouched
        assert [(e["grant_id"], e["amount_nanos"]) for e in posted] == [(soon["id"], -200 * CENT), (late["id"], -50 * CENT)]
        assert await book.post_usage(a) == []  # nothing new to post
        balance = await book.balance(a)
        assert balance is not None and balance["balance_nanos"] == 1_250 * CENT == await ledger_sum(db, a)
        # usage after the soon grant is gone, then its expiry: the late grant's rest is removed by one row
        await spend(db, a, 100 * CENT)
        expired = await book.expire_grants(now=now + timedelta(days=31))
        assert [(e["kind"], e["grant_id"], e["amount_nanos"]) for e in expired] == [("expiry", late["id"], -150 * CENT)]
        assert await book.expire_grants(now=now + timedelta(days=32)) == []  # once per grant
        balance = await book.balance(a)
        assert balance is not None and balance["balance_nanos"] == 1_000 * CENT == await ledger_sum(db, a)
        with pytest.raises(CreditError, match="reason"):
            await book.add(a, "adjustment", -CENT)
        adj = await book.add(a, "adjustment", -CENT, reason="goodwill reversed", admin_key_id=42)
        assert adj is not None and (adj["reason"], adj["admin_key_id"]) == ("goodwill reversed", 42)
        assert (await book.balance(a))["balance_nanos"] == 999 * CENT == await ledger_sum(db, a)  # type: ignore[index]
    finally:
        await db.dispose()


CLUSTER_URL: list[str] = []  # the session's local Redis Cluster, once a test asked for it


def _limiters(kind: str, db: Any) -> tuple[Limiter, Limiter]:
    """Two limiters sharing one store: two gateway processes on Redis (or Redis Cluster); one process in memory."""
    if kind == "memory":
        one = MemoryLimiter(LedgerTotals(db))
        return one, one
    url = CLUSTER_URL[0] if kind == "cluster" else REDIS_URL
    prefix = f"tgtest:credits:{uuid.uuid4().hex[:8]}:"
    return RedisLimiter(url, LedgerTotals(db), prefix=prefix, timeout=2.0), RedisLimiter(url, LedgerTotals(db), prefix=prefix, timeout=2.0)


@pytest.fixture(params=["memory", "redis", "cluster"])
def limiter_kind(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        require_redis(REDIS_URL)
    if request.param == "cluster":
        CLUSTER_URL[:] = [request.getfixturevalue("redis_cluster").url]
    return str(request.param)


@contextlib.asynccontextmanager
async def prepaid_account(fresh_pg_database: Any, limiter_kind: str) -> Any:
    """(database, two limiters sharing one store, a CreditBook told of credits, a new prepaid account)."""
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    one, two = _limiters(limiter_kind, db)
    try:
        a = await new_account(db)
        book = CreditBook(db, one, settle_seconds=0)
        await book.set_mode(a, "prepaid")
        yield db, one, two, book, a
    finally:
        await one.close()
        if two is not one:
            await two.close()
        await db.dispose()


async def test_200_concurrent_reservations_never_overspend_a_cent(fresh_pg_database: Any, limiter_kind: str) -> None:
    async with prepaid_account(fresh_pg_database, limiter_kind) as (db, one, two, book, a):
        await book.add(a, "topup", CENT)
        scope = [Scope("account", a, Limits(), prepaid=True)]
        worst = 199_997  # 7 tokens x 28,571 nano-USD: 50 fit in $0.01 with 150 nanos left

        async def attempt(i: int) -> Any:
            try:
                return await (one if i % 2 else two).reserve(uuid.uuid4().hex, scope, 7, worst)
            except QuotaExceeded as exc:
                return exc

        results = await asyncio.gather(*[attempt(i) for i in range(200)])
        held = [r for r in results if not isinstance(r, QuotaExceeded)]
        refused = [r for r in results if isinstance(r, QuotaExceeded)]
        assert len(held) == CENT // worst == 50
        assert all(e.error_type == "insufficient_quota" and e.limit == "insufficient_quota" for e in refused)
        assert "$0.000000150 available" in str(refused[-1])
        for i, hold in enumerate(held):  # half use less than they reserved: the rest is released
            actual = worst if i % 2 else 100_000
            await write_records(db, [UsageRecord(request_id=hold.request_id, account_id=a, key_id=1, model="m", prompt_tokens=0,
                                                 completion_tokens=7, status="completed", finish_reason="stop", total_ms=1.0,
                                                 cost_nanos=actual)])
            await (two if i % 2 else one).settle(hold, 7, actual)
        spent = 25 * worst + 25 * 100_000
        counters = await one.counters(scope[0])
        assert (counters["credits_nanos"], counters["spent_nanos"], counters["held_nanos"]) == (CENT, spent, 0)
        assert (await book.balance(a))["balance_nanos"] == CENT - spent  # type: ignore[index]
        again = CENT - spent  # exactly the rest fits, one nano more does not
        with pytest.raises(QuotaExceeded):
            await one.reserve(uuid.uuid4().hex, scope, 1, again + 1)
        last = await two.reserve(uuid.uuid4().hex, scope, 1, again)
        await one.settle(last, 1, 0)
        await book.post_usage(a)
        assert await ledger_sum(db, a) == CENT - spent


async def test_a_refusal_says_a_balance_below_zero_as_it_is(fresh_pg_database: Any, limiter_kind: str) -> None:
    """A refund of a top-up already spent takes the balance below zero; the refusal names that figure
    (before, it said "$0.000000000 available", as for an empty balance)."""
    async with prepaid_account(fresh_pg_database, limiter_kind) as (_db, one, two, book, a):
        await book.add(a, "topup", CENT, external_id="cs_test_refunded")
        await book.add(a, "refund", -3 * CENT, external_id="re_test_more")
        with pytest.raises(QuotaExceeded) as refused:
            await two.reserve(uuid.uuid4().hex, [Scope("account", a, Limits(), prepaid=True)], 1, 1)
        assert "prepaid balance (-$0.020000000 available)" in str(refused.value), str(refused.value)


async def test_a_top_up_reaches_a_running_limiter_once(fresh_pg_database: Any, limiter_kind: str) -> None:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    one, two = _limiters(limiter_kind, db)
    try:
        a = await new_account(db)
        book = CreditBook(db, one)
        await book.set_mode(a, "prepaid")
        scope = [Scope("account", a, Limits(), prepaid=True)]
        with pytest.raises(QuotaExceeded, match=r"\$0.000000000 available"):
            await two.reserve(uuid.uuid4().hex, scope, 1, 1)  # balance 0: refused (and the counters are seeded)
        await book.add(a, "topup", CENT)  # applied to the running limiter by row id
        await book.sync_recent()  # the periodic re-apply of recent rows adds nothing more
        await book.sync_recent()
        assert (await two.counters(scope[0]))["credits_nanos"] == CENT
        hold = await two.reserve(uuid.uuid4().hex, scope, 1, CENT)
        with pytest.raises(QuotaExceeded):
            await one.reserve(uuid.uuid4().hex, scope, 1, 1)
        await one.settle(hold, 1, 0)
    finally:
        await one.close()
        if two is not one:
            await two.close()
        await db.dispose()


# property: any interleaving of concurrent requests, top-ups and restarts ------------------------
STEP = st.one_of(
    st.tuples(st.just("requests"), st.lists(st.tuples(st.integers(1, CENT), st.integers(0, 100)), min_size=1, max_size=8)),
    st.tuples(st.just("topup"), st.integers(1, 2 * CENT)),
    st.tuples(st.just("restart"), st.just(0)),
    st.tuples(st.just("lose"), st.just(0)),  # the store loses its counters (a Redis restart or flush)
)


async def balance_property(url: str, kind: str, steps: list[tuple[str, Any]]) -> None:
    db = create_engine(url)
    limiters = list(_limiters(kind, db))
    try:
        a = await new_account(db)
        book = CreditBook(db, limiters[0], settle_seconds=0)
        await book.set_mode(a, "prepaid")
        await book.add(a, "grant", CENT, expires_at=utcnow() + timedelta(days=1))
        scope = [Scope("account", a, Limits(), prepaid=True)]
        credited, spent, seeded = CENT, 0, False  # seeded: a reservation since the last restart read the balance
        for step, arg in steps:
            if step == "topup":
                await book.add(a, "topup", arg)
                credited += arg
            elif step == "restart":  # a new process (in memory: the state is gone; on Redis: a new client)
                for lim in {id(x): x for x in limiters}.values():
                    await lim.close()
                limiters[:] = _limiters(kind, db) if kind == "memory" else [
                    RedisLimiter(CLUSTER_URL[0] if kind == "cluster" else REDIS_URL, LedgerTotals(db), prefix=limiters[0].prefix,  # type: ignore[attr-defined]
                                 timeout=2.0) for _ in range(2)]
                book = CreditBook(db, limiters[0], settle_seconds=0)
                seeded = False
            elif step == "lose":
                if kind != "memory":
                    await limiters[0].flush_all()  # type: ignore[attr-defined]
                else:
                    await limiters[0].invalidate(scope[0])
                seeded = False
            else:
                seeded = True
                async def one(i: int, worst: int, percent: int) -> int:
                    lim = limiters[i % 2]
                    try:
                        hold = await lim.reserve(uuid.uuid4().hex, scope, 1, worst)
                    except QuotaExceeded:
                        return 0
                    actual = worst * percent // 100
                    await write_records(db, [UsageRecord(
                        request_id=hold.request_id, account_id=a, key_id=1, model="m", prompt_tokens=0, completion_tokens=1,
                        status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=actual)])
                    await lim.settle(hold, 1, actual)  # the process that admitted it settles it
                    return actual

                spent += sum(await asyncio.gather(*[one(i, w, p) for i, (w, p) in enumerate(arg)]))
            assert spent <= credited  # never more than the account had, at any concurrency
            balance = await book.balance(a)
            assert balance is not None and balance["balance_nanos"] == credited - spent
            await book.post_usage(a)  # incremental: only the rows above the mark
            assert await ledger_sum(db, a) == credited - spent
            seen = await limiters[0].counters(scope[0])
            if seeded:  # the limiter's own view, once it has read the balance
                assert (seen["credits_nanos"] - seen["spent_nanos"], seen["held_nanos"]) == (credited - spent, 0)
        await book.post_usage(a)
        assert await ledger_sum(db, a) == credited - spent == (await book.balance(a))["balance_nanos"]  # type: ignore[index]
    finally:
        for lim in {id(x): x for x in limiters}.values():
            await lim.close()
        await db.dispose()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(STEP, min_size=1, max_size=8))
def test_balance_equals_the_credit_ledger_under_concurrency_top_ups_and_restarts(
    steps: list[tuple[str, Any]], limiter_kind: str, pg_url_once: str
) -> None:
    run_coro(balance_property(pg_url_once, limiter_kind, steps))


@pytest.fixture
def pg_url_once(fresh_pg_database: Any) -> str:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    return url


async def test_prepaid_usage_is_never_invoiced_and_the_month_is_a_statement(db_url: str) -> None:
    from billing.invoices.close import close_period
    from billing.invoices.periods import Period
    from billing.prices.book import PriceBook
    from tests.billing.invoice_helpers import at

    db = create_engine(db_url)
    try:
        book = PriceBook(db)
        await book.add("m", "1.000", "1.000", at(9, 1, 0), backdate=True)
        credits = CreditBook(db)
        a = await new_account(db)
        await spend(db, a, 5 * CENT, when=at(9, 5))  # postpaid then: invoiced
        await credits.set_mode(a, "prepaid")
        async with db.begin() as conn:  # as if it had become prepaid on Sep 10 and bought $1 that day
            await conn.execute(sa.text("UPDATE accounts SET prepaid_since = :t WHERE id = :a"), {"t": at(9, 10), "a": a})
        await credits.add(a, "topup", 100 * CENT, now=at(9, 10, 13))
        await spend(db, a, 3 * CENT, when=at(9, 20))  # prepaid: paid from the balance
        with pytest.raises(CreditError, match="stays prepaid"):
            await credits.set_mode(a, "postpaid")
        await close_period(db, book, Period.parse("2026-09"), now=at(10, 2))
        async with db.connect() as conn:
            tokens = (await conn.execute(sa.text(
                "SELECT sum(l.tokens) FROM invoice_lines l JOIN invoices i ON i.id = l.invoice_id WHERE i.account_id = :a"), {"a": a})).scalar()
        assert tokens == 2  # the one postpaid row's 1 + 1 tokens; the prepaid row is not on the invoice
        statement = await credits.statement(a, at(9, 1, 0), at(10, 1, 0))
        assert statement is not None
        assert (statement["opening_balance_nanos"], statement["usage_nanos"], statement["closing_balance_nanos"]) == (0, 3 * CENT, 97 * CENT)
        assert [c["kind"] for c in statement["credits"]] == ["topup"] and statement["amount_due"] == "0.00"
    finally:
        await db.dispose()


async def usage_rows(db: Any, account: int) -> list[int]:
    async with db.connect() as conn:
        return [int(v) for v in (await conn.execute(sa.text(
            "SELECT amount_nanos FROM credit_entries WHERE account_id = :a AND kind = 'usage' ORDER BY id"), {"a": account})).scalars()]


async def test_usage_posting_reads_only_new_ledger_rows_and_posts_a_late_row_once(db_url: str) -> None:
    db = create_engine(db_url)
    try:
        book = CreditBook(db, settle_seconds=0)
        a = await new_account(db)
        await book.set_mode(a, "prepaid")
        async with db.begin() as conn:  # prepaid since two hours ago
            await conn.execute(sa.text("UPDATE accounts SET prepaid_since = :t WHERE id = :a"), {"t": utcnow() - timedelta(hours=2), "a": a})
        await book.add(a, "topup", 100 * CENT)
        first = await spend(db, a, 3 * CENT)
        assert [e["amount_nanos"] for e in await book.post_usage(a)] == [-3 * CENT]
        # A posted row is never read again: were it (a recompute since prepaid_since), this change
        # of an old row's cost would be posted as a difference.
        async with db.begin() as conn:
            await conn.execute(sa.text("UPDATE ledger_entries SET cost_nanos = cost_nanos + 7 WHERE request_id = :r"), {"r": first})
        assert await book.post_usage(a) == []
        # A row that finished an hour ago and reached the ledger only now (a journal replay): posted once.
        await spend(db, a, 2 * CENT, when=utcnow() - timedelta(hours=1))
        assert [e["amount_nanos"] for e in await book.post_usage(a)] == [-2 * CENT]
        assert await book.post_usage(a) == [] and await usage_rows(db, a) == [-3 * CENT, -2 * CENT]
    finally:
        await db.dispose()


async def test_usage_is_posted_once_by_two_processes_posting_at_once(db_url: str) -> None:
    db, other_db = create_engine(db_url), create_engine(db_url)
    try:
        books = [CreditBook(db, settle_seconds=0), CreditBook(other_db, settle_seconds=0)]  # two gateway processes
        a = await new_account(db)
        await books[0].set_mode(a, "prepaid")
        await books[0].add(a, "grant", 10 * CENT, expires_at=utcnow() + timedelta(days=1))
        await books[0].add(a, "topup", 100 * CENT)
        total = 0
        for round_ in range(12):
            for n in range(3):
                await spend(db, a, CENT + round_ * 3 + n)
                total += CENT + round_ * 3 + n
            await asyncio.gather(*[books[i % 2].post_usage(a) for i in range(4)])
        assert -sum(await usage_rows(db, a)) == total  # every nano once
        balance = await books[1].balance(a)
        assert balance is not None and balance["balance_nanos"] == balance["ledger_sum_nanos"] == 110 * CENT - total
        assert balance["grants"] == []  # the grant was spent first
    finally:
        await db.dispose()
        await other_db.dispose()


async def test_a_batch_posts_only_up_to_an_id_seen_settle_seconds_before(fresh_pg_database: Any) -> None:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        book = CreditBook(db, settle_seconds=60)  # Postgres: a lower id may still commit for a while
        a = await new_account(db)
        await book.set_mode(a, "prepaid")
        await book.add(a, "topup", 100 * CENT)
        t0 = utcnow()
        await spend(db, a, CENT)
        assert await book.post_usage(a, t0) == []  # first sight of the ledger's highest id: nothing posted yet
        await spend(db, a, 2 * CENT)  # above what was seen at t0
        assert await book.post_usage(a, t0 + timedelta(seconds=30)) == []  # not settled yet
        assert [e["amount_nanos"] for e in await book.post_usage(a, t0 + timedelta(seconds=61))] == [-CENT]
        assert [e["amount_nanos"] for e in await book.post_usage(a, t0 + timedelta(seconds=122))] == [-2 * CENT]
        balance = await book.balance(a)  # exact whatever is posted: posted + the rows above the mark
        assert balance is not None and balance["balance_nanos"] == 97 * CENT == balance["ledger_sum_nanos"]
    finally:
        await db.dispose()


async def test_a_request_authenticated_as_postpaid_is_invoiced_after_the_switch(db_url: str, tmp_path: Path) -> None:
    """A key is cached for a second in each process (KeyStore), and `tollgate credits mode` or another
    process's admin call does not reach that cache: a request authenticated just before the switch is
    admitted after `prepaid_since` with no balance hold and no cap. Its row says `postpaid`, so it is
    invoiced and never spends the balance. Before, the admission instant alone decided: it spent the
    balance its hold never held (an audit: 5,000,000 nano-USD against a 1,000,000 balance, -4,000,000)."""
    from billing.invoices.close import close_period
    from billing.invoices.periods import Period
    from billing.keys.store import KeyStore
    from billing.ledger.writer import LedgerWriter
    from billing.prices.book import PriceBook
    from gateway.serving.admission import Meter, Usage

    db = create_engine(db_url)
    ledger = LedgerWriter(db)
    ledger.start()
    try:
        prices = PriceBook(db, refresh_seconds=0)
        await prices.add("m", "1.000", "2.000", utcnow() - timedelta(seconds=1), backdate=True)
        limiter = MemoryLimiter(LedgerTotals(db, flush=ledger.flush))
        keys = KeyStore(db, b"s" * 32, cache_seconds=3600.0)  # the cached principal outlives the switch
        account = (await keys.create_account("switching"))["id"]
        secret = (await keys.create_key(account))["key"]
        assert not (await keys.authenticate(secret)).prepaid
        credits = CreditBook(db, limiter, settle_seconds=0)
        await credits.set_mode(account, "prepaid")
        await credits.add(account, "topup", CENT // 10)
        stale = await keys.authenticate(secret)
        assert not stale.prepaid  # the case: admitted after prepaid_since as a postpaid account's request
        meter = Meter(ledger, limiter=limiter, prices=prices)
        usage = Usage()
        admission = await meter.admit("late-1", stale, "m", usage, tokens=3000, cost=lambda price: price.cost_nanos(1000, 2000))
        usage.prompt_tokens, usage.completion_tokens, usage.finish_reason = 1000, 2000, "stop"
        admission.settle()
        await meter.drain()
        await ledger.flush()
        balance = await credits.balance(account)
        assert balance is not None and balance["balance_nanos"] == CENT // 10, balance  # untouched
        async with db.connect() as conn:
            row = (await conn.execute(sa.text("SELECT postpaid, cost_nanos, admitted_at FROM ledger_entries WHERE request_id = 'late-1'"))).one()
        assert row.postpaid and row.cost_nanos == 5 * CENT // 10
        now = utcnow()
        await close_period(db, prices, Period.month(now.year, now.month), now=now + timedelta(days=40))
        async with db.connect() as conn:  # its 3,000 tokens are on the month's invoice
            invoiced = (await conn.execute(sa.text(
                "SELECT sum(l.tokens) FROM invoice_lines l JOIN invoices i ON i.id = l.invoice_id WHERE i.account_id = :a"), {"a": account})).scalar()
        assert invoiced == 3000
    finally:
        await ledger.close()
        await db.dispose()


async def test_a_request_admitted_before_its_grant_expired_is_paid_by_the_grant(db_url: str) -> None:
    """A request is held against the grants that have not expired when it is admitted, so its row is
    paid by them however late it finishes: when it lands before the expiry row, the expiry removes only
    what is left; when it lands after (it was still running), an `expiry` row gives back what it used.
    The balance never goes below zero and stays the credit ledger's sum, in the database and in the
    limiter. Before, a row was assigned by when it finished: it went to purchased credit (none here),
    and the balance fell to -$0.90 (an audit's figure)."""
    db = create_engine(db_url)
    try:
        limiter = MemoryLimiter(LedgerTotals(db))
        book = CreditBook(db, limiter, settle_seconds=0)
        t0 = utcnow() - timedelta(hours=2)
        expires = t0 + timedelta(hours=1)  # past by now
        for lands_before_the_expiry in (True, False):
            a = await new_account(db)
            await book.set_mode(a, "prepaid")
            async with db.begin() as conn:
                await conn.execute(sa.text("UPDATE accounts SET prepaid_since = :t WHERE id = :a"), {"t": t0, "a": a})
            grant = await book.add(a, "grant", 100 * CENT, expires_at=expires, now=t0)
            assert grant is not None
            scope = Scope("account", a, Limits(), True)
            admitted = expires - timedelta(minutes=30)  # before the grant expired: held against it
            hold = await limiter.reserve(uuid.uuid4().hex, [scope], 10, 90 * CENT, now=admitted.timestamp())
            row = UsageRecord(request_id=hold.request_id, account_id=a, key_id=1, model="m", prompt_tokens=5, completion_tokens=5,
                              status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=90 * CENT,
                              created_at=expires + timedelta(minutes=30), admitted_at=admitted)
            if lands_before_the_expiry:
                await write_records(db, [row])
                expired = await book.expire_grants()
                assert [(e["kind"], e["amount_nanos"]) for e in expired] == [("expiry", -10 * CENT)]
            else:
                expired = await book.expire_grants()  # the request still runs: the whole rest is removed
                assert [(e["kind"], e["amount_nanos"]) for e in expired] == [("expiry", -100 * CENT)]
                await write_records(db, [row])
                posted = await book.post_usage(a)
                assert [(e["kind"], e["grant_id"], e["amount_nanos"]) for e in posted] == [
                    ("usage", grant["id"], -90 * CENT), ("expiry", grant["id"], 90 * CENT)]
                assert await book.post_usage(a) == []
            await limiter.settle(hold, 10, 90 * CENT)
            balance = await book.balance(a)
            assert balance is not None and balance["balance_nanos"] == 0 == await ledger_sum(db, a), (lands_before_the_expiry, balance)
            counters = await limiter.counters(scope)
            assert counters["credits_nanos"] - counters["spent_nanos"] - counters["held_nanos"] == 0, counters
    finally:
        await db.dispose()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_an_expired_grant_pays_for_no_request_admitted_after_it(db_url: str, kind: str) -> None:
    """From its expiry instant, none of a grant is available for new requests, although its `expiry`
    row comes only once the usage admitted before it is posted (CreditBook tells the limiter each
    grant's expiry; a limiter that lost its state reads it back from the ledger). Before, a $0.01
    grant paid for 50 requests admitted after it expired, and the balance ended at -$0.01 (the spend
    audit)."""
    db = create_engine(db_url)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"

    def make() -> Limiter:
        if kind == "memory":
            return MemoryLimiter(LedgerTotals(db))
        require_redis(REDIS_URL)
        return RedisLimiter(REDIS_URL, LedgerTotals(db), prefix=prefix, timeout=2.0)

    try:
        limiter = make()
        book = CreditBook(db, limiter, settle_seconds=0)
        a = await new_account(db)
        await book.set_mode(a, "prepaid")
        t0 = utcnow() - timedelta(hours=2)
        assert await book.add(a, "topup", 50 * CENT) is not None
        assert await book.add(a, "grant", 100 * CENT, expires_at=t0 + timedelta(hours=1), now=t0) is not None  # past by now
        scope = Scope("account", a, Limits(), True)
        with pytest.raises(QuotaExceeded):  # 150 credited, but 100 of it expired an hour ago
            await limiter.reserve(uuid.uuid4().hex, [scope], 10, 60 * CENT)
        restarted = make()  # a limiter that lost its state (a restart; Redis flushed) reads the grant's expiry back
        if isinstance(restarted, RedisLimiter):
            await restarted.flush_all()
        with pytest.raises(QuotaExceeded):
            await restarted.reserve(uuid.uuid4().hex, [scope], 10, 60 * CENT)
        await limiter.settle(await limiter.reserve(uuid.uuid4().hex, [scope], 10, 40 * CENT), 10, 40 * CENT)
        assert [(e["kind"], e["amount_nanos"]) for e in await book.expire_grants()] == [("expiry", -100 * CENT)]
        with pytest.raises(QuotaExceeded):  # the expiry row: still 10 left, not more
            await limiter.reserve(uuid.uuid4().hex, [scope], 10, 11 * CENT)
        await limiter.reserve(uuid.uuid4().hex, [scope], 10, 10 * CENT)
        for lim in (limiter, restarted):
            await lim.close()
    finally:
        await db.dispose()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_grants_end_the_limiter_never_heard_of_comes_back_with_a_rebuild(db_url: str, kind: str) -> None:
    """A grant's expiry row written where the limiter is not told (the CLI without Redis while the
    gateways are down, a removal lost in a failover) must not block the balance for good: a rebuild
    takes the grants still to end from the ledger. The review found the expired grant's whole amount
    refused through every rebuild."""
    db = create_engine(db_url)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    limiter: Limiter = MemoryLimiter(LedgerTotals(db))
    if kind == "redis":
        require_redis(REDIS_URL)
        limiter = RedisLimiter(REDIS_URL, LedgerTotals(db), prefix=prefix, timeout=2.0)
    try:
        told, untold = CreditBook(db, limiter, settle_seconds=0), CreditBook(db, None, settle_seconds=0)
        a = await new_account(db)
        await told.set_mode(a, "prepaid")
        t0 = utcnow() - timedelta(hours=2)
        assert await told.add(a, "topup", 50 * CENT) is not None
        assert await told.add(a, "grant", 100 * CENT, expires_at=t0 + timedelta(hours=1), now=t0) is not None
        scope = Scope("account", a, Limits(), True)
        with pytest.raises(QuotaExceeded):
            await limiter.reserve(uuid.uuid4().hex, [scope], 10, 60 * CENT)
        assert len(await untold.expire_grants()) == 1  # its expiry row, the limiter not told
        await limiter.invalidate(scope)  # a rebuild reads the ledger: the grant has ended
        with pytest.raises(QuotaExceeded):
            await limiter.reserve(uuid.uuid4().hex, [scope], 10, 51 * CENT)
        await limiter.reserve(uuid.uuid4().hex, [scope], 10, 50 * CENT)
        await limiter.close()
    finally:
        await db.dispose()


async def test_a_limiter_seeded_from_the_ledger_counts_usage_not_yet_posted(fresh_pg_database: Any, limiter_kind: str) -> None:
    """A limiter that reads the balance from the database (its first admission, or after losing its
    counters) takes as spent all the usage since the account became prepaid: what is posted to the
    credit ledger and the rows not posted yet (posting runs every 30 s; a gateway restarts any time).
    Counting the posted part alone would hand out money already spent."""
    async with prepaid_account(fresh_pg_database, limiter_kind) as (db, one, two, book, a):
        await book.add(a, "topup", 10 * CENT)
        await spend(db, a, 3 * CENT)
        assert [e["amount_nanos"] for e in await book.post_usage(a)] == [-3 * CENT]  # through the usage mark
        await spend(db, a, 3 * CENT)  # not posted yet
        balance = await book.balance(a)
        assert balance is not None and (balance["balance_nanos"], balance["unposted_usage_nanos"]) == (4 * CENT, 3 * CENT)
        scope = [Scope("account", a, Limits(), prepaid=True)]
        with pytest.raises(QuotaExceeded) as refused:  # the first admission seeds the balance: $0.04 left
            await two.reserve(uuid.uuid4().hex, scope, 1, 4 * CENT + 1)
        assert "($0.040000000 available)" in str(refused.value)
        hold = await one.reserve(uuid.uuid4().hex, scope, 1, 4 * CENT)
        counters = await one.counters(scope[0])
        assert (counters["credits_nanos"], counters["spent_nanos"], counters["held_nanos"]) == (10 * CENT, 6 * CENT, 4 * CENT)
        await one.settle(hold, 1, 0)


async def test_housekeeping_posts_each_prepaid_accounts_usage(db_url: str) -> None:
    """The periodic housekeeping (the server's loop, `tollgate credits post`) posts every prepaid
    account's usage, so the credit ledger sums to the balance; a postpaid account gets no credit row."""
    from billing.credits.housekeeping import housekeeping

    db = create_engine(db_url)
    try:
        book = CreditBook(db, settle_seconds=0)
        a, b = await new_account(db), await new_account(db)
        await book.set_mode(a, "prepaid")
        await book.add(a, "topup", 10 * CENT)
        await spend(db, a, 3 * CENT)
        await spend(db, b, 5 * CENT)  # postpaid: invoiced
        done = await housekeeping(book, db)
        assert done["expired"] == 0
        balance = await book.balance(a)
        assert balance is not None and (balance["balance_nanos"], balance["unposted_usage_nanos"]) == (7 * CENT, 0), balance
        assert await ledger_sum(db, a) == 7 * CENT
        assert await ledger_sum(db, b) == 0
    finally:
        await db.dispose()
