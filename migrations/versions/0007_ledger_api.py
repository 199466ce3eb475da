"""ledger_entries.api: the API a request came through (chat, completions, embeddings, messages)

NULL on rows written before this revision: which surface served them was not recorded.

Revision ID: 0007_api
Revises: 0006
Create Date: 2026-12-20
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_api"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        batch.add_column(sa.Column("api", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_column("api")
