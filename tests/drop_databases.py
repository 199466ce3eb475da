"""Drops the test session's Postgres databases, in a process of its own after the session
(tests/conftest.py:fresh_pg_database): each DROP DATABASE waits for a checkpoint (~0.3 s here),
which for a session's few dozen databases is time the suite need not wait for.

    python -m tests.drop_databases HOST PORT USER NAME...
"""

from __future__ import annotations

import asyncio
import sys

import asyncpg


async def drop(host: str, port: int, user: str, names: list[str]) -> None:
    conn = await asyncpg.connect(host=host, port=port, user=user, database="postgres")
    try:
        for name in names:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


if __name__ == "__main__":
    host, port, user, *names = sys.argv[1:]
    asyncio.run(drop(host, int(port), user, names))
