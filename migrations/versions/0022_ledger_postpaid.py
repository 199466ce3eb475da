"""ledger_entries.postpaid: a row whose admission held no prepaid balance

A row is a prepaid balance's when it was admitted at or after the account's `prepaid_since` and
its admission held the balance. A request authenticated while the account was still postpaid (a
key cached for a second, a process the switch did not reach) holds no balance, so its row is
invoiced: `postpaid` says so. Rows before this have none (false): the admission instant decides, as
before.

Revision ID: 0022_ledger_postpaid
Revises: 0021_ledger_batch_index
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0022_ledger_postpaid"
down_revision = "0021_ledger_batch_index"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A constant default: Postgres adds it without rewriting the partitions.
    op.add_column("ledger_entries", sa.Column("postpaid", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("postpaid")
