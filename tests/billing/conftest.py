"""Fixtures the billing tests share: an empty, migrated Postgres database and an engine on it."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from billing import migrate
from billing.db import create_engine


@pytest.fixture
def db_url(fresh_pg_database: Any) -> str:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    return url


@pytest.fixture
async def db(db_url: str) -> AsyncIterator[Any]:
    engine = create_engine(db_url)
    yield engine
    await engine.dispose()
