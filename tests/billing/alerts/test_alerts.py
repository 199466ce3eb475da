"""Spend alerts (issue 25): a crossing sends one signed webhook to a local HTTP receiver (retried
with backoff after failures, every attempt in the delivery log) and one event row, never two,
also when two processes (two services on one Postgres) check at the same moment."""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from billing import migrate
from billing.alerts.spend import SIGNATURE_HEADER, AlertService, verify
from billing.credits.balance import CreditBook, CreditError
from billing.db import create_engine
from billing.keys.store import KeyStore
from billing.ledger.writer import UsageRecord, write_records
from billing.models import utcnow
from tests.conftest import SECRET, ServerThread

CENT = 10_000_000


class Receiver:
    """A local HTTP endpoint that records what arrives and fails the first `fail` deliveries."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.seen: list[tuple[bytes, str]] = []
        self.lock = threading.Lock()

        async def hook(request: Request) -> Response:
            body = await request.body()
            with self.lock:
                self.seen.append((body, request.headers.get(SIGNATURE_HEADER, "")))
                failing = len(self.seen) <= self.fail
            return Response(status_code=500 if failing else 204)

        self.server = ServerThread(Starlette(routes=[Route("/hook", hook, methods=["POST"])]))

    def __enter__(self) -> "Receiver":
        self.server.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.__exit__()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}/hook"


async def spend(db: Any, account: int, key: int, nanos: int, tokens: int = 10) -> None:
    await write_records(db, [UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account, key_id=key, model="m", prompt_tokens=tokens, completion_tokens=0,
        status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=nanos, created_at=utcnow())])


@pytest.fixture
def db_url(fresh_pg_database: Any) -> str:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    return url


async def test_a_crossing_is_one_signed_webhook_across_two_processes(db_url: str) -> None:
    db, other_db = create_engine(db_url), create_engine(db_url)
    first = AlertService(db, CreditBook(db), backoff=0.01)
    second = AlertService(other_db, CreditBook(other_db), backoff=0.01)  # another gateway process
    try:
        keys = KeyStore(db, SECRET.encode())
        account = (await keys.create_account("alerts-" + uuid.uuid4().hex[:6]))["id"]
        key = (await keys.create_key(account))["id"]
        await keys.set_account_limits(account, {"monthly_spend": "0.10"})
        with Receiver(fail=2) as receiver:
            rule80 = await first.add_rule(account, "monthly_spend", percent=80, url=receiver.url)
            rule_key = await first.add_rule(account, "monthly_tokens", threshold=100, key_id=key, url=receiver.url)
            with pytest.raises(CreditError):
                await first.add_rule(account, "monthly_spend", url=receiver.url)  # neither threshold nor percent

            await spend(db, account, key, 7 * CENT, tokens=60)  # $0.07 < 80% of $0.10; 60 tokens < 100
            assert await first.check() == [] and await second.check() == []
            await spend(db, account, key, CENT + 1, tokens=40)  # $0.080000001 and 100 tokens: both cross
            made = await asyncio.gather(first.check(), second.check(), first.check(), second.check())
            await first.drain()
            await second.drain()
            assert sorted(e for ids in made for e in ids) == sorted({e for ids in made for e in ids})  # nobody twice
            assert len([e for ids in made for e in ids]) == 2  # one per rule

            delivered = receiver.seen[2:]  # the first two deliveries got 500 and were retried
            assert len(receiver.seen) == 4 and len(delivered) == 2
            for body, header in receiver.seen:
                secret = rule80["secret"] if b'"metric":"monthly_spend"' in body else rule_key["secret"]
                assert verify(secret, body, header)
                assert not verify("whsec_wrong", body, header)
            assert b'"value":80000001' in b"".join(b for b, _ in receiver.seen)
            async with db.connect() as conn:
                log = (await conn.execute(sa.text("SELECT event_id, attempt, status_code FROM alert_deliveries ORDER BY id"))).all()
                undelivered = (await conn.execute(sa.text("SELECT count(*) FROM alert_events WHERE delivered_at IS NULL"))).scalar()
            assert sorted(status for _, _, status in log) == [204, 204, 500, 500] and undelivered == 0
            assert sorted(attempt for _, attempt, status in log if status == 204) != [1, 1]  # retries happened

            await spend(db, account, key, CENT, tokens=50)  # further spend in the same month: no second alert
            assert await first.check() == [] and await second.check() == []
            events = await first.events(account)
            assert {e["message"] for e in events} >= {
                f"The monthly spend of account {account} for {utcnow():%Y-%m} is $0.080000001, past $0.080000000 (80% of its limit)."}
    finally:
        await first.close()
        await second.close()
        await db.dispose()
        await other_db.dispose()


async def test_a_month_crossed_by_a_row_written_after_it_ended_is_alerted_once(db_url: str) -> None:
    """A request admitted on Oct 31 23:59:59 whose row is written on Nov 1 (it was still running) may
    cross October's threshold after October ended: the check reads the month before for a few days
    (LATE_ROWS) and records October's crossing, once, keyed and worded by October. Before, a check only
    read the month of its own clock, so that crossing was never alerted (an audit: October's $1.40
    against a $1 rule, no event)."""
    from datetime import datetime, timezone

    from billing.alerts.spend import LATE_ROWS

    def at(month: int, day: int, *hms: int) -> datetime:
        return datetime(2026, month, day, *hms, tzinfo=timezone.utc)

    db = create_engine(db_url)
    service = AlertService(db, CreditBook(db), backoff=0.01)
    try:
        keys = KeyStore(db, SECRET.encode())
        account = (await keys.create_account("late-" + uuid.uuid4().hex[:6]))["id"]

        async def row(nanos: int, admitted: datetime, written: datetime) -> None:
            await write_records(db, [UsageRecord(
                request_id=uuid.uuid4().hex, account_id=account, key_id=1, model="m", prompt_tokens=1, completion_tokens=0,
                status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=nanos, created_at=written, admitted_at=admitted)])

        with Receiver() as receiver:
            rule = await service.add_rule(account, "monthly_spend", threshold=100 * CENT, url=receiver.url)
            async with db.begin() as conn:  # made in October
                await conn.execute(sa.text("UPDATE alert_rules SET created_at = :t WHERE id = :r"), {"t": at(10, 1), "r": rule["id"]})
            late = await service.add_rule(account, "monthly_spend", threshold=100 * CENT, url=receiver.url)  # made after October: silent on it
            await row(90 * CENT, at(10, 20), at(10, 20))
            assert await service.check(now=at(10, 31, 23, 59, 30)) == []
            await row(50 * CENT, at(10, 31, 23, 59, 59), at(11, 1, 0, 0, 20))  # October's, written in November
            assert await service.check(at(11, 1) + LATE_ROWS + timedelta(seconds=1)) == []  # too late to read October
            [made] = await service.check(now=at(11, 1, 0, 0, 30))
            assert await service.check(now=at(11, 2)) == []  # once
            await service.drain()
            [event] = await service.events(account)
            assert event["id"] == made and event["crossing"] == "2026-10" and event["value"] == 140 * CENT, event
            assert event["rule_id"] == rule["id"] != late["id"]
            assert event["message"] == f"The monthly spend of account {account} for 2026-10 is $1.400000000, past $1.000000000.", event
    finally:
        await service.close()
        await db.dispose()


async def test_balance_below_fires_once_and_rearms_only_when_the_balance_rises_above(db_url: str) -> None:
    db, other_db = create_engine(db_url), create_engine(db_url)
    book = CreditBook(db)
    service = AlertService(db, book, backoff=0.01)
    other = AlertService(other_db, CreditBook(other_db), backoff=0.01)  # another gateway process
    try:
        keys = KeyStore(db, SECRET.encode())
        account = (await keys.create_account("bal-" + uuid.uuid4().hex[:6]))["id"]
        key = (await keys.create_key(account))["id"]
        await book.set_mode(account, "prepaid")
        await book.add(account, "topup", 10 * CENT)
        with Receiver() as receiver:
            await service.add_rule(account, "balance_below", threshold=2 * CENT, url=receiver.url)
            await spend(db, account, key, 8 * CENT)  # balance $0.02: not below
            assert await service.check() == []
            await spend(db, account, key, 1)  # $0.019999999
            assert len(await service.check()) == 1 and await service.check() == [] and await other.check() == []
            await spend(db, account, key, CENT)  # $0.009999999: the same crossing
            assert await service.check() == []
            await book.add(account, "topup", CENT // 2)  # a credit row that leaves it below ($0.014999999)
            assert await service.check() == [] and await other.check() == []  # not re-armed: no second alert
            await book.add(account, "topup", 10 * CENT)  # $0.114999999: back above
            assert await asyncio.gather(service.check(), other.check()) == [[], []]  # both see the rise: re-armed once
            async with db.connect() as conn:
                assert (await conn.execute(sa.text("SELECT rearmed FROM alert_rules"))).scalar() == 1
            await spend(db, account, key, 10 * CENT)  # $0.014999999: a new crossing
            made = await asyncio.gather(service.check(), other.check())
            assert sorted(len(m) for m in made) == [0, 1]
            await service.drain()
            await other.drain()
            assert len(receiver.seen) == 2
    finally:
        await service.close()
        await other.close()
        await db.dispose()
        await other_db.dispose()


async def test_monthly_alerts_count_the_month_a_request_was_admitted_in(db_url: str) -> None:
    from datetime import datetime, timezone

    db = create_engine(db_url)
    service = AlertService(db, CreditBook(db), backoff=0.01)
    try:
        keys = KeyStore(db, SECRET.encode())
        account = (await keys.create_account("month-" + uuid.uuid4().hex[:6]))["id"]
        key = (await keys.create_key(account))["id"]
        with Receiver() as receiver:
            await service.add_rule(account, "monthly_spend", threshold=5 * CENT, url=receiver.url)
            # admitted at 23:59:59.9 on Oct 31, finished in November: October's spend, not November's
            await write_records(db, [UsageRecord(
                request_id=uuid.uuid4().hex, account_id=account, key_id=key, model="m", prompt_tokens=1, completion_tokens=0,
                status="completed", finish_reason="stop", total_ms=5100.0, cost_nanos=5 * CENT,
                created_at=datetime(2026, 11, 1, 0, 0, 5, tzinfo=timezone.utc),
                admitted_at=datetime(2026, 10, 31, 23, 59, 59, 900000, tzinfo=timezone.utc))])
            assert await service.check(now=datetime(2026, 11, 15, tzinfo=timezone.utc)) == []
            october = await service.check(now=datetime(2026, 10, 31, 23, 59, 59, 950000, tzinfo=timezone.utc))
            assert len(october) == 1
            await service.drain()
            assert [e["crossing"] for e in await service.events(account)] == ["2026-10"]
    finally:
        await service.close()
        await db.dispose()
