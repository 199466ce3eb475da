"""Hourly aggregates stay exact sums of the ledger (new rows only, retries and repeats included),
on Postgres and SQLite; the 0003 backfill sums rows written before it; percentiles are close."""

from __future__ import annotations

import random
import sqlite3
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from billing import migrate
from billing.db import create_engine
from billing.ledger.writer import LedgerWriter, UsageRecord, write_records
from billing.ledger.aggregates import Period, bucket_value, deltas, latency_bucket, latency_percentiles, usage_groups, usd

T0 = datetime(2026, 11, 3, 10, 15, tzinfo=timezone.utc)


def record(**overrides: Any) -> UsageRecord:
    fields: dict[str, Any] = dict(
        request_id=uuid.uuid4().hex, account_id=1, key_id=1, model="m", prompt_tokens=10,
        completion_tokens=5, status="completed", finish_reason="stop", total_ms=120.0, ttft_ms=30.0,
        cost_nanos=1500, created_at=T0,
    )
    fields.update(overrides)
    return UsageRecord(**fields)


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest, fresh_pg_database: Any, migrated_sqlite: Any, tmp_path: Path) -> str:
    url = fresh_pg_database(migrated=True) if request.param == "postgres" else migrated_sqlite(tmp_path / 'u.db')
    migrate.upgrade(url)
    return url


async def ledger_sums(db: Any, where: str = "1=1") -> tuple[int, ...]:
    """The truth, summed from raw ledger rows."""
    sql = (
        "SELECT count(*), coalesce(sum(prompt_tokens),0), coalesce(sum(completion_tokens),0), "
        "coalesce(sum(cost_nanos),0), coalesce(sum(CASE WHEN status='error' THEN 1 ELSE 0 END),0), "
        f"coalesce(sum(CASE WHEN cost_nanos IS NULL THEN 1 ELSE 0 END),0) FROM ledger_entries WHERE {where}"
    )
    async with db.connect() as conn:
        return tuple(int(v) for v in (await conn.execute(sa.text(sql))).one())


def as_tuple(totals: dict[str, Any]) -> tuple[int, ...]:
    keys = ("requests", "prompt_tokens", "completion_tokens", "cost_nanos", "errors", "unpriced")
    return tuple(totals[k] for k in keys)


async def test_aggregates_equal_ledger_sums_with_repeats(db_url: str) -> None:
    db = create_engine(db_url)
    try:
        rng = random.Random(7)
        records = [
            record(
                account_id=rng.choice([1, 2]), key_id=rng.choice([1, 2, 3]), model=rng.choice(["a", "b"]),
                prompt_tokens=rng.randint(1, 500), completion_tokens=rng.randint(0, 300),
                status=rng.choice(["completed", "completed", "cancelled", "error"]),
                cost_nanos=rng.choice([None, rng.randint(0, 10**6)]), ttft_ms=rng.choice([None, rng.uniform(1, 500)]),
                created_at=T0 + timedelta(minutes=rng.randint(0, 60 * 72)),
            )
            for _ in range(600)
        ]
        assert await write_records(db, records[:400]) == 400
        # A retried batch overlapping the first, and a request_id twice in one batch: new rows only.
        again = records[300:] + [records[500]]
        assert await write_records(db, again) == 200
        assert await write_records(db, records) == 0

        period = Period(T0 - timedelta(days=1), T0 + timedelta(days=5))
        [everything] = await usage_groups(db, period)
        assert as_tuple(everything) == await ledger_sums(db)
        for group in await usage_groups(db, period, ("day", "model", "key")):
            where = (
                f"model = '{group['model']}' AND key_id = {group['key_id']} AND account_id = {group['account_id']}"
            )
            in_day = [r for r in records if r.model == group["model"] and r.key_id == group["key_id"]
                      and r.account_id == group["account_id"] and r.admitted_at.date().isoformat() == group["day"]]
            assert group["requests"] == len(in_day), where
            assert group["prompt_tokens"] == sum(r.prompt_tokens for r in in_day)
            assert group["cost_nanos"] == sum(r.cost_nanos or 0 for r in in_day)
        per_account = {g["account_id"]: g for g in await usage_groups(db, period, ("account",))}
        assert as_tuple(per_account[2]) == await ledger_sums(db, "account_id = 2")
        assert usd(per_account[2]["cost_nanos"]) == per_account[2]["cost_usd"]
    finally:
        await db.dispose()


async def test_aggregate_tables_hold_exactly_what_deltas_computes(db_url: str) -> None:
    # Postgres sums in SQL (one statement per batch, billing/ledger/writer.py); SQLite through deltas():
    # either way the tables hold what billing.ledger.aggregates.deltas() says the new rows add, bucket by bucket.
    db = create_engine(db_url)
    try:
        rng = random.Random(11)
        records = [
            record(
                account_id=rng.choice([1, 2]), model=rng.choice(["a", "b"]), total_ms=rng.choice([0.0, 0.5, 1.0, 2.0, rng.uniform(0, 9000)]),
                ttft_ms=rng.choice([None, 0.2, 16.0, rng.uniform(0, 900)]), cost_nanos=rng.choice([None, rng.randint(0, 10**6)]),
                status=rng.choice(["completed", "cancelled", "error", "interrupted"]),
                created_at=T0 + timedelta(minutes=rng.randint(0, 300)),
            )
            for _ in range(300)
        ]
        assert await write_records(db, records[:200]) == 200
        assert await write_records(db, records[100:] + records[150:160]) == 100  # repeats add nothing
        usage_rows, latency_rows = deltas(records)
        async with db.connect() as conn:
            stored = (await conn.execute(sa.text(
                "SELECT hour, account_id, key_id, model, requests, prompt_tokens, completion_tokens, cost_nanos, unpriced, "
                "errors, cancelled, ttft_count, total_ms_sum, ttft_ms_sum FROM usage_hourly ORDER BY hour, account_id, key_id, model"
            ))).all()
            histogram = (await conn.execute(sa.text(
                "SELECT hour, model, metric, bucket, count FROM latency_hourly ORDER BY hour, model, metric, bucket"
            ))).all()
        assert len(stored) == len(usage_rows)
        for got, want in zip(stored, usage_rows):
            assert hour_key(got[0]) == hour_key(want["hour"]) and tuple(got[1:4]) == (want["account_id"], want["key_id"], want["model"])
            counts = ("requests", "prompt_tokens", "completion_tokens", "cost_nanos", "unpriced", "errors", "cancelled", "ttft_count")
            assert tuple(got[4:12]) == tuple(want[c] for c in counts)
            assert got[12] == pytest.approx(want["total_ms_sum"]) and got[13] == pytest.approx(want["ttft_ms_sum"])
        assert [(hour_key(h), m, metric, b, n) for h, m, metric, b, n in histogram] == [
            (hour_key(r["hour"]), r["model"], r["metric"], r["bucket"], r["count"]) for r in latency_rows]
    finally:
        await db.dispose()


def hour_key(value: Any) -> str:
    """An hour as UTC text, whether the driver returns it aware (Postgres) or naive/text (SQLite)."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H")


async def test_writer_feeds_aggregates_and_listeners(db_url: str) -> None:
    db = create_engine(db_url)
    seen: list[str] = []
    try:
        writer = LedgerWriter(db, batch_size=7)
        writer.add_listener(lambda r: seen.append(r.request_id))
        writer.add_listener(lambda r: 1 / 0)  # a broken observer costs nothing
        writer.start()
        now = datetime.now(timezone.utc)
        records = [record(created_at=now, completion_tokens=i) for i in range(30)]
        for r in records:
            writer.record(r)
        assert seen == [r.request_id for r in records]
        await writer.flush(timeout=30)
        assert writer.backlog == 0 and writer.lag_seconds == 0.0
        await writer.close()
        this_month = Period(Period.containing(now).start, now + timedelta(hours=1))
        [totals] = await usage_groups(db, this_month, (), account_id=1)
        assert (totals["total_tokens"], totals["cost_nanos"], totals["requests"]) == (30 * 10 + sum(range(30)), 30 * 1500, 30)
        assert [g["requests"] for g in await usage_groups(db, this_month, (), account_id=99)] in ([], [0])
    finally:
        await db.dispose()


async def test_percentiles_from_histograms_are_close_to_exact(db_url: str) -> None:
    db = create_engine(db_url)
    try:
        rng = random.Random(3)
        latencies = [rng.lognormvariate(5, 0.8) for _ in range(2000)]
        await write_records(db, [record(total_ms=ms, ttft_ms=ms / 4) for ms in latencies])
        stats = (await latency_percentiles(db, Period(T0 - timedelta(hours=1), T0 + timedelta(hours=1))))["m"]
        ordered = sorted(latencies)
        for q, name in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
            exact = ordered[int(q * len(ordered)) - 1]
            assert abs(stats["total"][name] - exact) / exact < 0.2, (name, stats["total"][name], exact)
        assert stats["total"]["count"] == 2000 and stats["ttft"]["count"] == 2000
        assert stats["ttft"]["p50"] < stats["total"]["p50"]
    finally:
        await db.dispose()


def test_buckets() -> None:
    assert latency_bucket(0.2) == 0 and latency_bucket(1.0) == 0
    for ms in (1.5, 9.0, 100.0, 2500.0, 60_000.0):
        b = latency_bucket(ms)
        assert 2 ** (b / 4) <= ms < 2 ** ((b + 1) / 4)
        assert abs(bucket_value(b) - ms) / ms < 0.2


def test_migration_backfills_existing_ledger_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    url = f"sqlite:///{path}"
    migrate.upgrade(url, "0002")
    conn = sqlite3.connect(path)
    rows = [
        (f"r{i}", 1 + i % 2, 7, "m", 10, i, "error" if i == 3 else "completed", 0, None if i == 0 else 100,
         50.0 + i, 5.0, f"2026-11-29 1{i % 3}:0{i}:00.000000")
        for i in range(6)
    ]
    conn.executemany(
        "INSERT INTO ledger_entries(request_id, account_id, key_id, model, prompt_tokens, completion_tokens, status,"
        " estimated, cost_nanos, total_ms, ttft_ms, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    conn.commit()
    migrate.upgrade(url)
    got = conn.execute(
        "SELECT count(*), sum(requests), sum(completion_tokens), sum(cost_nanos), sum(unpriced), sum(errors),"
        " sum(ttft_count) FROM usage_hourly").fetchone()
    # hours 10, 11, 12 x accounts 1, 2 -> rows (i%3, 1+i%2) for i in 0..5: all six combinations
    assert got == (6, 6, sum(range(6)), 500, 1, 1, 6)
    assert conn.execute("SELECT sum(count) FROM latency_hourly WHERE metric = 'total'").fetchone() == (6,)
    conn.close()


async def test_adjacent_periods_split_the_sums_at_their_boundary(db_url: str) -> None:
    """A period is [start, end): the hour that starts at its end is the next period's. Two adjacent
    days sum to the whole, each with its own rows only (a row admitted at 00:00 exactly is the later day's)."""
    db = create_engine(db_url)
    try:
        midnight = datetime(2026, 11, 4, tzinfo=timezone.utc)
        before = record(prompt_tokens=100, completion_tokens=1, cost_nanos=1000, admitted_at=midnight - timedelta(minutes=30),
                        created_at=midnight - timedelta(minutes=29))
        at = record(prompt_tokens=20, completion_tokens=2, cost_nanos=20, admitted_at=midnight, created_at=midnight + timedelta(seconds=1))
        after = record(prompt_tokens=3, completion_tokens=3, cost_nanos=3, admitted_at=midnight + timedelta(minutes=30),
                       created_at=midnight + timedelta(minutes=31))
        assert await write_records(db, [before, at, after]) == 3
        day = timedelta(days=1)
        [first] = await usage_groups(db, Period(midnight - day, midnight))
        [second] = await usage_groups(db, Period(midnight, midnight + day))
        assert (first["requests"], first["prompt_tokens"], first["cost_nanos"]) == (1, 100, 1000), first
        assert (second["requests"], second["prompt_tokens"], second["cost_nanos"]) == (2, 23, 23), second
        [by_day] = await usage_groups(db, Period(midnight - day, midnight), ("day",))
        assert (by_day["day"], by_day["requests"]) == ("2026-11-03", 1), by_day
    finally:
        await db.dispose()
