"""The Batch API's tables: uploaded files, batches, and one row per line of a batch.

    stored_files  a file's bytes per account (purpose `batch` for input, `batch_output` for what a
                  batch writes); the content sits in the row (bytea / blob), bounded by
                  TOLLGATE_FILES_MAX_BYTES
    batches       one batch: its endpoint, window, status and the instants it reached each one
    batch_lines   one line of a batch: its request body, its state (pending -> claimed -> done)
                  and, once done, what it answered. A line is claimed (durably) before it runs and
                  its ledger row's request_id is `<batch id>-<line index>`, so a restart never runs
                  nor bills a line twice (gateway/batches/runner.py); one runner at a time holds a
                  batch (`runner_id`, `lease_until`)
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Field, SQLModel


class StoredFile(SQLModel, table=True):
    __tablename__ = "stored_files"
    __table_args__ = (sa.Index("ix_stored_files_account_created", "account_id", "created_at"),
                      sa.Index("ix_stored_files_expires", "expires_at"))

    id: str = Field(sa_column=sa.Column(sa.String(40), primary_key=True))
    account_id: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    purpose: str = Field(sa_column=sa.Column(sa.String(32), nullable=False))
    filename: str = Field(sa_column=sa.Column(sa.String(255), nullable=False))
    size_bytes: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    content: bytes = Field(sa_column=sa.Column(sa.LargeBinary, nullable=False))
    created_at: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))
    expires_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))  # None: kept until deleted


class Batch(SQLModel, table=True):
    __tablename__ = "batches"
    __table_args__ = (
        sa.Index("ix_batches_account_created", "account_id", "created_at"),
        sa.Index("ix_batches_status", "status"),
    )

    id: str = Field(sa_column=sa.Column(sa.String(40), primary_key=True))
    account_id: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    key_id: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    api: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))  # openai | anthropic: the shapes it is shown in
    endpoint: str = Field(sa_column=sa.Column(sa.String(64), nullable=False))
    input_file_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(40), nullable=True))
    completion_window: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))
    status: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))
    metadata_json: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    errors_json: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    total: int = Field(default=0, sa_column=sa.Column(sa.Integer, nullable=False, server_default="0"))
    output_file_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(40), nullable=True))
    error_file_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(40), nullable=True))
    model: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))  # an OpenAI batch's lines name one
    # OpenAI's output_expires_after: its output and error files expire this long after they are made
    output_expires_seconds: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))
    created_at: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))
    expires_at: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))
    in_progress_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
    finalizing_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
    completed_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
    failed_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
    expired_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
    cancelling_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
    cancelled_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
    # The runner that drives it (one at a time, across processes) and until when its lease holds.
    runner_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(40), nullable=True))
    lease_until: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))


class BatchLine(SQLModel, table=True):
    __tablename__ = "batch_lines"
    __table_args__ = (
        sa.Index("ix_batch_lines_state", "batch_id", "state"),
        # The lines a runner marked admitted, by runner: a restart's sweep (migration 0023)
        sa.Index("ix_batch_lines_admitted_by", "claimed_by", postgresql_where=sa.text("admitted_at IS NOT NULL"),
                 sqlite_where=sa.text("admitted_at IS NOT NULL")),
    )

    batch_id: str = Field(sa_column=sa.Column(sa.String(40), primary_key=True))
    line: int = Field(sa_column=sa.Column(sa.Integer, primary_key=True, autoincrement=False))
    custom_id: str = Field(sa_column=sa.Column(sa.String(255), nullable=False))
    body: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    state: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))  # pending | claimed | done
    outcome: str | None = Field(default=None, sa_column=sa.Column(sa.String(16), nullable=True))  # succeeded | errored | expired | canceled
    status_code: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))
    result: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))  # the response body, JSON
    claimed_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
    done_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
    # The runner that claimed it, and when that runner admitted it (before its row was journaled): a
    # line admitted is never put back to pending, whichever runner or instance judges it later.
    claimed_by: str | None = Field(default=None, sa_column=sa.Column(sa.String(40), nullable=True))
    admitted_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))
