"""batch_lines.claimed_by, batch_lines.admitted_at: which runner claimed a line, and when it admitted it

A line is marked admitted in the database (by the runner that claimed it, conditionally) before its
ledger row is journaled on the runner's own volume: a runner that takes a batch over from another
instance, whose journal it cannot read, puts back only lines that were never admitted, and a
runner whose line was taken from it cannot admit that line any more.

Revision ID: 0018_batch_line_admitted
Revises: 0017_batches
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0018_batch_line_admitted"
down_revision = "0017_batches"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batch_lines") as batch:
        batch.add_column(sa.Column("claimed_by", sa.String(40), nullable=True))
        batch.add_column(sa.Column("admitted_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batch_lines") as batch:
        batch.drop_column("admitted_at")
        batch.drop_column("claimed_by")
