"""pre-aggregated usage per hour, account, key and model; latency histograms; dashboard sessions

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

import math
from collections import defaultdict
from datetime import timezone

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _count(name: str) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, sa.BigInteger, nullable=False, server_default="0")


def upgrade() -> None:
    op.create_table(
        "usage_hourly",
        sa.Column("hour", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("account_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("key_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("model", sa.String(128), primary_key=True),
        _count("requests"),
        _count("prompt_tokens"),
        _count("completion_tokens"),
        _count("cost_nanos"),
        _count("unpriced"),
        _count("errors"),
        _count("cancelled"),
        sa.Column("total_ms_sum", sa.Float, nullable=False, server_default="0"),
        sa.Column("ttft_ms_sum", sa.Float, nullable=False, server_default="0"),
        _count("ttft_count"),
    )
    op.create_index("ix_usage_hourly_account_hour", "usage_hourly", ["account_id", "hour"])
    op.create_table(
        "latency_hourly",
        sa.Column("hour", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("model", sa.String(128), primary_key=True),
        sa.Column("metric", sa.String(8), primary_key=True),
        sa.Column("bucket", sa.SmallInteger, primary_key=True, autoincrement=False),
        _count("count"),
    )
    op.create_table(
        "dashboard_sessions",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.Integer, nullable=False),
        sa.Column("csrf_token", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_dashboard_sessions_key_id", "dashboard_sessions", ["key_id"])
    _backfill()


def _bucket(ms: float) -> int:
    # Frozen copy of billing.ledger.aggregates.latency_bucket as of this revision.
    return 0 if ms < 1.0 else min(int(math.log2(ms) * 4), 32767)


def _backfill(page: int = 50_000) -> None:
    """Sums the ledger rows already present (one pass, paged by id) into the new tables."""
    conn = op.get_bind()
    when = sa.DateTime(timezone=True)
    ledger = sa.table(
        "ledger_entries", sa.column("created_at", when), *(sa.column(c) for c in (
            "id", "account_id", "key_id", "model", "prompt_tokens", "completion_tokens", "status",
            "cost_nanos", "total_ms", "ttft_ms"))
    )
    usage: dict = defaultdict(lambda: defaultdict(float))
    latency: dict = defaultdict(int)
    last = 0
    while True:
        rows = conn.execute(sa.select(ledger).where(ledger.c.id > last).order_by(ledger.c.id).limit(page)).all()
        if not rows:
            break
        last = rows[-1].id
        for r in rows:
            at = r.created_at if r.created_at.tzinfo else r.created_at.replace(tzinfo=timezone.utc)
            hour = at.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)
            u = usage[(hour, r.account_id, r.key_id, r.model)]
            u["requests"] += 1
            u["prompt_tokens"] += r.prompt_tokens
            u["completion_tokens"] += r.completion_tokens
            u["cost_nanos"] += r.cost_nanos or 0
            u["unpriced"] += r.cost_nanos is None
            u["errors"] += r.status == "error"
            u["cancelled"] += r.status == "cancelled"
            u["total_ms_sum"] += r.total_ms
            latency[(hour, r.model, "total", _bucket(r.total_ms))] += 1
            if r.ttft_ms is not None:
                u["ttft_ms_sum"] += r.ttft_ms
                u["ttft_count"] += 1
                latency[(hour, r.model, "ttft", _bucket(r.ttft_ms))] += 1
    ints = ("requests", "prompt_tokens", "completion_tokens", "cost_nanos", "unpriced", "errors", "cancelled", "ttft_count")
    usage_rows = [
        {"hour": h, "account_id": a, "key_id": k, "model": m,
         **{c: int(v.get(c, 0)) for c in ints},
         "total_ms_sum": v.get("total_ms_sum", 0.0), "ttft_ms_sum": v.get("ttft_ms_sum", 0.0)}
        for (h, a, k, m), v in usage.items()
    ]
    latency_rows = [
        {"hour": h, "model": m, "metric": metric, "bucket": b, "count": n} for (h, m, metric, b), n in latency.items()
    ]
    if usage_rows:
        hourly = sa.table("usage_hourly", sa.column("hour", when), *(sa.column(c) for c in usage_rows[0] if c != "hour"))
        for i in range(0, len(usage_rows), 5000):
            conn.execute(sa.insert(hourly), usage_rows[i:i + 5000])
    hist = sa.table("latency_hourly", sa.column("hour", when), *(sa.column(c) for c in ("model", "metric", "bucket", "count")))
    for i in range(0, len(latency_rows), 5000):
        conn.execute(sa.insert(hist), latency_rows[i:i + 5000])


def downgrade() -> None:
    op.drop_index("ix_dashboard_sessions_key_id", table_name="dashboard_sessions")
    op.drop_table("dashboard_sessions")
    op.drop_table("latency_hourly")
    op.drop_index("ix_usage_hourly_account_hour", table_name="usage_hourly")
    op.drop_table("usage_hourly")
