"""Database engines from plain URLs: `postgresql://...` runs on asyncpg, `sqlite:///...` on aiosqlite."""

from __future__ import annotations

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


def async_url(url: str) -> str:
    """Maps a plain database URL to its async driver."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        parsed = parsed.set(drivername="postgresql+asyncpg")
    elif backend == "sqlite":
        parsed = parsed.set(drivername="sqlite+aiosqlite")
    else:
        raise ValueError(f"unsupported database backend {backend!r}: use postgresql:// or sqlite:///")
    return parsed.render_as_string(hide_password=False)


def create_engine(url: str, *, foreign_keys: bool = True, **kwargs: object) -> AsyncEngine:
    """`foreign_keys` (SQLite): enforced on every connection; off only for the migrations, whose
    table rebuilds (copy, DROP TABLE, rename) the foreign keys of other tables would refuse."""
    aurl = async_url(url)
    # A statement's parameters (a customer's text, an uploaded file's bytes, a key's hash) stay out
    # of the exception text that error logs carry.
    kwargs.setdefault("hide_parameters", True)
    if aurl.startswith("sqlite"):
        engine = create_async_engine(aurl, **kwargs)  # type: ignore[arg-type]

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=5000")
            cur.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
            cur.close()

        return engine
    # Every outbound call has a deadline: connecting, each statement, and waiting for a pooled connection.
    kwargs.setdefault("connect_args", {"timeout": 5.0, "command_timeout": 60.0})
    kwargs.setdefault("pool_timeout", 10.0)
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 10)
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(aurl, **kwargs)  # type: ignore[arg-type]
