"""invoices.carried_to_next_cents, carried_in_cents: amounts Stripe carried below its minimum charge

An invoice whose amount due is above 0 but below Stripe's minimum charge for its currency (USD
$0.50) is not charged: Stripe marks it paid and adds the amount to the customer's balance as a debit
(an `invoice_too_small` balance transaction), which its next invoice for the customer collects.
carried_to_next_cents: what of this invoice Stripe carried so; carried_in_cents: what of earlier
invoices Stripe collects with this one (the customer's debit its finalize applied). Both 0 before.

Plain ALTERs (not a batch: on SQLite a rebuild drops the table, see 0026).

Revision ID: 0028_invoice_carried
Revises: 0027_chargeback_refund_due
Create Date: 2026-12-08
"""

import sqlalchemy as sa
from alembic import op

revision = "0028_invoice_carried"
down_revision = "0027_chargeback_refund_due"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("invoices", sa.Column("carried_to_next_cents", sa.BigInteger, nullable=False, server_default="0"))
    op.add_column("invoices", sa.Column("carried_in_cents", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    for column in ("carried_in_cents", "carried_to_next_cents"):
        op.execute(sa.text(f"ALTER TABLE invoices DROP COLUMN {column}"))  # not a batch: see upgrade()
