"""ledger_entries.postpaid: a row whose admission held no prepaid balance

A row is a prepaid balance's when it was admitted at or after the account's `prepaid_since` and
its admission held the balance. A request authenticated while the account was still postpaid (a
key cached for a second, a process the switch did not reach) holds no balance, so its row is
invoiced: `postpaid` says so, true or false on every row written from now on. Rows written before
have none (NULL): the rule they were posted, invoiced and stated under keeps deciding for them, the
finish instant (`created_at` at or after `prepaid_since`), so nothing already paid from a balance is
invoiced as well, nor the other way round.

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
    # Nullable with no default: Postgres adds it without rewriting the partitions, and the rows
    # before it say NULL (the rule they were written under).
    op.add_column("ledger_entries", sa.Column("postpaid", sa.Boolean, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("postpaid")
