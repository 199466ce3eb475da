"""Statements on the test Postgres' `postgres` database (tests/conftest.py:_admin_sql), and the
session's databases dropped in a process of their own after the session
(tests/conftest.py:fresh_pg_database): each DROP DATABASE waits for a checkpoint (~0.3 s here),
time the suite need not wait for. scripts/test.sh waits for these processes before the tests that
run alone on the machine.

    python -m tests.drop_databases HOST PORT USER NAME...
"""

from __future__ import annotations

import asyncio
import sys

import asyncpg


async def admin_sql(host: str, port: int, user: str, statements: list[str]) -> None:
    conn = await asyncpg.connect(host=host, port=port, user=user, database="postgres")
    try:
        for sql in statements:
            await conn.execute(sql)
    finally:
        await conn.close()


if __name__ == "__main__":
    host, port, user, *names = sys.argv[1:]
    asyncio.run(admin_sql(host, int(port), user, [f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)' for name in names]))
