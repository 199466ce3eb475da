"""Accounts and API keys. Keys are `sk-` + 32 random bytes (url-safe) and are stored only as
HMAC-SHA256 under the server secret, plus a short visible prefix."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.keys.format import key_problem, looks_like_key  # noqa: F401  (the key rule; authentication imports it from here)
from billing.quota.limits import Limits
from billing.models import Account, ApiKey, utcnow

ACCOUNTS = Account.__table__
KEYS = ApiKey.__table__
ADMIN_ACCOUNT = "admin"
PREFIX_LEN = 11  # "sk-" + 8 characters


class AccountExists(Exception):
    pass


class UnknownAccount(Exception):
    pass


class PastExpiry(ValueError):
    """A key created with an `expires_at` already past: it would never authenticate."""


class KeyStoreUnavailable(Exception):
    """The database could not be asked about a key that is not cached."""


def generate_key() -> str:
    return "sk-" + secrets.token_urlsafe(32)


def hash_key(secret: bytes, key: str) -> str:
    mac = _keyed(secret).copy()  # the key schedule is done once per secret, not per call
    mac.update(key.encode())
    return mac.hexdigest()


@functools.lru_cache(maxsize=4)
def _keyed(secret: bytes) -> "hmac.HMAC":
    return hmac.new(secret, digestmod=hashlib.sha256)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's id and what it may do. Never holds the key itself."""

    key_id: int
    account_id: int
    is_admin: bool
    models: frozenset[str] | None
    expires_at: datetime | None
    revoked: bool
    key_limits: Limits = Limits()
    account_limits: Limits = Limits()
    priority: str | None = None  # the account's scheduling class; None: the top class
    prepaid: bool = False  # the account spends a prepaid balance (billing/credits/balance.py)

    def expired(self, now: datetime | None = None) -> bool:
        if self.expires_at is None:
            return False
        return (now or utcnow()) >= _aware(self.expires_at)

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=timezone.utc)


def _key_view(row: Any) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "api_key",
        "account_id": row.account_id,
        "name": row.name,
        "prefix": row.prefix,
        "is_admin": bool(row.is_admin),
        "models": json.loads(row.models) if row.models else None,
        "expires_at": _aware(row.expires_at).isoformat() if row.expires_at else None,
        "revoked_at": _aware(row.revoked_at).isoformat() if row.revoked_at else None,
        "limits": Limits.from_json(row.limits).view(),
        "created_at": _aware(row.created_at).isoformat(),
    }


def _account_view(row: Any) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "account",
        "name": row.name,
        "limits": Limits.from_json(row.limits).view(),
        "priority": row.priority,
        "billing_mode": row.billing_mode,
        "created_at": _aware(row.created_at).isoformat(),
    }


class KeyStore:
    def __init__(self, engine: AsyncEngine, secret: bytes, *, cache_seconds: float = 1.0, stale_seconds: float = 300.0) -> None:
        self._engine = engine
        self._secret = secret
        self._cache_seconds = cache_seconds
        self._stale_seconds = stale_seconds  # a cached answer outlives a database outage this long
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._refreshing: dict[str, asyncio.Future[Principal | None]] = {}
        self._generation = 0
        # Told, before the new answer is served, when a key's limits (or its account's, or its billing
        # mode) read from the database differ from what this process served before: a change made here
        # or by another process (the CLI, another gateway). Its counters are rebuilt, and requests
        # admitted before it settle there (gateway/wiring.py).
        self.on_limits_changed: Callable[[Principal], Awaitable[None]] | None = None
        # key id -> the limits last served for it, and the number of the read that found them
        self._served: dict[int, tuple[tuple[Limits, Limits, bool], int]] = {}
        self._reads = 0  # reads of limits started (numbers them in the order they began)

    # accounts -------------------------------------------------------------------------------
    async def create_account(self, name: str) -> dict[str, Any]:
        try:
            async with self._engine.begin() as conn:
                result = await conn.execute(
                    ACCOUNTS.insert().values(name=name, created_at=utcnow()).returning(*ACCOUNTS.c)
                )
                return _account_view(result.one())
        except IntegrityError as exc:
            raise AccountExists(name) from exc

    async def get_account(self, *, account_id: int | None = None, name: str | None = None) -> dict[str, Any] | None:
        query = sa.select(ACCOUNTS)
        query = query.where(ACCOUNTS.c.id == account_id) if account_id is not None else query.where(ACCOUNTS.c.name == name)
        async with self._engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return _account_view(row) if row else None

    async def list_accounts(self) -> list[dict[str, Any]]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(sa.select(ACCOUNTS).order_by(ACCOUNTS.c.id))).all()
        return [_account_view(r) for r in rows]

    async def ensure_account(self, name: str) -> dict[str, Any]:
        existing = await self.get_account(name=name)
        if existing:
            return existing
        try:
            return await self.create_account(name)
        except AccountExists:
            found = await self.get_account(name=name)
            assert found is not None
            return found

    # keys -----------------------------------------------------------------------------------
    async def create_key(
        self,
        account_id: int,
        *,
        name: str | None = None,
        models: list[str] | None = None,
        expires_at: datetime | None = None,
        is_admin: bool = False,
        key: str | None = None,
    ) -> dict[str, Any]:
        """Creates a key; the returned dict holds the secret under "key", the only time it is shown."""
        if expires_at is not None and _aware(expires_at) <= utcnow():
            raise PastExpiry("expires_at must be in the future: the key would never authenticate")
        if await self.get_account(account_id=account_id) is None:
            raise UnknownAccount(str(account_id))
        secret_key = key or generate_key()
        async with self._engine.begin() as conn:
            result = await conn.execute(
                KEYS.insert()
                .values(
                    account_id=account_id,
                    name=name,
                    prefix=secret_key[:PREFIX_LEN],
                    key_hash=hash_key(self._secret, secret_key),
                    is_admin=is_admin,
                    models=json.dumps(sorted(set(models))) if models is not None else None,
                    expires_at=expires_at,
                    created_at=utcnow(),
                )
                .returning(*KEYS.c)
            )
            view = _key_view(result.one())
        view["key"] = secret_key
        return view

    async def list_keys(self, account_id: int | None = None) -> list[dict[str, Any]]:
        query = sa.select(KEYS).order_by(KEYS.c.id)
        if account_id is not None:
            query = query.where(KEYS.c.account_id == account_id)
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [_key_view(r) for r in rows]

    async def get_key(self, key_id: int) -> dict[str, Any] | None:
        async with self._engine.connect() as conn:
            row = (await conn.execute(sa.select(KEYS).where(KEYS.c.id == key_id))).first()
        return _key_view(row) if row else None

    async def revoke_key(self, key_id: int) -> dict[str, Any] | None:
        async with self._engine.begin() as conn:
            await conn.execute(
                KEYS.update().where(KEYS.c.id == key_id, KEYS.c.revoked_at.is_(None)).values(revoked_at=utcnow())
            )
        self._invalidate()
        return await self.get_key(key_id)

    async def set_key_models(self, key_id: int, models: list[str] | None) -> None:
        """Sets the models a key may use (None: every model); the next request here sees them."""
        async with self._engine.begin() as conn:
            await conn.execute(KEYS.update().where(KEYS.c.id == key_id).values(models=json.dumps(models) if models is not None else None))
        self._invalidate()

    async def set_key_limits(self, key_id: int, changes: Any) -> dict[str, Any] | None:
        """Applies a PATCH of limits (null removes one); raises InvalidLimits on bad values."""
        current = await self.get_key(key_id)
        if current is None:
            return None
        limits = Limits().patched(current["limits"]).patched(changes)
        async with self._engine.begin() as conn:
            await conn.execute(KEYS.update().where(KEYS.c.id == key_id).values(limits=limits.to_json()))
        self._invalidate()
        return await self.get_key(key_id)

    async def set_account_limits(self, account_id: int, changes: Any) -> dict[str, Any] | None:
        current = await self.get_account(account_id=account_id)
        if current is None:
            return None
        limits = Limits().patched(current["limits"]).patched(changes)
        async with self._engine.begin() as conn:
            await conn.execute(ACCOUNTS.update().where(ACCOUNTS.c.id == account_id).values(limits=limits.to_json()))
        self._invalidate()
        return await self.get_account(account_id=account_id)

    async def set_account_priority(self, account_id: int, priority: str | None) -> dict[str, Any] | None:
        """Sets the account's scheduling class (None: the top class); None when there is no such account."""
        async with self._engine.begin() as conn:
            result = await conn.execute(ACCOUNTS.update().where(ACCOUNTS.c.id == account_id).values(priority=priority))
        self._invalidate()
        return await self.get_account(account_id=account_id) if result.rowcount else None

    async def has_admin_key(self) -> bool:
        async with self._engine.connect() as conn:
            query = sa.select(sa.func.count()).select_from(KEYS).where(KEYS.c.is_admin.is_(True), KEYS.c.revoked_at.is_(None))
            return int((await conn.execute(query)).scalar_one()) > 0

    async def ensure_admin_key(self, key: str | None) -> str | None:
        """Makes sure an admin key exists. Returns a newly created secret (to print once), else None."""
        if key is not None and (problem := key_problem(key)) is not None:
            raise ValueError(f"TOLLGATE_ADMIN_KEY {problem}: authentication would never accept it")
        account = await self.ensure_account(ADMIN_ACCOUNT)
        if key is not None:
            if await self._principal_from_db(hash_key(self._secret, key)) is None:
                await self.create_key(account["id"], name="admin (from TOLLGATE_ADMIN_KEY)", is_admin=True, key=key)
            return None
        if await self.has_admin_key():
            return None
        created = await self.create_key(account["id"], name="admin (bootstrap)", is_admin=True)
        return str(created["key"])

    # authentication -------------------------------------------------------------------------
    async def authenticate(self, key: str) -> Principal | None:
        """The principal for a presented key, cached for a short time (revocation shows within it).

        One database query per key at a time: callers that miss together share it. In the last
        quarter of an entry's life one background query renews it while callers keep the cached
        answer, so a busy key never makes its requests wait for the database; an entry is never
        served past its time, so a revocation made elsewhere still shows within `cache_seconds`."""
        digest = hash_key(self._secret, key)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None:
            age = now - hit[0]
            if age < self._cache_seconds:
                if age > 0.75 * self._cache_seconds:
                    self._refresh(digest, hit)
                return hit[1]
        return await asyncio.shield(self._refresh(digest, hit))

    def _refresh(self, digest: str, hit: tuple[float, Principal | None] | None) -> asyncio.Future[Principal | None]:
        pending = self._refreshing.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(self._lookup(digest, hit))
            self._refreshing[digest] = pending
            pending.add_done_callback(lambda f: self._refreshed(digest, f))
        return pending

    def _refreshed(self, digest: str, future: asyncio.Future[Principal | None]) -> None:
        if self._refreshing.get(digest) is future:
            del self._refreshing[digest]
        if not future.cancelled():
            future.exception()  # a background renewal's failure is not an error: the entry still counts

    async def _lookup(self, digest: str, hit: tuple[float, Principal | None] | None) -> Principal | None:
        generation = self._generation
        read = self._read_started()
        try:
            principal = await self._principal_from_db(digest)
        except Exception as exc:  # the database is unreachable: keys seen recently keep working
            if hit is not None and time.monotonic() - hit[0] < self._stale_seconds:
                return hit[1]
            raise KeyStoreUnavailable(type(exc).__name__) from None
        if principal is not None:
            await self._seen(principal, read)
        if generation == self._generation:  # not read across a revocation or a limit change
            if len(self._cache) > 100_000:
                self._cache.clear()
            self._cache[digest] = (time.monotonic(), principal)
        return principal

    def _read_started(self) -> int:
        self._reads += 1
        return self._reads

    async def _seen(self, principal: Principal, read: int) -> None:
        """Reports limits (or a billing mode) other than those last served for the key (on_limits_changed).
        `read`: the number of the read that found them, in the order reads began; one that began before
        the read whose limits are recorded and disagrees with them has the key read again."""
        if self.on_limits_changed is None:
            return
        limits = (principal.key_limits, principal.account_limits, principal.prepaid)
        before = self._served.get(principal.key_id)
        if before is not None and read < before[1]:
            # Begun before the read recorded: older news (a lookup overlapping a recheck), or a newer
            # answer from a query that waited. Where it disagrees, the database says which, now.
            if before[0] != limits:
                await self.recheck({principal.key_id})
            return
        if before is not None and before[0] != limits:
            await self.on_limits_changed(principal)
        if len(self._served) > 200_000:
            self._served.clear()
        self._served[principal.key_id] = (limits, read)

    async def recheck(self, key_ids: Collection[int]) -> None:
        """Reads these keys' limits now and reports those changed since they were served: a process
        running requests of a key it is asked nothing more of learns of a limit set elsewhere before
        they end (their usage then settles there too: gateway/serving/admission.py, Meter.hold_now)."""
        if self.on_limits_changed is None or not key_ids:
            return
        ids = sorted(key_ids)
        for i in range(0, len(ids), 1000):
            read = self._read_started()
            async with self._engine.connect() as conn:
                rows = (await conn.execute(self._principal_query().where(KEYS.c.id.in_(ids[i:i + 1000])))).all()
            for row in rows:
                await self._seen(_principal_of(row), read)

    def invalidate(self) -> None:
        """An account's billing mode changed elsewhere (billing/credits/balance.py): forget cached principals."""
        self._invalidate()

    def _invalidate(self) -> None:
        """A key or account changed here: forget every cached answer, and any read now in flight."""
        self._generation += 1
        self._cache.clear()

    async def principal_of_key(self, key_id: int) -> Principal | None:
        """The principal of a key by its id, read now (a batch runs on its key long after the call)."""
        read = self._read_started()
        async with self._engine.connect() as conn:
            row = (await conn.execute(self._principal_query().where(KEYS.c.id == key_id))).first()
        if row is None:
            return None
        principal = _principal_of(row)
        await self._seen(principal, read)  # the limits its request runs under: what a recheck compares with
        return principal

    @staticmethod
    def _principal_query() -> Any:
        return (
            sa.select(KEYS, ACCOUNTS.c.limits.label("account_limits"), ACCOUNTS.c.priority.label("account_priority"),
                      ACCOUNTS.c.billing_mode.label("billing_mode"))
            .join(ACCOUNTS, ACCOUNTS.c.id == KEYS.c.account_id)
        )

    async def _principal_from_db(self, digest: str) -> Principal | None:
        query = self._principal_query().where(KEYS.c.key_hash == digest)
        async with self._engine.connect() as conn:
            row = (await conn.execute(query)).first()
        if row is None or not hmac.compare_digest(row.key_hash, digest):
            return None
        return _principal_of(row)


def _principal_of(row: Any) -> Principal:
    return Principal(
        key_id=row.id,
        account_id=row.account_id,
        is_admin=bool(row.is_admin),
        models=frozenset(json.loads(row.models)) if row.models else None,
        expires_at=_aware(row.expires_at) if row.expires_at else None,
        revoked=row.revoked_at is not None,
        key_limits=Limits.from_json(row.limits),
        account_limits=Limits.from_json(row.account_limits),
        priority=row.account_priority,
        prepaid=row.billing_mode == "prepaid",
    )
