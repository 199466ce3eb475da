"""Pre-aggregated usage: what the dashboards and `/v1/usage` read instead of raw ledger rows.

Both tables are written in the same transaction as the ledger rows they sum (see
`billing.ledger.writer.write_records`), by adding deltas for newly inserted rows only, so they stay
exactly equal to sums over `ledger_entries`.

    usage_hourly    one row per (hour, account, key, model): counts, tokens, cost, latency sums
    latency_hourly  one row per (hour, model, metric, bucket): a log-scale latency histogram
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Field, SQLModel


def _count(nullable: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(sa.BigInteger, nullable=nullable, server_default="0")


class UsageHour(SQLModel, table=True):
    __tablename__ = "usage_hourly"
    __table_args__ = (sa.Index("ix_usage_hourly_account_hour", "account_id", "hour"),)

    # Start of the hour, UTC.
    hour: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), primary_key=True))
    account_id: int = Field(sa_column=sa.Column(sa.Integer, primary_key=True, autoincrement=False))
    key_id: int = Field(sa_column=sa.Column(sa.Integer, primary_key=True, autoincrement=False))
    model: str = Field(sa_column=sa.Column(sa.String(128), primary_key=True))
    requests: int = Field(default=0, sa_column=_count())
    prompt_tokens: int = Field(default=0, sa_column=_count())
    completion_tokens: int = Field(default=0, sa_column=_count())
    # Sum of the rows' cost in nano-USD; unpriced rows (cost NULL) add nothing and count in `unpriced`.
    cost_nanos: int = Field(default=0, sa_column=_count())
    unpriced: int = Field(default=0, sa_column=_count())
    errors: int = Field(default=0, sa_column=_count())
    cancelled: int = Field(default=0, sa_column=_count())
    total_ms_sum: float = Field(default=0.0, sa_column=sa.Column(sa.Float, nullable=False, server_default="0"))
    ttft_ms_sum: float = Field(default=0.0, sa_column=sa.Column(sa.Float, nullable=False, server_default="0"))
    ttft_count: int = Field(default=0, sa_column=_count())
    # Sum of the rows' cached_tokens (rows that did not say add 0).
    cached_tokens: int = Field(default=0, sa_column=_count())


class LatencyHour(SQLModel, table=True):
    """Histogram of request latency (`total`) and time to first token (`ttft`) per hour and model.
    Bucket b holds values in [2^(b/4), 2^((b+1)/4)) ms (bucket 0 also holds everything below 1 ms)."""

    __tablename__ = "latency_hourly"

    hour: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), primary_key=True))
    model: str = Field(sa_column=sa.Column(sa.String(128), primary_key=True))
    metric: str = Field(sa_column=sa.Column(sa.String(8), primary_key=True))  # total | ttft
    bucket: int = Field(sa_column=sa.Column(sa.SmallInteger, primary_key=True, autoincrement=False))
    count: int = Field(default=0, sa_column=_count())


class DashboardSession(SQLModel, table=True):
    """A browser session of the dashboards, made by logging in with an API key. Only a hash of
    the cookie's token is stored; logout deletes the row, so an old cookie stops working."""

    __tablename__ = "dashboard_sessions"

    token_hash: str = Field(sa_column=sa.Column(sa.String(64), primary_key=True))
    key_id: int = Field(sa_column=sa.Column(sa.Integer, nullable=False, index=True))
    csrf_token: str = Field(sa_column=sa.Column(sa.String(64), nullable=False))
    created_at: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))
    expires_at: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))
