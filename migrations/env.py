"""Alembic environment: one history for Postgres and SQLite, run through the async drivers."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.db import create_engine
from billing.models import SQLModel

config = context.config
MIGRATION_LOCK = 0x746F6C6C67617465  # 'tollgate': one lock key per database for the migrations
target_metadata = SQLModel.metadata


def database_url() -> str:
    """The database to migrate, as given: by `tollgate migrate` / `tollgate serve` (billing.migrate
    passes the settings' URL), by `-x database_url=...`, or by `sqlalchemy.url` in the ini. The
    gateway's settings are not imported here (they read the environment in one place)."""
    url = (config.attributes.get("database_url") or context.get_x_argument(as_dictionary=True).get("database_url")
           or config.get_main_option("sqlalchemy.url"))
    if not url:
        raise SystemExit("no database to migrate: run `tollgate migrate` (it reads DATABASE_URL), or alembic with -x database_url=...")
    return url


def run_with(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
        transactional_ddl=True,  # SQLite too (Alembic's default there is a commit per revision): see transactional_ddl()
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Replicas started together each migrate before they serve: they take turns, and the
            # later ones read the version the first wrote (Alembic reads it after this, in the same
            # transaction) and have nothing left to do. The lock goes with the transaction.
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
        context.run_migrations()
        if connection.dialect.name == "sqlite":
            # Foreign keys are not enforced while migrating (run_online): a batch rebuild of a table
            # others point to (accounts, invoices) is a DROP TABLE they would refuse. What the
            # migrations leave must still hold them.
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if broken:
                raise RuntimeError(f"the migration leaves rows whose foreign keys point nowhere: {broken[:5]}")


def transactional_ddl(engine: AsyncEngine) -> None:
    """SQLite: the driver (Python's sqlite3 under aiosqlite) opens a transaction before INSERT,
    UPDATE and DELETE only, so each ALTER, CREATE and DROP of a migration committed on its own and a
    migration that failed half way (or the foreign key check below) left the database between
    revisions. With the driver's own transaction handling off and BEGIN sent when SQLAlchemy begins
    one (SQLAlchemy's documented recipe for pysqlite and aiosqlite), the whole upgrade is one
    transaction, rolled back on failure as on Postgres. BEGIN IMMEDIATE takes the write lock before
    the version is read, and processes migrating one file at once wait for it up to a minute: they
    take turns as on Postgres (the advisory lock in run_with), the later ones finding nothing left."""
    @event.listens_for(engine.sync_engine, "connect")
    def _driver_autocommit(dbapi_conn, _record):  # type: ignore[no-untyped-def]
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(conn):  # type: ignore[no-untyped-def]
        conn.exec_driver_sql("BEGIN IMMEDIATE")


async def run_online() -> None:
    engine = create_engine(database_url(), foreign_keys=False)  # SQLite: see run_with
    if engine.dialect.name == "sqlite":
        transactional_ddl(engine)
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
