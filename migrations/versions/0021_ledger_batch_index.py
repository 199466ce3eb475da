"""ix_ledger_batch and batches.model: what a Batch object shows of its model and usage

A Batch object's `usage` sums the rows of its lines (`batch_id`). Partial: only rows of batch lines
are in it, so the ledger's ordinary rows cost their writes nothing more. (A range of the lines'
request ids would ride the unique index, but how '-' and '.' sort depends on the database's
collation.) `model`: the one model an OpenAI batch's lines name, kept at creation; a batch made
before this shows none.

Revision ID: 0021_ledger_batch_index
Revises: 0020_file_expiry
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0021_ledger_batch_index"
down_revision = "0020_file_expiry"
branch_labels = None
depends_on = None

ROWS_OF_BATCHES = sa.text("batch_id IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("model", sa.Text, nullable=True))
    op.create_index("ix_ledger_batch", "ledger_entries", ["batch_id"], postgresql_where=ROWS_OF_BATCHES, sqlite_where=ROWS_OF_BATCHES)


def downgrade() -> None:
    op.drop_index("ix_ledger_batch", table_name="ledger_entries")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("model")
