"""stored_files.expires_at and batches.output_expires_seconds: files that expire

A file uploaded with OpenAI's `expires_after` (or a batch's output and error files, with the
batch's `output_expires_after`) is gone once its time has passed: not listed, not readable, and
deleted by the batch runner's next round. Files before this keep no expiry.

Revision ID: 0020_file_expiry
Revises: 0019_recharge_claim_amount
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0020_file_expiry"
down_revision = "0019_recharge_claim_amount"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("stored_files") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_stored_files_expires", "stored_files", ["expires_at"])
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("output_expires_seconds", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("output_expires_seconds")
    op.drop_index("ix_stored_files_expires", table_name="stored_files")
    with op.batch_alter_table("stored_files") as batch:
        batch.drop_column("expires_at")
