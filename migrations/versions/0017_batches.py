"""batches: the Batch API's files, batches and lines; the batch price; the ledger's batch id

- stored_files: uploaded JSONL (purpose batch) and what batches write (batch_output), per account.
- batches, batch_lines: a batch and one row per line (its state, then its answer).
- prices.batch_input_per_million / batch_output_per_million: what a batch line pays; NULL (every
  existing version) keeps the normal price.
- invoice_lines.direction: 16 characters (batch_input, batch_output lines).
- ledger_entries.batch_id: the batch a row's request was a line of (api = batch); NULL otherwise.

Revision ID: 0017_batches
Revises: 0016_prepaid_close
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0017_batches"
down_revision = "0016_prepaid_close"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = True) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    with op.batch_alter_table("prices") as batch:
        batch.add_column(sa.Column("batch_input_per_million", sa.Numeric(18, 3), nullable=True))
        batch.add_column(sa.Column("batch_output_per_million", sa.Numeric(18, 3), nullable=True))
    with op.batch_alter_table("invoice_lines") as batch:  # batch_input / batch_output lines
        batch.alter_column("direction", type_=sa.String(16), existing_type=sa.String(8), existing_nullable=False)
    # A plain ADD COLUMN: on Postgres the partitioned parent passes it to every partition.
    op.add_column("ledger_entries", sa.Column("batch_id", sa.String(40), nullable=True))
    op.create_table(
        "stored_files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("account_id", sa.Integer, nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("size_bytes", sa.Integer, nullable=False),
        sa.Column("content", sa.LargeBinary, nullable=False),
        _ts("created_at", nullable=False),
    )
    op.create_index("ix_stored_files_account_created", "stored_files", ["account_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("account_id", sa.Integer, nullable=False),
        sa.Column("key_id", sa.Integer, nullable=False),
        sa.Column("api", sa.String(16), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(40), nullable=True),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metadata_json", sa.Text, nullable=True),
        sa.Column("errors_json", sa.Text, nullable=True),
        sa.Column("total", sa.Integer, nullable=False, server_default="0"),
        sa.Column("output_file_id", sa.String(40), nullable=True),
        sa.Column("error_file_id", sa.String(40), nullable=True),
        _ts("created_at", nullable=False),
        _ts("expires_at", nullable=False),
        _ts("in_progress_at"),
        _ts("finalizing_at"),
        _ts("completed_at"),
        _ts("failed_at"),
        _ts("expired_at"),
        _ts("cancelling_at"),
        _ts("cancelled_at"),
        sa.Column("runner_id", sa.String(40), nullable=True),
        _ts("lease_until"),
    )
    op.create_index("ix_batches_account_created", "batches", ["account_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(40), primary_key=True),
        sa.Column("line", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("custom_id", sa.String(255), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=True),
        sa.Column("status_code", sa.Integer, nullable=True),
        sa.Column("result", sa.Text, nullable=True),
        _ts("claimed_at"),
        _ts("done_at"),
    )
    op.create_index("ix_batch_lines_state", "batch_lines", ["batch_id", "state"])


def downgrade() -> None:
    op.drop_index("ix_batch_lines_state", table_name="batch_lines")
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_account_created", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_stored_files_account_created", table_name="stored_files")
    op.drop_table("stored_files")
    op.drop_column("ledger_entries", "batch_id")
    with op.batch_alter_table("invoice_lines") as batch:
        batch.alter_column("direction", type_=sa.String(8), existing_type=sa.String(16), existing_nullable=False)
    with op.batch_alter_table("prices") as batch:
        batch.drop_column("batch_output_per_million")
        batch.drop_column("batch_input_per_million")
