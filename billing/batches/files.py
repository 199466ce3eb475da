"""Uploaded and generated files, per account, behind one interface (`FileStore`).

`SqlFileStore` keeps a file's bytes in its row (Postgres bytea, SQLite blob) in the database the
ledger uses: durable with it, on either database, with nothing else to run. Files are bounded by
TOLLGATE_FILES_MAX_BYTES, so a row stays a reasonable size; a directory or object store would
implement the same methods. A file with an expiry (OpenAI's `expires_after`) is gone once it has
passed: no read finds it, and `delete_expired` (the batch runner's rounds) removes it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.batches.models import StoredFile
from billing.batches.store import aware, matchable, past
from billing.models import utcnow

FILES = StoredFile.__table__


@dataclass(frozen=True)
class FileInfo:
    id: str
    account_id: int
    purpose: str
    filename: str
    size_bytes: int
    created_at: datetime
    expires_at: datetime | None = None

    def view(self) -> dict[str, Any]:
        """OpenAI's File object."""
        return {
            "id": self.id, "object": "file", "bytes": self.size_bytes, "created_at": int(self.created_at.timestamp()),
            "expires_at": None if self.expires_at is None else int(self.expires_at.timestamp()),
            "filename": self.filename, "purpose": self.purpose, "status": "processed", "status_details": None,
        }


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileStore(Protocol):
    async def put(self, account_id: int, purpose: str, filename: str, content: bytes, expires_after: int | None = None) -> FileInfo: ...
    async def get(self, account_id: int, file_id: str) -> FileInfo | None: ...
    async def content(self, account_id: int, file_id: str) -> bytes | None: ...
    async def list(self, account_id: int, *, purpose: str | None = None, limit: int = 100, after: str | None = None,
                   ascending: bool = False) -> list[FileInfo]: ...
    async def delete(self, account_id: int, file_id: str) -> bool: ...
    async def delete_expired(self) -> int: ...


def _info(row: Any) -> FileInfo:
    created = aware(row.created_at)
    assert created is not None
    return FileInfo(row.id, row.account_id, row.purpose, row.filename, row.size_bytes, created, aware(row.expires_at))


def _live() -> Any:
    """A file not expired (yet)."""
    return sa.or_(FILES.c.expires_at.is_(None), FILES.c.expires_at > utcnow())


_META = [FILES.c.id, FILES.c.account_id, FILES.c.purpose, FILES.c.filename, FILES.c.size_bytes, FILES.c.created_at, FILES.c.expires_at]


class SqlFileStore:
    """Every read names the account: another account's file is not found."""

    def __init__(self, db: AsyncEngine) -> None:
        self._db = db

    async def put(self, account_id: int, purpose: str, filename: str, content: bytes, expires_after: int | None = None) -> FileInfo:
        """`expires_after`: seconds from now until the file is gone (None: kept until deleted)."""
        now = utcnow()
        expires = None if expires_after is None else now + timedelta(seconds=expires_after)
        info = FileInfo(new_file_id(), account_id, purpose, filename, len(content), now, expires)
        async with self._db.begin() as conn:
            await conn.execute(FILES.insert().values(
                id=info.id, account_id=account_id, purpose=purpose, filename=filename, size_bytes=len(content),
                content=content, created_at=info.created_at, expires_at=expires))
        return info

    async def get(self, account_id: int, file_id: str) -> FileInfo | None:
        if not matchable(file_id):
            return None
        async with self._db.connect() as conn:
            row = (await conn.execute(sa.select(*_META).where(FILES.c.id == file_id, FILES.c.account_id == account_id, _live()))).first()
        return None if row is None else _info(row)

    async def content(self, account_id: int, file_id: str) -> bytes | None:
        if not matchable(file_id):
            return None
        async with self._db.connect() as conn:
            value = (await conn.execute(
                sa.select(FILES.c.content).where(FILES.c.id == file_id, FILES.c.account_id == account_id, _live()))).scalar()
        return None if value is None else bytes(value)

    async def list(self, account_id: int, *, purpose: str | None = None, limit: int = 100, after: str | None = None,
                   ascending: bool = False) -> list[FileInfo]:
        """An account's files by creation, newest first (`ascending`: oldest first), after the file
        `after` names in that order; a cursor naming no file of the account's gives none."""
        if not matchable(purpose, after):
            return []  # as for any purpose or cursor naming no file
        order = (FILES.c.created_at, FILES.c.id)  # ids are random: by creation, the id breaking ties
        query = sa.select(*_META).where(FILES.c.account_id == account_id, _live())
        if purpose:
            query = query.where(FILES.c.purpose == purpose)
        if after:
            query = past(query, FILES, after, FILES.c.account_id == account_id, newer=ascending)
        query = query.order_by(*(order if ascending else [c.desc() for c in order])).limit(limit)
        async with self._db.connect() as conn:
            return [_info(r) for r in (await conn.execute(query)).all()]

    async def delete(self, account_id: int, file_id: str) -> bool:
        if not matchable(file_id):
            return False
        async with self._db.begin() as conn:
            done = await conn.execute(FILES.delete().where(FILES.c.id == file_id, FILES.c.account_id == account_id, _live()))
        return bool(done.rowcount)

    async def delete_expired(self) -> int:
        """Deletes every file whose expiry has passed; how many."""
        async with self._db.begin() as conn:
            done = await conn.execute(FILES.delete().where(FILES.c.expires_at <= utcnow()))
        return int(done.rowcount or 0)
