"""invoices.charged_back_at, invoices.chargeback_dispute_id: a paid invoice whose payment was charged back

Stripe leaves a paid invoice `paid` when the cardholder's bank disputes its payment; the dispute
comes only as charge.dispute.* on the invoice's PaymentIntent (billing/stripe/invoice_disputes.py).
While the dispute has the money and is not won, the invoice is owed again
(billing/invoices/account_state.py). NULL on every invoice when this runs: a chargeback from before
is found when any event about its dispute arrives again.

Revision ID: 0024_invoice_chargebacks
Revises: 0023_batch_lines_admitted_by
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0024_invoice_chargebacks"
down_revision = "0023_batch_lines_admitted_by"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("invoices") as batch:
        batch.add_column(sa.Column("charged_back_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("chargeback_dispute_id", sa.String(255), nullable=True))


def downgrade() -> None:
    # Plain ALTERs: on SQLite a batch (table rebuild) of `invoices` drops the table, which invoice_lines'
    # foreign key refuses once there are invoices.
    op.execute(sa.text("ALTER TABLE invoices DROP COLUMN chargeback_dispute_id"))
    op.execute(sa.text("ALTER TABLE invoices DROP COLUMN charged_back_at"))
