"""Alembic environment: one history for Postgres and SQLite, run through the async drivers."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from billing.db import create_engine
from billing.models import SQLModel
from gateway.config import load_settings

config = context.config
target_metadata = SQLModel.metadata


def database_url() -> str:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    return url or load_settings().resolved_database_url


def run_with(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_online() -> None:
    engine = create_engine(database_url())
    try:
        async with engine.connect() as conn:
            await conn.run_sync(run_with)
            await conn.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(run_online())
