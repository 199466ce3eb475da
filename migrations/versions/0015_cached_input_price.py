"""cached_input_price: prices.cached_input_per_million

USD per million prompt tokens that the engine served from its prefix cache (the ledger's
cached_tokens). NULL (every existing version) bills cached tokens at the input price, as before.

Revision ID: 0015_cached_input_price
Revises: 0014_spend_alerts
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0015_cached_input_price"
down_revision = "0014_spend_alerts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("prices") as batch:
        batch.add_column(sa.Column("cached_input_per_million", sa.Numeric(18, 3), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("prices") as batch:
        batch.drop_column("cached_input_per_million")
