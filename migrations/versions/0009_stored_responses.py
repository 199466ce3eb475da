"""stored_responses: responses kept for GET/DELETE /v1/responses/{id}, input_items and previous_response_id

Revision ID: 0009_stored_responses
Revises: 0008_cached_tokens
Create Date: 2026-12-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_stored_responses"
down_revision = "0008_cached_tokens"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(80), primary_key=True),
        sa.Column("account_id", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("previous_response_id", sa.String(80), nullable=True),
        sa.Column("messages", sa.Text(), nullable=False),
        sa.Column("input_items", sa.Text(), nullable=False),
        sa.Column("response", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_stored_responses_account_created", "stored_responses", ["account_id", "created_at"])
    op.create_index("ix_stored_responses_expires_at", "stored_responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_stored_responses_expires_at", table_name="stored_responses")
    op.drop_index("ix_stored_responses_account_created", table_name="stored_responses")
    op.drop_table("stored_responses")
