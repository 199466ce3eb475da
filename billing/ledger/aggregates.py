"""Pre-aggregated usage: kept exact by the ledger writer, read by the dashboards and `/v1/usage`.

    add_to_aggregates(conn, records)   same transaction as the ledger insert, new rows only
    usage_groups(...)                  sums by day / model / key over whole hours
    latency_percentiles(...)           p50/p90/p99 from the hourly histograms

Percentiles come from a log-scale histogram (4 buckets per doubling, so within ~19% of the
exact value): reading them never scans ledger rows, whatever the period.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from billing.invoices.periods import Period
from billing.ledger.records import UsageRecord
from billing.ledger.aggregate_models import LatencyHour, UsageHour

__all__ = ["Period"]  # billing.ledger.aggregates.Period: the one Period type (billing/invoices/periods.py), where the readers take it

HOURLY = UsageHour.__table__
LATENCY = LatencyHour.__table__
BUCKETS_PER_DOUBLING = 4
NANOS_PER_USD = 10**9
GROUPS = ("day", "model", "key")
COUNTS = (
    "requests", "prompt_tokens", "completion_tokens", "cost_nanos", "unpriced", "errors", "cancelled", "ttft_count",
    "cached_tokens",
)
SUMS = ("total_ms_sum", "ttft_ms_sum")


def latency_bucket(ms: float) -> int:
    """The histogram bucket of a duration: b holds [2^(b/4), 2^((b+1)/4)) ms; below 1 ms is 0."""
    if not ms or ms < 1.0 or math.isnan(ms):
        return 0
    return min(int(math.log2(ms) * BUCKETS_PER_DOUBLING), 32767)


def bucket_value(bucket: int) -> float:
    """A bucket's representative value: its geometric middle, in ms."""
    return 2 ** ((bucket + 0.5) / BUCKETS_PER_DOUBLING)


def hour_of(at: datetime) -> datetime:
    at = at if at.tzinfo else at.replace(tzinfo=timezone.utc)
    return at.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)


def usd(nanos: int) -> str:
    """nano-USD as an exact decimal string of dollars."""
    return format(Decimal(nanos) / NANOS_PER_USD, ".9f")


# writing --------------------------------------------------------------------------------------
_LOG2 = math.log2


def deltas(records: Iterable[UsageRecord]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What a batch of new ledger rows adds to each hourly row and histogram bucket.

    One pass, plain lists per group (the COPY ingest path runs this for every row it writes, so it
    is kept to a few attribute reads and additions a row; bench/ledger_writer.py)."""
    # group -> [requests, prompt, completion, cost_nanos, unpriced, errors, cancelled, ttft_count, cached, total_ms, ttft_ms]
    usage: dict[tuple[Any, ...], list[Any]] = {}
    latency: dict[tuple[Any, ...], int] = defaultdict(int)
    hours: dict[Any, datetime] = {}  # (date, hour, fold, tzinfo) -> the UTC hour: one conversion per distinct hour
    for r in records:
        at = r.admitted_at  # the hour it was admitted in, as invoices count it
        probe = (at.date(), at.hour, at.fold, at.tzinfo)  # type: ignore[union-attr]
        hour = hours.get(probe)
        if hour is None:
            hour = hours[probe] = hour_of(at)  # type: ignore[arg-type]
        model = r.model
        key = (hour, r.account_id, r.key_id, model)
        row = usage.get(key)
        if row is None:
            row = usage[key] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0]
        row[0] += 1
        row[1] += r.prompt_tokens
        row[2] += r.completion_tokens
        cost = r.cost_nanos
        if cost is None:
            row[4] += 1
        else:
            row[3] += cost
        status = r.status
        if status == "error" or status == "interrupted":
            row[5] += 1
        elif status == "cancelled":
            row[6] += 1
        if r.cached_tokens:
            row[8] += r.cached_tokens
        total = r.total_ms
        row[9] += total
        bucket = 0 if not total or total < 1.0 or total != total else min(int(_LOG2(total) * BUCKETS_PER_DOUBLING), 32767)
        latency[(hour, model, "total", bucket)] += 1
        ttft = r.ttft_ms
        if ttft is not None:
            row[10] += ttft
            row[7] += 1
            bucket = 0 if not ttft or ttft < 1.0 or ttft != ttft else min(int(_LOG2(ttft) * BUCKETS_PER_DOUBLING), 32767)
            latency[(hour, model, "ttft", bucket)] += 1
    # A fixed order takes row locks in the same order in every writer: no deadlocks between gateways.
    usage_rows = []
    for (hour, account_id, key_id, model), v in sorted(usage.items(), key=lambda item: item[0]):
        usage_rows.append({
            "hour": hour, "account_id": account_id, "key_id": key_id, "model": model,
            "requests": v[0], "prompt_tokens": v[1], "completion_tokens": v[2], "cost_nanos": v[3], "unpriced": v[4],
            "errors": v[5], "cancelled": v[6], "ttft_count": v[7], "cached_tokens": v[8],
            "total_ms_sum": v[9], "ttft_ms_sum": v[10],
        })
    latency_rows = [
        {"hour": h, "model": m, "metric": metric, "bucket": b, "count": n}
        for (h, m, metric, b), n in sorted(latency.items())
    ]
    return usage_rows, latency_rows


@functools.lru_cache(maxsize=16)
def _adding_upsert(dialect_name: str, table: sa.Table, keys: tuple[str, ...], added: tuple[str, ...]) -> Any:
    """Built once per (dialect, table): constructing the statement cost more than running it."""
    insert = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}.get(dialect_name)
    if insert is None:
        raise ValueError(f"unsupported dialect {dialect_name}")
    stmt = insert(table)
    return stmt.on_conflict_do_update(
        index_elements=list(keys), set_={c: table.c[c] + stmt.excluded[c] for c in added}
    )


@functools.lru_cache(maxsize=8)
def _pg_upsert_sql(table: sa.Table, columns: tuple[tuple[str, str], ...], keys: tuple[str, ...]) -> str:
    """The Postgres upsert of `_adding_upsert` as one statement over arrays (`unnest`), for asyncpg."""
    names = [c for c, _ in columns]
    added = [c for c in names if c not in keys]
    arrays = ", ".join(f"${i}::{t}[]" for i, (_, t) in enumerate(columns, 1))
    sets = ", ".join(f"{c} = {table.name}.{c} + EXCLUDED.{c}" for c in added)
    return (f"INSERT INTO {table.name} ({', '.join(names)}) SELECT * FROM unnest({arrays}) "
            f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {sets}")


_PG_USAGE_COLUMNS = (
    ("hour", "timestamptz"), ("account_id", "int4"), ("key_id", "int4"), ("model", "text"),
    *((c, "int8") for c in COUNTS), *((c, "float8") for c in SUMS),
)
_PG_LATENCY_COLUMNS = (("hour", "timestamptz"), ("model", "text"), ("metric", "text"), ("bucket", "int2"), ("count", "int8"))


async def upsert_deltas_pg(driver: Any, usage_rows: list[dict[str, Any]], latency_rows: list[dict[str, Any]]) -> None:
    """Adds `deltas()` to the aggregate tables on an asyncpg connection: one statement per table
    (columns as arrays), inside the caller's transaction."""
    for table, columns, keys, rows in (
        (HOURLY, _PG_USAGE_COLUMNS, ("hour", "account_id", "key_id", "model"), usage_rows),
        (LATENCY, _PG_LATENCY_COLUMNS, ("hour", "model", "metric", "bucket"), latency_rows),
    ):
        if rows:
            await driver.execute(_pg_upsert_sql(table, columns, keys), *([r[c] for r in rows] for c, _ in columns))


async def add_to_aggregates(conn: AsyncConnection, records: Sequence[UsageRecord]) -> None:
    """Adds newly inserted ledger rows to the aggregates, inside the caller's transaction."""
    if not records:
        return
    usage_rows, latency_rows = deltas(records)
    dialect = conn.dialect.name
    if dialect == "postgresql" and conn.dialect.driver == "asyncpg":
        # Straight through asyncpg, one statement per table: SQLAlchemy's executemany path cost
        # more CPU than the rest of writing a batch (docs/performance.md).
        await upsert_deltas_pg((await conn.get_raw_connection()).driver_connection, usage_rows, latency_rows)
        return
    await conn.execute(
        _adding_upsert(dialect, HOURLY, ("hour", "account_id", "key_id", "model"), COUNTS + SUMS), usage_rows
    )
    await conn.execute(_adding_upsert(dialect, LATENCY, ("hour", "model", "metric", "bucket"), ("count",)), latency_rows)


# reading --------------------------------------------------------------------------------------
def _day_expr(dialect_name: str, column: Any) -> Any:
    if dialect_name == "postgresql":
        return sa.cast(sa.func.timezone("UTC", column), sa.Date)
    return sa.func.substr(column, 1, 10)  # SQLite keeps UTC datetimes as 'YYYY-MM-DD HH:MM:SS...'


def _sum_expr(name: str) -> Any:
    if name == "total_tokens":
        return sa.func.sum(HOURLY.c.prompt_tokens) + sa.func.sum(HOURLY.c.completion_tokens)
    if name not in COUNTS + SUMS:
        raise ValueError(f"cannot order by {name!r}")
    return sa.func.sum(HOURLY.c[name])


def _as_day(value: Any) -> str:
    return value.isoformat() if isinstance(value, date) else str(value)


def _totals(row: Any) -> dict[str, Any]:
    out = {c: int(getattr(row, c) or 0) for c in COUNTS}
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    out["cost_usd"] = usd(out["cost_nanos"])
    out["error_rate"] = out["errors"] / out["requests"] if out["requests"] else 0.0
    out["avg_latency_ms"] = float(row.total_ms_sum or 0) / out["requests"] if out["requests"] else None
    out["avg_ttft_ms"] = float(row.ttft_ms_sum or 0) / out["ttft_count"] if out["ttft_count"] else None
    return out


async def usage_groups(
    engine: AsyncEngine,
    period: Period,
    group_by: Sequence[str] = (),
    *,
    account_id: int | None = None,
    key_id: int | None = None,
    order_by: Sequence[str] = (),
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Sums over the period, one dict per group (`day`, `model`, `key_id`, `account_id` as asked),
    largest first by `order_by` sums (e.g. ("cost_nanos", "total_tokens")), else by group."""
    unknown = set(group_by) - set(GROUPS) - {"account"}
    if unknown:
        raise ValueError(f"unknown group {sorted(unknown)[0]!r}")
    columns: list[Any] = []
    if "day" in group_by:
        columns.append(_day_expr(engine.dialect.name, HOURLY.c.hour).label("day"))
    if "model" in group_by:
        columns.append(HOURLY.c.model)
    if "account" in group_by or "key" in group_by:
        columns.append(HOURLY.c.account_id)
    if "key" in group_by:
        columns.append(HOURLY.c.key_id)
    sums = [sa.func.coalesce(sa.func.sum(HOURLY.c[c]), 0).label(c) for c in COUNTS + SUMS]
    query = sa.select(*columns, *sums).where(HOURLY.c.hour >= period.start, HOURLY.c.hour < period.end)
    if account_id is not None:
        query = query.where(HOURLY.c.account_id == account_id)
    if key_id is not None:
        query = query.where(HOURLY.c.key_id == key_id)
    if columns:
        query = query.group_by(*columns)
    if order_by:
        query = query.order_by(*(sa.desc(_sum_expr(name)) for name in order_by))
    elif columns:
        query = query.order_by(*columns)
    if limit is not None:
        query = query.limit(limit)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    out = []
    for row in rows:
        group: dict[str, Any] = {}
        if "day" in group_by:
            group["day"] = _as_day(row.day)
        if "model" in group_by:
            group["model"] = row.model
        if "account" in group_by or "key" in group_by:
            group["account_id"] = row.account_id
        if "key" in group_by:
            group["key_id"] = row.key_id
        out.append({**group, **_totals(row)})
    return out


def percentile(histogram: dict[int, int], q: float) -> float | None:
    total = sum(histogram.values())
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= rank:
            return bucket_value(bucket)
    return bucket_value(max(histogram))


async def latency_percentiles(
    engine: AsyncEngine, period: Period, *, model: str | None = None, quantiles: Sequence[float] = (0.5, 0.9, 0.99)
) -> dict[str, dict[str, Any]]:
    """Per model: count and percentiles (ms) of request latency (`total`) and time to first token."""
    query = (
        sa.select(LATENCY.c.model, LATENCY.c.metric, LATENCY.c.bucket, sa.func.sum(LATENCY.c.count).label("n"))
        .where(LATENCY.c.hour >= period.start, LATENCY.c.hour < period.end)
        .group_by(LATENCY.c.model, LATENCY.c.metric, LATENCY.c.bucket)
    )
    if model is not None:
        query = query.where(LATENCY.c.model == model)
    histograms: dict[str, dict[str, dict[int, int]]] = defaultdict(lambda: defaultdict(dict))
    async with engine.connect() as conn:
        for row in await conn.execute(query):
            histograms[row.model][row.metric][int(row.bucket)] = int(row.n)
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(histograms):
        per_metric = {}
        for metric in ("total", "ttft"):
            hist = histograms[name].get(metric, {})
            per_metric[metric] = {
                "count": sum(hist.values()),
                **{f"p{round(q * 100):d}": percentile(hist, q) for q in quantiles},
            }
        out[name] = per_metric
    return out
