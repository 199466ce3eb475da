"""The prepaid credit ledger: every change to a prepaid account's balance is one row.

    kind        amount_nanos   what
    topup       +              purchased credit (Stripe Checkout, an admin)
    grant       +              promotional credit, spent before purchased credit; may expire
    usage       -              the account's metered usage, posted in batches (grant_id: the grant it used)
    refund      -/+            a refunded top-up; + gives back a refund that failed (external_id `<refund id>:failed`)
    expiry      -/+            the unused rest of an expired grant (grant_id); + gives back what a request
                               admitted before the expiry, and posted after it, used of that rest
    adjustment  +/-            a manual correction with its reason and the admin key that made it

`external_id` is unique: a Stripe Checkout Session, a refund, `expiry:<grant id>` or
`expiry:<grant id>:back:<ledger id>`, so a repeat
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
    """A prepaid account's Stripe payment details and auto-recharge (billing/stripe/checkout.py).

    recharge_state: idle | pending (one off-session charge in flight, at most one; only its outcome
    ends it, a settings change does not) | failed (the last charge was declined: `recharge_error`
    says why; no new charge until it is cleared)."""

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
    # the amount the pending claim charges (its create is sent again with it, whatever the settings say since)
    recharge_claim_cents: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))
    updated_at: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))


class CreditUsageMark(SQLModel, table=True):
    """How far a prepaid account's usage is posted (billing/credits/balance.py `post_usage`), so a batch reads
    only ledger rows it has not posted: those with `posted_id < id <= frontier_id`.

    Ledger ids come from one sequence when a row is inserted (a row replayed from a journal or
    retried after an outage gets a new, higher id), so "every id up to N" is a complete set once no
    transaction that took an id <= N is still open. `frontier_id` is the highest id seen at
    `frontier_at`; a batch posts up to it only `settle` seconds later (TOLLGATE_CREDITS_SETTLE_SECONDS),
    longer than any ledger write transaction lasts."""

    __tablename__ = "credit_usage_marks"

    account_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("accounts.id"), primary_key=True, autoincrement=False))
    posted_id: int | None = Field(default=None, sa_column=sa.Column(sa.BigInteger, nullable=True))  # NULL: nothing posted through a mark yet
    posted_nanos: int = Field(default=0, sa_column=sa.Column(sa.BigInteger, nullable=False, server_default="0"))  # sum of its usage rows, negated
    posted_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))  # frontier_at of posted_id
    frontier_id: int | None = Field(default=None, sa_column=sa.Column(sa.BigInteger, nullable=True))
    frontier_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))


class PrepaidStatement(SQLModel, table=True):
    """A prepaid account's monthly statement (billing/invoices/statements.py), made by the monthly close: the
    opening balance, the credit rows of the month, its usage, the closing balance. Nothing is due
    (usage was paid from the balance) and it never goes to Stripe. One per account and period; an
    issued statement is never edited (late usage shows on the next one)."""

    __tablename__ = "prepaid_statements"
    __table_args__ = (sa.UniqueConstraint("account_id", "period", name="uq_prepaid_statements_account_period"),)

    id: int | None = Field(default=None, primary_key=True)
    number: str = Field(sa_column=sa.Column(sa.String(32), nullable=False, unique=True))
    account_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("accounts.id"), nullable=False, index=True))
    period: str = Field(sa_column=sa.Column(sa.String(7), nullable=False))
    period_start: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))
    period_end: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))
    opening_nanos: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))
    credits_nanos: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))  # top-ups, grants, refunds, expiries, adjustments
    usage_nanos: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))  # the month's usage (positive: a debit)
    late_nanos: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))  # earlier months, recorded after their statement
    closing_nanos: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))
    content: str = Field(sa_column=sa.Column(sa.Text, nullable=False))  # JSON: the credit rows and the usage per model
    seller: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    buyer: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    issued_at: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))
