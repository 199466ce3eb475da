"""ledger_entries.admitted_at: when a request was admitted

A row's created_at is when the request finished; its price and the period it belongs to are
decided at admission. Rows written before this revision get created_at minus total_ms (the
request's duration, which the row holds), so a request that ran across a price change or a
month end moves back to the instant it started. On Postgres the backfill is one UPDATE; on
SQLite it runs in Python in batches (SQLite's date arithmetic keeps milliseconds only, and the
column must keep SQLAlchemy's microsecond text format so comparisons stay ordered).

The hourly aggregates (usage_hourly, latency_hourly) are keyed by the admission hour from now
on; the few rows whose admission falls in an earlier hour than their finish (those within their
duration of an hour boundary) are moved there: subtracted from the old hour, added to the new one.

Revision ID: 0010_admitted_at
Revises: 0009_stored_responses
Create Date: 2026-12-02
"""

from datetime import timedelta

import math
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql, sqlite

revision = "0010_admitted_at"
down_revision = "0009_stored_responses"
branch_labels = None
depends_on = None

BATCH = 5000
LEDGER = sa.table(
    "ledger_entries",
    sa.column("id", sa.Integer),
    sa.column("created_at", sa.DateTime(timezone=True)),
    sa.column("total_ms", sa.Float),
    sa.column("admitted_at", sa.DateTime(timezone=True)),
)


def _backfill_sqlite(bind: sa.Connection) -> None:
    last = 0
    while True:
        rows = bind.execute(
            sa.select(LEDGER.c.id, LEDGER.c.created_at, LEDGER.c.total_ms)
            .where(LEDGER.c.id > last).order_by(LEDGER.c.id).limit(BATCH)
        ).all()
        if not rows:
            return
        bind.execute(
            LEDGER.update().where(LEDGER.c.id == sa.bindparam("row_id")).values(admitted_at=sa.bindparam("admitted")),
            [{"row_id": r.id, "admitted": r.created_at - timedelta(milliseconds=r.total_ms or 0.0)} for r in rows],
        )
        last = rows[-1].id


WHEN = sa.DateTime(timezone=True)
COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cost_nanos", "unpriced", "errors", "cancelled", "ttft_count", "cached_tokens")
SUMS = ("total_ms_sum", "ttft_ms_sum")
HOURLY = sa.table("usage_hourly", sa.column("hour", WHEN), *(sa.column(c) for c in ("account_id", "key_id", "model", *COUNTS, *SUMS)))
LATENCY = sa.table("latency_hourly", sa.column("hour", WHEN), *(sa.column(c) for c in ("model", "metric", "bucket", "count")))


def _bucket(ms: float) -> int:
    # Frozen copy of billing.ledger.aggregates.latency_bucket as of this revision.
    return 0 if not ms or ms < 1.0 or math.isnan(ms) else min(int(math.log2(ms) * 4), 32767)


def _hour(at: datetime) -> datetime:
    at = at if at.tzinfo else at.replace(tzinfo=timezone.utc)
    return at.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)


def _moved_rows(bind: sa.Connection) -> list[Any]:
    if bind.dialect.name == "postgresql":
        differ = "date_trunc('hour', created_at AT TIME ZONE 'UTC') <> date_trunc('hour', admitted_at AT TIME ZONE 'UTC')"
    else:
        differ = "substr(created_at, 1, 13) <> substr(admitted_at, 1, 13)"  # 'YYYY-MM-DD HH'
    query = sa.text(
        "SELECT account_id, key_id, model, prompt_tokens, completion_tokens, status, cost_nanos, total_ms, ttft_ms, "
        f"cached_tokens, created_at, admitted_at FROM ledger_entries WHERE {differ}"
    ).columns(created_at=WHEN, admitted_at=WHEN)
    return list(bind.execute(query).all())


def _rehour(bind: sa.Connection, back: bool = False) -> None:
    """Moves what rows admitted in an earlier hour than they finished add to the aggregates: to
    the admission hour (back: to the finish hour again, for the downgrade)."""
    usage: dict[tuple[Any, ...], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    latency: dict[tuple[Any, ...], int] = defaultdict(int)
    for r in _moved_rows(bind):
        for hour, sign in ((_hour(r.created_at), 1 if back else -1), (_hour(r.admitted_at), -1 if back else 1)):
            u = usage[(hour, r.account_id, r.key_id, r.model)]
            u["requests"] += sign
            u["prompt_tokens"] += sign * r.prompt_tokens
            u["completion_tokens"] += sign * r.completion_tokens
            u["cost_nanos"] += sign * (r.cost_nanos or 0)
            u["unpriced"] += sign * (r.cost_nanos is None)
            u["errors"] += sign * (r.status in ("error", "interrupted"))
            u["cancelled"] += sign * (r.status == "cancelled")
            u["cached_tokens"] += sign * (r.cached_tokens or 0)
            u["total_ms_sum"] += sign * r.total_ms
            latency[(hour, r.model, "total", _bucket(r.total_ms))] += sign
            if r.ttft_ms is not None:
                u["ttft_ms_sum"] += sign * r.ttft_ms
                u["ttft_count"] += sign
                latency[(hour, r.model, "ttft", _bucket(r.ttft_ms))] += sign
    insert = postgresql.insert if bind.dialect.name == "postgresql" else sqlite.insert
    for (hour, account, key, model), v in sorted(usage.items()):
        values = {"hour": hour, "account_id": account, "key_id": key, "model": model,
                  **{c: int(v.get(c, 0)) for c in COUNTS}, **{c: float(v.get(c, 0.0)) for c in SUMS}}
        stmt = insert(HOURLY).values(**values)
        bind.execute(stmt.on_conflict_do_update(
            index_elements=["hour", "account_id", "key_id", "model"],
            set_={c: HOURLY.c[c] + stmt.excluded[c] for c in (*COUNTS, *SUMS)},
        ))
    for (hour, model, metric, bucket), n in sorted(latency.items()):
        stmt = insert(LATENCY).values(hour=hour, model=model, metric=metric, bucket=bucket, count=n)
        bind.execute(stmt.on_conflict_do_update(
            index_elements=["hour", "model", "metric", "bucket"], set_={"count": LATENCY.c["count"] + stmt.excluded["count"]}
        ))
    bind.execute(sa.delete(HOURLY).where(HOURLY.c.requests == 0))
    bind.execute(sa.delete(LATENCY).where(LATENCY.c["count"] == 0))


def upgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        batch.add_column(sa.Column("admitted_at", sa.DateTime(timezone=True), nullable=True))
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("UPDATE ledger_entries SET admitted_at = created_at - total_ms * interval '1 millisecond'")
    else:
        _backfill_sqlite(bind)
    _rehour(bind)
    with op.batch_alter_table("ledger_entries") as batch:
        batch.alter_column("admitted_at", existing_type=sa.DateTime(timezone=True), nullable=False)
    op.create_index("ix_ledger_account_admitted", "ledger_entries", ["account_id", "admitted_at"])


def downgrade() -> None:
    _rehour(op.get_bind(), back=True)
    op.drop_index("ix_ledger_account_admitted", table_name="ledger_entries")
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("admitted_at")
