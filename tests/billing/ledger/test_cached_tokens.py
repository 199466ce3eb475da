"""ledger_entries.cached_tokens (issue 20): written by every write path (Postgres arrays, Postgres
executemany, SQLite), summed into usage_hourly and the usage reads, and kept by the journal across
a crash."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from billing.ledger import writer as ledger_module
from billing import migrate
from billing.db import create_engine
from billing.ledger.journal import LedgerJournal
from billing.ledger.writer import LedgerWriter, UsageRecord, usage_rows, usage_totals, write_records
from billing.ledger.aggregates import Period, usage_groups
from billing.models import utcnow
from tests.billing.ledger.test_journal import crash


def record(**overrides: Any) -> UsageRecord:
    fields = dict(
        request_id=uuid.uuid4().hex, account_id=1, key_id=1, model="m", prompt_tokens=100,
        completion_tokens=5, status="completed", finish_reason="stop", total_ms=12.5,
    )
    fields.update(overrides)
    return UsageRecord(**fields)  # type: ignore[arg-type]


async def cached_by_request(db: Any) -> dict[str, int | None]:
    async with db.connect() as conn:
        return {r.request_id: r.cached_tokens for r in await conn.execute(sa.text("SELECT request_id, cached_tokens FROM ledger_entries"))}


@pytest.fixture(params=["postgres-arrays", "postgres-executemany", "sqlite"])
def database_url(request: pytest.FixtureRequest, fresh_pg_database: Any, migrated_sqlite: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "postgres-executemany":
        monkeypatch.setattr(ledger_module, "PG_ARRAY_INSERT", False)
    url = fresh_pg_database(migrated=True) if request.param.startswith("postgres") else migrated_sqlite(tmp_path / 'l.db')
    migrate.upgrade(url)
    return url


async def test_cached_tokens_are_written_and_summed(database_url: str) -> None:
    db = create_engine(database_url)
    try:
        records = [record(cached_tokens=64), record(cached_tokens=None), record(cached_tokens=0), record(cached_tokens=7, model="n")]
        writer = LedgerWriter(db)
        writer.start()
        for r in records:
            writer.record(r)
        # A repeat adds nothing. Every row of one request carries its admission instant (the ledger's
        # unique key is (request_id, admitted_at): the partition key must be in it, issue 24).
        writer.record(record(request_id=records[0].request_id, cached_tokens=999, admitted_at=records[0].admitted_at))
        await writer.flush(timeout=30)
        await writer.close()
        await write_records(db, [records[1]])  # nor does a replayed row through the other path

        assert await cached_by_request(db) == {r.request_id: r.cached_tokens for r in records}
        [totals] = await usage_groups(db, Period.last_days(1), ())
        assert (totals["cached_tokens"], totals["prompt_tokens"]) == (71, 400)
        by_model = {g["model"]: g["cached_tokens"] for g in await usage_groups(db, Period.last_days(1), ("model",))}
        assert by_model == {"m": 64, "n": 7}
        assert {t["model"]: t["cached_tokens"] for t in await usage_totals(db)} == {"m": 64, "n": 7}
        assert sorted((r["cached_tokens"] or 0) for r in await usage_rows(db)) == [0, 0, 7, 64]
    finally:
        await db.dispose()


async def test_a_crash_recovered_row_keeps_its_cached_tokens(fresh_pg_database: Any, tmp_path: Path) -> None:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        journal = LedgerJournal(tmp_path)
        journal.open()
        finished = record(cached_tokens=48, created_at=utcnow())
        journal.admitted(record(request_id=finished.request_id, status="interrupted"), None)
        journal.final(finished)  # recorded, never written: the process dies here
        running = record(status="interrupted", completion_tokens=0, cached_tokens=32)
        journal.admitted(running, None)
        crash(journal)

        writer = LedgerWriter(db, journal=LedgerJournal(tmp_path))
        recovered = writer.recover()
        assert len(recovered.replayed) == 1 and len(recovered.interrupted) == 1
        writer.start()
        await writer.flush(timeout=30)
        await writer.close()
        assert await cached_by_request(db) == {finished.request_id: 48, running.request_id: 32}
        [totals] = await usage_groups(db, Period.last_days(1), ())
        assert totals["cached_tokens"] == 80
    finally:
        await db.dispose()


async def test_a_row_is_one_utc_instant_and_its_cached_tokens_part_of_its_prompt(database_url: str) -> None:
    """Whatever a writer is handed, the ledger and its hourly aggregates agree with invoices: cached
    tokens past the prompt (an engine's over-report) count as the whole prompt, as invoices cap them,
    and an admission instant given with an offset is the same UTC instant in the row and its hour. Before,
    the aggregates summed the raw figure (a dashboard's cached cost 10x the invoice's), SQLite stored
    the clock reading (01:30+02:00 on Apr 1 was April's row, March's instant), and the aggregates' hour
    cache took a +05:30 reading's hour for another's (the COPY path)."""
    from datetime import datetime, timedelta, timezone

    db = create_engine(database_url)
    try:
        india = timezone(timedelta(hours=5, minutes=30))
        rows = [
            record(cached_tokens=1000, model="over"),  # 100-token prompt
            record(cached_tokens=-3, model="under"),
            record(model="edge", admitted_at=datetime(2026, 4, 1, 1, 30, tzinfo=timezone(timedelta(hours=2))),
                   created_at=datetime(2026, 4, 1, 1, 30, 1, tzinfo=timezone(timedelta(hours=2)))),
            record(model="half", admitted_at=datetime(2026, 5, 4, 10, 15, tzinfo=india), created_at=datetime(2026, 5, 4, 10, 15, 1, tzinfo=india)),
            record(model="half", admitted_at=datetime(2026, 5, 4, 10, 45, tzinfo=india), created_at=datetime(2026, 5, 4, 10, 45, 1, tzinfo=india)),
        ]
        await write_records(db, rows)
        assert {(r.model, r.cached_tokens) for r in rows if r.model in ("over", "under")} == {("over", 100), ("under", 0)}
        async with db.connect() as conn:
            ledger = dict((await conn.execute(sa.text("SELECT model, max(cached_tokens) FROM ledger_entries GROUP BY model"))).all())
            hourly = dict((await conn.execute(sa.text("SELECT model, sum(cached_tokens) FROM usage_hourly GROUP BY model"))).all())
            hours = [str(h)[:16] for h in (await conn.execute(sa.text(
                "SELECT hour FROM usage_hourly WHERE model IN ('edge', 'half') ORDER BY hour"))).scalars()]
        assert (ledger["over"], ledger["under"], hourly["over"], hourly["under"]) == (100, 0, 100, 0)
        assert hours == ["2026-03-31 23:00", "2026-05-04 04:00", "2026-05-04 05:00"], hours
        march = await usage_groups(db, Period(datetime(2026, 3, 1, tzinfo=timezone.utc), datetime(2026, 4, 1, tzinfo=timezone.utc)), ["model"])
        assert [g["model"] for g in march] == ["edge"]
    finally:
        await db.dispose()
