"""ledger_entries.price_version_id, ledger_entries.override_id: the price a request was admitted at

Invoices priced each row by the versions in force at its admitted_at, while the admitting gateway
priced it (its cost_nanos: quotas, balances, statements) with the versions its price book held,
which may lag a new version by the book's refresh (5 s) or by a start set up to a minute back. The
admission now stamps the row with the base version's and override's ids it used, and invoices bill
those. NULL on every row when this runs: those rows are priced by admitted_at, as before.

Revision ID: 0025_ledger_price_stamp
Revises: 0024_invoice_chargebacks
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0025_ledger_price_stamp"
down_revision = "0024_invoice_chargebacks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable with no default: Postgres adds them to every partition without a rewrite.
    op.add_column("ledger_entries", sa.Column("price_version_id", sa.Integer, nullable=True))
    op.add_column("ledger_entries", sa.Column("override_id", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("override_id")
        batch.drop_column("price_version_id")
