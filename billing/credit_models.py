"""The prepaid credit ledger: every change to a prepaid account's balance is one row.

    kind        amount_nanos   what
    topup       +              purchased credit (Stripe Checkout, an admin)
    grant       +              promotional credit, spent before purchased credit; may expire
    usage       -              the account's metered usage, posted in batches (grant_id: the grant it used)
    refund      -              a refunded top-up
    expiry      -              the unused rest of an expired grant (grant_id)
    adjustment  +/-            a manual correction with its reason and the admin key that made it

`external_id` is unique: a Stripe Checkout Session, a refund, or `expiry:<grant id>`, so a repeat
(a webhook delivered again, two instances expiring the same grant) adds nothing.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Field, SQLModel

CREDIT_KINDS = ("topup", "grant", "usage", "refund", "expiry", "adjustment")


class CreditEntry(SQLModel, table=True):
    __tablename__ = "credit_entries"
    __table_args__ = (sa.Index("ix_credit_entries_account_created", "account_id", "created_at"),)

    id: int | None = Field(
        default=None,
        sa_column=sa.Column(sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    )
    account_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("accounts.id"), nullable=False))
    kind: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))
    amount_nanos: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))  # signed nano-USD
    grant_id: int | None = Field(default=None, sa_column=sa.Column(sa.BigInteger, nullable=True))
    expires_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
    # usage rows: the account's usage is posted up to this instant
    usage_until: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
    reason: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    admin_key_id: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))
    external_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(255), nullable=True, unique=True))
    created_at: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))


class CreditSettings(SQLModel, table=True):
    """A prepaid account's Stripe payment details and auto-recharge (billing/checkout.py).

    recharge_state: idle | pending (one off-session charge in flight, at most one) | failed (the
    last charge was declined: `recharge_error` says why; no new charge until it is cleared)."""

    __tablename__ = "credit_settings"

    account_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("accounts.id"), primary_key=True, autoincrement=False))
    stripe_customer_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(255), nullable=True))
    payment_method_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(255), nullable=True))
    recharge_below_nanos: int | None = Field(default=None, sa_column=sa.Column(sa.BigInteger, nullable=True))
    recharge_amount_cents: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))
    recharge_state: str = Field(default="idle", sa_column=sa.Column(sa.String(16), nullable=False, server_default="idle"))
    recharge_count: int = Field(default=0, sa_column=sa.Column(sa.Integer, nullable=False, server_default="0"))
    recharge_payment_intent: str | None = Field(default=None, sa_column=sa.Column(sa.String(255), nullable=True))
    recharge_error: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    updated_at: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))
