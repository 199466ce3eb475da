"""limits on accounts and keys, the price table, cost on ledger rows

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("accounts") as batch:
        batch.add_column(sa.Column("limits", sa.Text, nullable=True))
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("limits", sa.Text, nullable=True))
    with op.batch_alter_table("ledger_entries") as batch:
        batch.add_column(sa.Column("cost_nanos", sa.BigInteger, nullable=True))
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("input_per_million", sa.Numeric(18, 3), nullable=False),
        sa.Column("output_per_million", sa.Numeric(18, 3), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("model", "effective_from", name="uq_prices_model_effective"),
    )


def downgrade() -> None:
    op.drop_table("prices")
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("cost_nanos")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("limits")
    with op.batch_alter_table("accounts") as batch:
        batch.drop_column("limits")
