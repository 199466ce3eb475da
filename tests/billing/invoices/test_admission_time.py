"""A ledger row's admission time (issue 22): what prices it and names its hour, day and month
(invoices, the usage aggregates, quotas), written at admission by the serving path; migration
0010 backfills it as created_at minus total_ms and moves the aggregates to the admission hour."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai
import pytest
import sqlalchemy as sa

from billing import migrate
from billing.db import create_engine
from billing.invoices.views import get_invoice, list_invoices
from billing.invoices.close import close_period, priced_usage
from billing.ledger.writer import UsageRecord, write_records
from billing.invoices.periods import Period
from billing.prices.book import PriceBook
from billing.prices.cached_costs import cached_input_costs
from billing.quota import LedgerTotals, Scope
from billing.ledger.aggregates import Period as Hours, add_to_aggregates, deltas, usage_groups
from engines.base import EngineOutput, EngineRequest
from tests.billing.invoice_helpers import at, new_account, new_key, serve
from tests.conftest import flush_ledger, run_coro
from tests.fakes.engine import FakeEngine

OCT, NOV = Period.month(2026, 10), Period.month(2026, 11)


class PriceChangingEngine(FakeEngine):
    """Changes the model's price after the request was admitted and before its first token: the
    request starts under one price and finishes under the next."""

    def __init__(self, model_id: str) -> None:
        super().__init__(model_id)
        self.book: PriceBook | None = None
        self.changed_at: datetime | None = None

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        assert self.book is not None
        if self.changed_at is None:
            version = await self.book.add(self.model_id, "5.000", "9.000")  # in force from now on
            self.changed_at = version.effective_from
        async for out in super().stream(request):
            yield out


async def test_request_across_a_price_change_is_invoiced_at_the_admission_price(db_url: str, db: Any, tmp_path: Path) -> None:
    engine = PriceChangingEngine("alpha")
    await PriceBook(db).add("alpha", "1.000", "2.000", at(1, 1, 0), backdate=True)
    with serve(db_url, tmp_path, engines={"alpha": engine}) as app:
        engine.book = app.app.state.prices  # used on the server's loop
        account = await new_account(db)
        client = openai.AsyncOpenAI(base_url=app.base_url + "/v1", api_key=await new_key(db, account), max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model="alpha", messages=[{"role": "user", "content": "0123456789"}], max_tokens=5
        )
        reply = raw.parse()
        await flush_ledger(app.app)
    request_id = raw.headers["x-request-id"]
    async with db.connect() as conn:
        row = (await conn.execute(sa.text("SELECT * FROM ledger_entries WHERE request_id = :r"), {"r": request_id})).one()
    assert engine.changed_at is not None
    assert row.admitted_at < engine.changed_at < row.created_at, (row.admitted_at, engine.changed_at, row.created_at)
    prompt, completion = reply.usage.prompt_tokens, reply.usage.completion_tokens
    old_cost = prompt * 1000 + completion * 2000  # nano-USD at 1.000 / 2.000 per 1M tokens
    assert row.cost_nanos == old_cost  # priced at admission
    # The invoice's pricing of that row agrees with the ledger: the old price, not the one in force at its end.
    book = PriceBook(db)
    await book.refresh(force=True)
    month = Period.containing(row.admitted_at)
    async with db.connect() as conn:
        usage = await priced_usage(conn, book, account, month.start, month.end)
    assert sorted((k.direction, k.unit_price, v.tokens) for k, v in usage.items()) == [
        ("input", 1, prompt), ("output", 2, completion)
    ], usage


async def test_a_row_is_invoiced_at_the_price_it_was_admitted_at_not_one_its_gateway_had_not_seen(
    db_url: str, db: Any, tmp_path: Path
) -> None:
    """A version whose start the admitting gateway's price book had not seen (here one set 30 s back,
    which `add` allows; likewise one another process added within the book's 5 s refresh): the
    rows it priced at the older version are invoiced at that version, as quotas and balances
    counted them, under the account's multiplier; a row admitted with no price stays unpriced."""
    await PriceBook(db).add("alpha", "1.000", "2.000", at(1, 1, 0), backdate=True)
    account = await new_account(db)
    await PriceBook(db).add_override(account, "*", multiplier="2", effective_from=at(1, 1, 0), backdate=True)
    with serve(db_url, tmp_path, engines={"alpha": FakeEngine("alpha"), "beta": FakeEngine("beta")}) as app:
        client = openai.AsyncOpenAI(base_url=app.base_url + "/v1", api_key=await new_key(db, account), max_retries=0)
        ids = []
        for model in ("alpha", "beta"):
            raw = await client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": "0123456789"}], max_tokens=5)
            ids.append(raw.headers["x-request-id"])
        back = (datetime.now(timezone.utc) - timedelta(seconds=30)).isoformat()
        async with app.admin() as admin:
            for model, price in (("alpha", "5.000"), ("beta", "1.000")):
                reply = await admin.post("/admin/prices", json={
                    "model": model, "input_per_million": price, "output_per_million": price, "effective_from": back})
                assert reply.status_code == 201, reply.text
        await flush_ledger(app.app)
    async with db.connect() as conn:
        rows = {r.request_id: r for r in (await conn.execute(sa.text(
            "SELECT * FROM ledger_entries WHERE request_id IN (:a, :b)"), {"a": ids[0], "b": ids[1]})).all()}
    alpha, beta = rows[ids[0]], rows[ids[1]]
    assert alpha.cost_nanos == (alpha.prompt_tokens * 1000 + alpha.completion_tokens * 2000) * 2  # the old version, doubled
    assert beta.cost_nanos is None and beta.price_version_id == 0 and beta.override_id is None  # served unpriced
    book = PriceBook(db)
    await book.refresh(force=True)
    assert book.price_for(account, "alpha", alpha.admitted_at).input_per_million == 10  # the new version is in force then
    month = Period.containing(alpha.admitted_at)
    async with db.connect() as conn:
        usage = await priced_usage(conn, book, account, month.start, month.end)
    lines = sorted((k.model, k.direction, k.unit_price, v.tokens) for k, v in usage.items())
    assert lines == [
        ("alpha", "input", 2, alpha.prompt_tokens), ("alpha", "output", 4, alpha.completion_tokens),
        ("beta", "input", None, beta.prompt_tokens), ("beta", "output", None, beta.completion_tokens),
    ], lines
    assert sum(k.unit_price * v.tokens * 1000 for k, v in usage.items() if k.unit_price is not None) == alpha.cost_nanos
    assert {(k.price_version_id, k.override_id) for k in usage if k.model == "alpha"} == {(alpha.price_version_id, alpha.override_id)}


async def test_a_backdated_version_re_prices_the_rows_admitted_before_it_was_added(db_url: str, db: Any, tmp_path: Path) -> None:
    """`backdate` is there to re-price an open period: a version added with a start 2 minutes before a
    request was admitted prices that request's row on the invoice, though the row names the version
    it was admitted at (the one before)."""
    await PriceBook(db).add("alpha", "1.000", "2.000", at(1, 1, 0), backdate=True)
    account = await new_account(db)
    with serve(db_url, tmp_path, engines={"alpha": FakeEngine("alpha")}) as app:
        client = openai.AsyncOpenAI(base_url=app.base_url + "/v1", api_key=await new_key(db, account), max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model="alpha", messages=[{"role": "user", "content": "0123456789"}], max_tokens=5)
        await flush_ledger(app.app)
    async with db.connect() as conn:
        row = (await conn.execute(sa.text("SELECT * FROM ledger_entries WHERE request_id = :r"), {"r": raw.headers["x-request-id"]})).one()
    assert row.cost_nanos == row.prompt_tokens * 1000 + row.completion_tokens * 2000
    book = PriceBook(db)
    await book.add("alpha", "5.000", "9.000", row.admitted_at - timedelta(minutes=2), backdate=True)
    month = Period.containing(row.admitted_at)
    async with db.connect() as conn:
        usage = await priced_usage(conn, book, account, month.start, month.end)
    assert sorted((k.direction, k.unit_price, v.tokens) for k, v in usage.items()) == [
        ("input", 5, row.prompt_tokens), ("output", 9, row.completion_tokens)]


async def test_admitted_on_the_last_instant_of_a_month_belongs_to_that_month(db: Any) -> None:
    book = PriceBook(db)
    await book.add("alpha", "1.000", "2.000", at(8, 1, 0), backdate=True)
    account = await new_account(db)
    admitted = datetime(2026, 10, 31, 23, 59, 59, 900_000, tzinfo=timezone.utc)
    late = UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account, key_id=1, model="alpha", prompt_tokens=1_000_000,
        completion_tokens=500_000, status="completed", finish_reason="stop", total_ms=2500.0, cost_nanos=2_000_000_000,
        created_at=admitted + timedelta(milliseconds=2500),  # finished in November
    )
    assert late.admitted_at == admitted  # derived from created_at - total_ms when not given
    early_nov = UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account, key_id=1, model="alpha", prompt_tokens=10, completion_tokens=0,
        status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=10_000, created_at=at(11, 1, 0, 0, 1),
    )
    await write_records(db, [late, early_nov])
    # the invoice
    result = await close_period(db, book, OCT, now=at(11, 2))
    [invoice_id] = result.created
    invoice = await get_invoice(db, invoice_id)
    assert invoice is not None
    assert [(l["direction"], l["tokens"], l["amount_cents"]) for l in invoice["lines"]] == [("input", 1_000_000, 100), ("output", 500_000, 100)]
    assert invoice["total_cents"] == 200
    # the usage aggregates (API and dashboards): October 31, not November 1
    days = await usage_groups(db, Hours(at(10, 31, 0), at(11, 2, 0)), ("day",), account_id=account)
    assert [(d["day"], d["requests"], d["prompt_tokens"]) for d in days] == [("2026-10-31", 1, 1_000_000), ("2026-11-01", 1, 10)]
    # the quota's month: rebuilt November counters do not hold it
    totals = await LedgerTotals(db).for_scopes([Scope("account", account, None)], at(11, 1, 0, 30).timestamp())
    [(_, nov)] = totals.items()
    assert (nov.month_tokens, nov.month_nanos) == (10, 10_000)


async def test_an_accounts_only_row_admitted_on_the_first_instant_of_a_month_is_invoiced_in_that_month(db: Any) -> None:
    """Months are [first instant, next month's first instant): a row admitted at exactly 00:00:00.000000
    on November 1 is November's, also when it is the account's only usage (the close first asks
    whether the account has any)."""
    book = PriceBook(db)
    await book.add("alpha", "1.000", "2.000", at(8, 1, 0), backdate=True)
    account = await new_account(db)
    await write_records(db, [UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account, key_id=1, model="alpha", prompt_tokens=1_000_000, completion_tokens=0,
        status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=1, admitted_at=at(11, 1, 0),
        created_at=at(11, 1, 0) + timedelta(milliseconds=1))])
    await close_period(db, book, OCT, now=at(11, 2))
    await close_period(db, book, NOV, now=at(12, 2))
    invoices = await list_invoices(db, account_id=account)
    assert [(i["period"], i["total_cents"]) for i in invoices] == [("2026-11", 100)]


LEGACY_COLUMNS = ("request_id", "account_id", "key_id", "model", "prompt_tokens", "completion_tokens", "status", "finish_reason",
                  "estimated", "cost_nanos", "total_ms", "ttft_ms", "cached", "cached_tokens", "api", "created_at")


def _legacy_rows() -> list[UsageRecord]:
    """Rows as the gateway wrote them before 0010: aggregates keyed by the hour they finished."""
    base = datetime(2026, 9, 30, 23, 0, tzinfo=timezone.utc)
    ends = [base + timedelta(minutes=59, seconds=59, milliseconds=999),  # admitted and finished in the same hour
            base + timedelta(hours=1, milliseconds=400),  # admitted Sep 30 23:59:58.4: another hour, day and month
            base + timedelta(hours=1, minutes=30), base + timedelta(hours=2, milliseconds=5)]
    out = []
    for i, end in enumerate(ends):
        record = UsageRecord(
            request_id=f"legacy-{i}", account_id=1 + i % 2, key_id=7, model="m", prompt_tokens=10 + i, completion_tokens=i,
            status="completed" if i != 2 else "error", finish_reason="stop", total_ms=[1.0, 2000.0, 50.0, 900.0][i],
            ttft_ms=None if i == 3 else 3.0, cost_nanos=None if i == 0 else 100 * i, cached_tokens=i or None, created_at=end,
        )
        record.admitted_at = end  # as the old writer keyed them
        out.append(record)
    return out


async def _load_legacy(url: str, rows: list[UsageRecord]) -> None:
    db = create_engine(url)
    try:
        table = sa.table("ledger_entries", *(sa.column(c) for c in LEGACY_COLUMNS[:-1]), sa.column("created_at", sa.DateTime(timezone=True)))
        async with db.begin() as conn:
            await conn.execute(table.insert(), [{c: getattr(r, c) for c in LEGACY_COLUMNS} for r in rows])
            await add_to_aggregates(conn, rows)
    finally:
        await db.dispose()


async def _read(url: str) -> tuple[dict[str, datetime], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    db = create_engine(url)
    try:
        async with db.connect() as conn:
            admitted = {}
            if "admitted_at" in (await conn.run_sync(lambda c: [x["name"] for x in sa.inspect(c).get_columns("ledger_entries")])):
                ledger = sa.table("ledger_entries", sa.column("request_id"), sa.column("admitted_at", sa.DateTime(timezone=True)))
                admitted = {r.request_id: _aware(r.admitted_at) for r in await conn.execute(sa.select(ledger))}
            hourly = sa.table("usage_hourly", sa.column("hour", sa.DateTime(timezone=True)), *(sa.column(c) for c in (
                "account_id", "key_id", "model", "requests", "prompt_tokens", "completion_tokens", "cost_nanos", "unpriced", "errors",
                "cancelled", "ttft_count", "cached_tokens", "total_ms_sum", "ttft_ms_sum")))
            usage = sorted((_aware(r[0]), *r[1:]) for r in (await conn.execute(sa.select(hourly))).all())
            lat = sa.table("latency_hourly", sa.column("hour", sa.DateTime(timezone=True)), *(sa.column(c) for c in ("model", "metric", "bucket", "count")))
            latency = sorted((_aware(r[0]), *r[1:]) for r in (await conn.execute(sa.select(lat))).all())
        return admitted, usage, latency
    finally:
        await db.dispose()


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _expected(rows: list[UsageRecord]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    usage_rows, latency_rows = deltas(rows)
    usage = sorted((r["hour"], r["account_id"], r["key_id"], r["model"], *(r[c] for c in (
        "requests", "prompt_tokens", "completion_tokens", "cost_nanos", "unpriced", "errors", "cancelled", "ttft_count",
        "cached_tokens", "total_ms_sum", "ttft_ms_sum"))) for r in usage_rows)
    latency = sorted((r["hour"], r["model"], r["metric"], r["bucket"], r["count"]) for r in latency_rows)
    return usage, latency


@pytest.mark.parametrize("dialect", ["postgres", "sqlite"])
def test_migration_backfills_admission_and_moves_aggregates(dialect: str, fresh_pg_database: Any, tmp_path: Path) -> None:
    url = fresh_pg_database() if dialect == "postgres" else f"sqlite:///{tmp_path / 'old.db'}"
    migrate.upgrade(url, "0009_stored_responses")
    legacy = _legacy_rows()
    run_coro(_load_legacy(url, legacy))
    before = run_coro(_read(url))
    assert before[1:] == _expected(legacy)
    migrate.upgrade(url)
    admitted, usage, latency = run_coro(_read(url))
    now_rows = [UsageRecord(**{**r.__dict__, "admitted_at": None}) for r in legacy]  # derived: created_at - total_ms
    assert admitted == {r.request_id: r.admitted_at for r in now_rows}
    assert admitted["legacy-1"] == datetime(2026, 9, 30, 23, 59, 58, 400_000, tzinfo=timezone.utc)
    want_usage, want_latency = _expected(now_rows)
    assert len(usage) == len(want_usage) and latency == want_latency
    for got, want in zip(usage, want_usage):
        assert got[:-2] == want[:-2] and got[-2:] == pytest.approx(want[-2:])
    migrate.downgrade(url, "0009_stored_responses")
    back = run_coro(_read(url))
    assert back[2] == before[2] and [u[:-2] for u in back[1]] == [u[:-2] for u in before[1]]


def test_the_journal_keeps_the_admission_instant(tmp_path: Path) -> None:
    """A crash between admission and the row: the replayed row keeps the instant that prices it."""
    from billing.ledger.journal import LedgerJournal, record_fields
    from tests.billing.ledger.test_journal import crash

    journal = LedgerJournal(tmp_path)
    journal.open()
    admitted = datetime(2026, 10, 31, 23, 59, 59, 900_000, tzinfo=timezone.utc)
    running = UsageRecord(request_id="r-1", account_id=1, key_id=1, model="m", prompt_tokens=5, completion_tokens=0,
                          status="interrupted", finish_reason=None, total_ms=0.0, created_at=admitted, admitted_at=admitted)
    journal.admitted(running, None)
    crash(journal)  # what SIGKILL leaves
    again = LedgerJournal(tmp_path)
    [(row, _)] = again.open().interrupted
    assert record_fields(row, UsageRecord).admitted_at == admitted
    again.close()


async def test_the_dashboards_cached_cost_is_what_the_invoice_bills(db: Any) -> None:
    """The dashboards' cost of cached prompt tokens (billing/prices/cached_costs.py) prices each row
    as its invoice does: at the price it was admitted at. A version set 20 s before an hour's start
    and added 30 s after it (allowed: within a minute) was unseen by the gateway that admitted rows on
    both sides of the hour at the version before; the dashboard used to price them at the new one."""
    book = PriceBook(db)
    old = await book.add("m", "1.000", "2.000", at(10, 1, 0), backdate=True, cached_input_per_million="0.100")
    hour = at(10, 15, 12)
    new = await book.add("m", "3.000", "6.000", hour - timedelta(seconds=20), backdate=True, cached_input_per_million="0.500")
    async with db.begin() as conn:
        for version, added in ((old, at(10, 1, 0)), (new, hour + timedelta(seconds=30))):  # added then, not backdated today
            await conn.execute(sa.text("UPDATE prices SET created_at = :t WHERE id = :i"), {"t": added, "i": version.id})
    account = await new_account(db)
    # (cached, admitted, version): an hour before, the lag on both sides of the hour, the new price
    usage = [(700, hour - timedelta(minutes=30), old), (600, hour - timedelta(seconds=10), old),
             (500, hour + timedelta(seconds=20), old), (400, hour + timedelta(minutes=30), new)]
    await write_records(db, [UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account, key_id=1, model="m", prompt_tokens=1000, completion_tokens=10,
        status="completed", finish_reason="stop", total_ms=5.0, cost_nanos=version.cost_nanos(1000, 10, cached), cached_tokens=cached,
        created_at=admitted + timedelta(milliseconds=5), admitted_at=admitted, price_version_id=version.id) for cached, admitted, version in usage])
    book = PriceBook(db)
    await book.refresh(force=True)
    async with db.connect() as conn:
        billed = await priced_usage(conn, book, account, OCT.start, OCT.end)
    cached_lines = sorted((k.unit_price, v.tokens) for k, v in billed.items() if k.direction == "cached")
    assert cached_lines == [(Decimal("0.100"), 1800), (Decimal("0.500"), 400)], cached_lines
    assert await cached_input_costs(db, book, OCT.start, OCT.end, account) == {"m": 1800 * 100 + 400 * 500}
