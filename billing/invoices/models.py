"""Tables for prices per account, monthly invoices, Stripe links and webhook deliveries.

    price_overrides   per account: a custom price for one model, or a multiplier (one model or "*")
    billing_periods   one row per closed (or closing) month: the close is resumable and idempotent
    invoices          one per account and period (unique): totals in integer cents, Stripe ids
    invoice_lines     one per model, direction and price (and per late period for adjustments)
    billing_accounts  an account's Stripe customer and its billing state (active/past_due/suspended)
    stripe_events     webhook event ids already handled (deduplication)
    billing_details   per account: the buyer's legal name, address, country, billing email, tax id, tax rate
    tax_rates         per country: the tax rate (percent) an account there pays unless its own says otherwise
    document_sequences per seller and kind: the last number given, so invoice and credit note numbers have no gaps
    credit_notes      numbered credits against an issued invoice (an issued invoice is never edited)
    invoice_chargebacks one per (invoice, Stripe dispute) of a payment of the invoice: what it takes back
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlmodel import Field, SQLModel

ANY_MODEL = "*"


def _ts(nullable: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(sa.DateTime(timezone=True), nullable=nullable)


class PriceOverride(SQLModel, table=True):
    """A version of an account's override, in force from `effective_from` until the next version of
    the same (account, model). kind: price (custom prices), multiplier (x the base price), base
    (back to the base price). Versions are only added, never edited."""

    __tablename__ = "price_overrides"
    __table_args__ = (
        sa.UniqueConstraint("account_id", "model", "effective_from", name="uq_price_overrides_account_model_effective"),
    )

    id: int | None = Field(default=None, primary_key=True)
    account_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("accounts.id"), nullable=False, index=True))
    model: str = Field(sa_column=sa.Column(sa.String(128), nullable=False))  # or "*": every model
    kind: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))
    input_per_million: Decimal | None = Field(default=None, sa_column=sa.Column(sa.Numeric(18, 3), nullable=True))
    output_per_million: Decimal | None = Field(default=None, sa_column=sa.Column(sa.Numeric(18, 3), nullable=True))
    # A custom price's cached-input price; NULL: cached prompt tokens cost its input price.
    cached_input_per_million: Decimal | None = Field(default=None, sa_column=sa.Column(sa.Numeric(18, 3), nullable=True))
    multiplier: Decimal | None = Field(default=None, sa_column=sa.Column(sa.Numeric(12, 6), nullable=True))
    effective_from: datetime = Field(sa_column=_ts())
    created_at: datetime = Field(sa_column=_ts())


class BillingPeriod(SQLModel, table=True):
    __tablename__ = "billing_periods"

    period: str = Field(sa_column=sa.Column(sa.String(7), primary_key=True))  # "2026-11"
    status: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))  # closing | closed
    accounts_total: int = Field(default=0, sa_column=sa.Column(sa.Integer, nullable=False, default=0))
    accounts_done: int = Field(default=0, sa_column=sa.Column(sa.Integer, nullable=False, default=0))
    started_at: datetime = Field(sa_column=_ts())
    closed_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class Invoice(SQLModel, table=True):
    __tablename__ = "invoices"
    __table_args__ = (sa.UniqueConstraint("account_id", "period", name="uq_invoices_account_period"),)

    id: int | None = Field(default=None, primary_key=True)
    number: str = Field(sa_column=sa.Column(sa.String(32), nullable=False, unique=True))
    account_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("accounts.id"), nullable=False))
    period: str = Field(sa_column=sa.Column(sa.String(7), nullable=False, index=True))
    period_start: datetime = Field(sa_column=_ts())
    period_end: datetime = Field(sa_column=_ts())
    status: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))  # open | paid | void
    currency: str = Field(default="usd", sa_column=sa.Column(sa.String(3), nullable=False))
    total_cents: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))
    # JSON list of the price versions and overrides the lines used.
    price_versions: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    created_at: datetime = Field(sa_column=_ts())
    paid_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    # First payment failure seen (a webhook's event time); starts the grace period.
    payment_failed_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    # Its payments charged back (disputes that took money back and are not won, nor settled by a
    # person; the invoice stays paid on Stripe): owed again. The earliest such dispute's `created`,
    # and the sum they took back (cents): kept from invoice_chargebacks in the same transaction.
    charged_back_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    chargeback_cents: int = Field(default=0, sa_column=sa.Column(sa.BigInteger, nullable=False, server_default="0"))
    # As the code before migration 0026 kept it (one dispute per invoice), which still reads it while a
    # rolling update replaces it: the earliest dispute owed again, else `settled:<id>`, else NULL.
    chargeback_dispute_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(255), nullable=True))
    stripe_invoice_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(255), nullable=True, unique=True))
    stripe_status: str | None = Field(default=None, sa_column=sa.Column(sa.String(32), nullable=True))
    stripe_total_cents: int | None = Field(default=None, sa_column=sa.Column(sa.BigInteger, nullable=True))
    stripe_synced_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    stripe_sent_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    stripe_error: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    # The document. Snapshots (JSON) of the seller and the buyer as they were at issue: a
    # later change of either never rewrites an issued invoice. NULL seller: a usage statement.
    seller: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    buyer: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    issued_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    due_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    payment_terms: str | None = Field(default=None, sa_column=sa.Column(sa.String(200), nullable=True))
    subtotal_cents: int | None = Field(default=None, sa_column=sa.Column(sa.BigInteger, nullable=True))
    # Percent, exact (19.000 = 19%); NULL: no tax. tax_cents = subtotal x rate / 100, half up, once.
    tax_rate: Decimal | None = Field(default=None, sa_column=sa.Column(sa.Numeric(7, 3), nullable=True))
    tax_cents: int = Field(default=0, sa_column=sa.Column(sa.BigInteger, nullable=False, server_default="0"))
    # Credit notes credited to the customer's balance, applied to this invoice's amount due.
    credit_applied_cents: int = Field(default=0, sa_column=sa.Column(sa.BigInteger, nullable=False, server_default="0"))
    # Below Stripe's minimum charge (USD $0.50): what of this invoice's amount due Stripe did not charge
    # but carried to the customer's next Stripe invoice (an `invoice_too_small` debit; Stripe marks this
    # one paid), and what of earlier invoices Stripe carried into this one (the debit its finalize applied).
    carried_to_next_cents: int = Field(default=0, sa_column=sa.Column(sa.BigInteger, nullable=False, server_default="0"))
    carried_in_cents: int = Field(default=0, sa_column=sa.Column(sa.BigInteger, nullable=False, server_default="0"))


class InvoiceLine(SQLModel, table=True):
    __tablename__ = "invoice_lines"
    __table_args__ = (sa.UniqueConstraint("invoice_id", "position", name="uq_invoice_lines_position"),)

    id: int | None = Field(default=None, primary_key=True)
    invoice_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("invoices.id"), nullable=False, index=True))
    position: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    kind: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))  # usage | adjustment
    usage_period: str = Field(sa_column=sa.Column(sa.String(7), nullable=False))
    model: str = Field(sa_column=sa.Column(sa.String(128), nullable=False))
    direction: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))  # input | cached | output | batch_input | batch_output | cached_response
    tokens: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))
    # USD per million tokens after any override; NULL when no price was in force (amount 0).
    unit_price: Decimal | None = Field(default=None, sa_column=sa.Column(sa.Numeric(30, 9), nullable=True))
    amount_cents: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))
    price_version_id: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))
    override_id: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))
    description: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    stripe_item_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(255), nullable=True, unique=True))


class BillingAccount(SQLModel, table=True):
    __tablename__ = "billing_accounts"

    account_id: int = Field(
        sa_column=sa.Column(sa.Integer, sa.ForeignKey("accounts.id"), primary_key=True, autoincrement=False)
    )
    stripe_customer_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(255), nullable=True, unique=True))
    state: str = Field(default="active", sa_column=sa.Column(sa.String(16), nullable=False))
    # Earliest unresolved payment problem (failed invoice or delinquent subscription), else NULL.
    delinquent_since: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    subscription_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(255), nullable=True))
    subscription_status: str | None = Field(default=None, sa_column=sa.Column(sa.String(32), nullable=True))
    subscription_delinquent_since: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    updated_at: datetime = Field(sa_column=_ts())


class StripeEvent(SQLModel, table=True):
    __tablename__ = "stripe_events"

    id: str = Field(sa_column=sa.Column(sa.String(255), primary_key=True))
    type: str = Field(sa_column=sa.Column(sa.String(128), nullable=False))
    created: datetime = Field(sa_column=_ts())
    processed_at: datetime = Field(sa_column=_ts())


class BillingDetails(SQLModel, table=True):
    """Who an account's invoices are made out to. Invoices copy it when issued (Invoice.buyer)."""

    __tablename__ = "billing_details"

    account_id: int = Field(
        sa_column=sa.Column(sa.Integer, sa.ForeignKey("accounts.id"), primary_key=True, autoincrement=False)
    )
    legal_name: str = Field(sa_column=sa.Column(sa.String(200), nullable=False))
    address_line1: str | None = Field(default=None, sa_column=sa.Column(sa.String(200), nullable=True))
    address_line2: str | None = Field(default=None, sa_column=sa.Column(sa.String(200), nullable=True))
    city: str | None = Field(default=None, sa_column=sa.Column(sa.String(100), nullable=True))
    postal_code: str | None = Field(default=None, sa_column=sa.Column(sa.String(20), nullable=True))
    region: str | None = Field(default=None, sa_column=sa.Column(sa.String(100), nullable=True))
    country: str = Field(sa_column=sa.Column(sa.String(2), nullable=False))  # ISO 3166-1 alpha-2
    email: str | None = Field(default=None, sa_column=sa.Column(sa.String(254), nullable=True))
    tax_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(64), nullable=True))
    tax_id_type: str | None = Field(default=None, sa_column=sa.Column(sa.String(16), nullable=True))  # Stripe's, e.g. eu_vat
    # The account's own tax rate (percent), over its country's; NULL: the country's.
    tax_rate: Decimal | None = Field(default=None, sa_column=sa.Column(sa.Numeric(7, 3), nullable=True))
    updated_at: datetime = Field(sa_column=_ts())


class TaxRate(SQLModel, table=True):
    __tablename__ = "tax_rates"

    country: str = Field(sa_column=sa.Column(sa.String(2), primary_key=True))
    rate: Decimal = Field(sa_column=sa.Column(sa.Numeric(7, 3), nullable=False))  # percent
    updated_at: datetime = Field(sa_column=_ts())


class DocumentSequence(SQLModel, table=True):
    """The last number given per (seller, kind): taken and advanced in the transaction that inserts
    the document, so a rolled-back close leaves no gap."""

    __tablename__ = "document_sequences"

    seller: str = Field(sa_column=sa.Column(sa.String(200), primary_key=True))
    kind: str = Field(sa_column=sa.Column(sa.String(16), primary_key=True))  # invoice | credit_note
    last_number: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))


class CreditNote(SQLModel, table=True):
    __tablename__ = "credit_notes"

    id: int | None = Field(default=None, primary_key=True)
    number: str = Field(sa_column=sa.Column(sa.String(32), nullable=False, unique=True))
    invoice_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("invoices.id"), nullable=False, index=True))
    account_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("accounts.id"), nullable=False, index=True))
    kind: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))  # void | partial
    reason: str | None = Field(default=None, sa_column=sa.Column(sa.String(32), nullable=True))
    memo: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    subtotal_cents: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))
    tax_cents: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))
    total_cents: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))
    # balance: the invoice was paid, so the credit goes to the customer's balance and the next
    # invoice applies it; invoice: it reduces what is still due on the invoice (what exceeds that,
    # the balance credit the invoice applied, goes back to the balance: documents.balance_credit).
    applies_to: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))
    seller: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    buyer: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    issued_at: datetime = Field(sa_column=_ts())
    # The next invoice of the account, which lists it (and applies a balance credit).
    shown_on_invoice_id: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, sa.ForeignKey("invoices.id"), nullable=True))
    stripe_credit_note_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(255), nullable=True, unique=True))
    stripe_error: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))


class InvoiceChargeback(SQLModel, table=True):
    """One Stripe dispute of a payment of an invoice (billing/stripe/invoice_disputes.py): an invoice
    paid by several payments, or one payment disputed more than once, has several. `amount_cents`: what
    it takes back of this invoice now (the withdrawn amount less any reinstated; 0 once won); it counts
    in the invoice's chargeback_cents while `settled_at` is NULL. Settled, then won: the customer paid
    twice (chargeback_refund_due)."""

    __tablename__ = "invoice_chargebacks"
    __table_args__ = (sa.UniqueConstraint("invoice_id", "dispute_id", name="uq_invoice_chargebacks_dispute"),)

    id: int | None = Field(default=None, primary_key=True)
    invoice_id: int = Field(sa_column=sa.Column(sa.Integer, sa.ForeignKey("invoices.id"), nullable=False, index=True))
    dispute_id: str = Field(sa_column=sa.Column(sa.String(255), nullable=False))  # du_...
    payment_intent: str | None = Field(default=None, sa_column=sa.Column(sa.String(255), nullable=True))
    status: str = Field(sa_column=sa.Column(sa.String(32), nullable=False))  # the Dispute's, as last read
    currency: str = Field(default="usd", sa_column=sa.Column(sa.String(3), nullable=False))
    disputed_cents: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))  # the dispute's amount, on this invoice
    amount_cents: int = Field(sa_column=sa.Column(sa.BigInteger, nullable=False))  # taken back now
    disputed_at: datetime = Field(sa_column=_ts())  # the dispute's `created`
    # A person recorded it paid again outside Stripe (POST /admin/invoices/{id}/chargeback_settled),
    # and what that covered: amount_cents then (amount_cents follows the dispute's later events).
    settled_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    settled_cents: int | None = Field(default=None, sa_column=sa.Column(sa.BigInteger, nullable=True))
    # What a person recorded refunded of a double payment (POST .../chargeback_refunded): chargeback_refund_due.
    refunded_cents: int = Field(default=0, sa_column=sa.Column(sa.BigInteger, nullable=False, server_default="0"))
    refunded_at: datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    updated_at: datetime = Field(sa_column=_ts())


def chargeback_refund_due(row: Any) -> int:
    """Cents the customer paid twice and is owed back (exact): a chargeback settled outside Stripe whose
    dispute then gave money back to us (won: all of it; a "partially won" one: the reinstated part)
    returns what it no longer takes back of what the settlement covered, less what was refunded."""
    if row.settled_at is None:
        return 0
    return max(0, int(row.settled_cents or 0) - int(row.amount_cents) - int(row.refunded_cents or 0))
