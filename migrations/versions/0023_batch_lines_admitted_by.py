"""ix_batch_lines_admitted_by: the lines a runner marked admitted, found by that runner's id

A restarted runner looks up, once, the lines the killed run on its journal marked admitted and
never journaled (gateway/batches/runner.py: BatchRunner._sweep), across every batch and whatever
their state. Partial: a line enters it when it is marked admitted (a line claimed and put back
never does), so claims cost it nothing.

Revision ID: 0023_batch_lines_admitted_by
Revises: 0022_ledger_postpaid
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0023_batch_lines_admitted_by"
down_revision = "0022_ledger_postpaid"
branch_labels = None
depends_on = None

ADMITTED = sa.text("admitted_at IS NOT NULL")


def upgrade() -> None:
    op.create_index("ix_batch_lines_admitted_by", "batch_lines", ["claimed_by"], postgresql_where=ADMITTED, sqlite_where=ADMITTED)


def downgrade() -> None:
    op.drop_index("ix_batch_lines_admitted_by", table_name="batch_lines")
