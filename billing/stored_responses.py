"""Stored Responses (`POST /v1/responses` with `store`, the default): one row per response, per account.

    messages     the conversation the response answered, as chat messages, without its
                 instructions (earlier turns from previous_response_id, then this turn's input):
                 what a continuation starts from
    input_items  this turn's input as OpenAI input items (GET /v1/responses/{id}/input_items)
    response     the Response object as the client received it (GET /v1/responses/{id})
    expires_at   the retention (TOLLGATE_RESPONSES_RETENTION_DAYS); NULL keeps it until deleted
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Field, SQLModel


class StoredResponse(SQLModel, table=True):
    __tablename__ = "stored_responses"
    __table_args__ = (sa.Index("ix_stored_responses_account_created", "account_id", "created_at"),)

    id: str = Field(sa_column=sa.Column(sa.String(80), primary_key=True))
    account_id: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    key_id: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    model: str = Field(sa_column=sa.Column(sa.String(128), nullable=False))
    status: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))
    previous_response_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(80), nullable=True))
    messages: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    input_items: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    response: str = Field(sa_column=sa.Column(sa.Text, nullable=False))
    created_at: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))
    expires_at: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True, index=True))
