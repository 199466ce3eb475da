"""Spend alerts: rules, the crossings they saw, and every webhook delivery attempt.

    alert_rules       per account (key_id NULL) or per key: a metric and a threshold, absolute or a
                      percent of the scope's limit; the account's webhook URL and signing secret
    alert_events      one row per crossing, unique (rule_id, crossing): the month for monthly
                      metrics, `below-<n>` for a balance (n: the rule's re-arm count, raised
                      when the balance is back at or above the threshold),
                      so several processes that see the same crossing record it once
    alert_deliveries  every attempt to deliver an event's webhook: status, error, when
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Field, SQLModel

ALERT_METRICS = ("monthly_spend", "monthly_tokens", "balance_below")


def _ts(nullable: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(sa.DateTime(timezone=True), nullable=nullable)


class AlertRule(SQLModel, table=True):
    __tablename__ = "alert_rules"

    id: int | None = Field(default=None, primary_key=True)
    account_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("accounts.id"), nullable=False, index=True))
    key_id: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, sa.ForeignKey("api_keys.id"), nullable=True))
    metric: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))
    # nano-USD (monthly_spend, balance_below) or tokens (monthly_tokens); NULL when `percent` is set
    threshold: int | None = Field(default=None, sa_column=sa.Column(sa.BigInteger, nullable=True))
    percent: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))  # of the scope's monthly limit
    url: str = Field(sa_column=sa.Column(sa.String(2000), nullable=False))
    secret: str = Field(sa_column=sa.Column(sa.String(128), nullable=False))
    # balance_below: how many times the balance rose back to the threshold or above after a crossing;
    # the crossing key holds it, so the rule fires again only after such a rise (never on a top-up
    # that leaves the balance below).
    rearmed: int = Field(default=0, sa_column=sa.Column(sa.Integer, nullable=False, server_default="0"))
    created_at: datetime = Field(sa_column=_ts())


class AlertEvent(SQLModel, table=True):
    __tablename__ = "alert_events"
    __table_args__ = (sa.UniqueConstraint("rule_id", "crossing", name="uq_alert_events_rule_crossing"),)

    id: int | None = Field(default=None, primary_key=True)
    rule_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("alert_rules.id"), nullable=False))
    account_id: int = Field(sa_column=sa.Column(sa.Integer, nullable=False, index=True))
    crossing: str = Field(sa_column=sa.Column(sa.String(64), nullable=False))
    value: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))
    threshold: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))
    message: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    delivered_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    created_at: datetime = Field(sa_column=_ts())


class AlertDelivery(SQLModel, table=True):
    __tablename__ = "alert_deliveries"

    id: int | None = Field(default=None, primary_key=True)
    event_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("alert_events.id"), nullable=False, index=True))
    attempt: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    status_code: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))
    error: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    created_at: datetime = Field(sa_column=_ts())
