"""ledger_entries.cached: the request was answered from the response cache

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        batch.add_column(sa.Column("cached", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("cached")
