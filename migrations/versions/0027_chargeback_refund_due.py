"""invoice_chargebacks.settled_cents, refunded_cents, refunded_at: a settled dispute later won is a refund due

A person records a chargeback settled (the customer paid the disputed amount again outside Stripe);
if the dispute is then won (or part of it reinstated), the bank gives the money back to us as well and
the customer has paid twice. settled_cents keeps what the settlement covered (the row's amount_cents
then: amount_cents follows the dispute's later events), so the refund due is
settled_cents - amount_cents - refunded_cents (billing/invoices/models.py chargeback_refund_due);
refunded_cents and refunded_at: what a person recorded refunded of it (chargeback_refunded).

A row settled before this revision gets its amount_cents, unless its dispute is won already (amount 0:
the very case this revision shows): then what the dispute took before it was won, its disputed_cents.

Plain ALTERs (not a batch: on SQLite a rebuild drops the table, see 0026).

Revision ID: 0027_chargeback_refund_due
Revises: 0026_invoice_chargeback_disputes
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0027_chargeback_refund_due"
down_revision = "0026_invoice_chargeback_disputes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("invoice_chargebacks", sa.Column("settled_cents", sa.BigInteger, nullable=True))
    op.add_column("invoice_chargebacks", sa.Column("refunded_cents", sa.BigInteger, nullable=False, server_default="0"))
    op.add_column("invoice_chargebacks", sa.Column("refunded_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(sa.text(
        "UPDATE invoice_chargebacks SET settled_cents = CASE WHEN status = 'won' AND amount_cents = 0 THEN disputed_cents"
        " ELSE amount_cents END WHERE settled_at IS NOT NULL"))


def downgrade() -> None:
    for column in ("refunded_at", "refunded_cents", "settled_cents"):
        op.execute(sa.text(f"ALTER TABLE invoice_chargebacks DROP COLUMN {column}"))  # not a batch: see upgrade()
