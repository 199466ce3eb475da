"""ledger_entries.cached_tokens and usage_hourly.cached_tokens: prompt tokens served from the engine's prefix cache

ledger_entries.cached_tokens is NULL where the engine or upstream did not say (and on rows written
before this revision); usage_hourly.cached_tokens sums it (NULL adds 0), so existing hours start
at 0, which is what their rows say.

Revision ID: 0008_cached_tokens
Revises: 0007_api
Create Date: 2026-12-21
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_cached_tokens"
down_revision = "0007_api"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        batch.add_column(sa.Column("cached_tokens", sa.Integer(), nullable=True))
    with op.batch_alter_table("usage_hourly") as batch:
        batch.add_column(sa.Column("cached_tokens", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("usage_hourly") as batch:
        batch.drop_column("cached_tokens")
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("cached_tokens")
