"""Browser sessions for the dashboards: log in with an API key, then a cookie.

The cookie holds a random token (HttpOnly, SameSite=Strict, Secure over https); the database
holds only its SHA-256, the key id it was made with and a CSRF token for the session's forms.
Every use re-reads the key, so revoking or expiring a key ends its sessions too. Logout deletes
the row: a copied cookie is worthless afterwards.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.requests import Request
from starlette.responses import Response

from billing.keys.store import KeyStore, Principal, looks_like_key
from billing.ledger.aggregate_models import DashboardSession
from gateway.http.requests import public_origin

SESSIONS = DashboardSession.__table__
SESSION_COOKIE = "tollgate_session"
LOGIN_CSRF_COOKIE = "tollgate_login_csrf"
SESSION_TTL = timedelta(hours=12)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class Session:
    principal: Principal
    csrf_token: str
    token_hash: str
    expires_at: datetime

    def csrf_ok(self, presented: str | None) -> bool:
        return bool(presented) and hmac.compare_digest(self.csrf_token, presented or "")


def principal_from_view(view: dict[str, Any]) -> Principal:
    """A Principal from KeyStore's public key view (no secrets in either)."""
    expires = datetime.fromisoformat(view["expires_at"]) if view.get("expires_at") else None
    models = view.get("models")
    return Principal(
        key_id=view["id"],
        account_id=view["account_id"],
        is_admin=bool(view["is_admin"]),
        models=frozenset(models) if models is not None else None,
        expires_at=expires,
        revoked=view.get("revoked_at") is not None,
    )


class SessionStore:
    def __init__(self, db: AsyncEngine, keys: KeyStore, *, ttl: timedelta = SESSION_TTL) -> None:
        self._db = db
        self._keys = keys
        self._ttl = ttl

    async def login(self, key: str) -> tuple[str, Session] | None:
        """A new session for a valid, live key; None for anything else (one answer for all)."""
        principal = await self._keys.authenticate(key) if looks_like_key(key) else None
        if principal is None or principal.revoked or principal.expired():
            return None
        token = secrets.token_urlsafe(32)
        now = datetime.now(timezone.utc)
        session = Session(principal, secrets.token_urlsafe(32), _hash(token), now + self._ttl)
        async with self._db.begin() as conn:
            await conn.execute(SESSIONS.delete().where(SESSIONS.c.expires_at < now))
            await conn.execute(
                SESSIONS.insert().values(
                    token_hash=session.token_hash, key_id=principal.key_id, csrf_token=session.csrf_token,
                    created_at=now, expires_at=session.expires_at,
                )
            )
        return token, session

    async def get(self, token: str | None) -> Session | None:
        if not token or len(token) > 200:
            return None
        async with self._db.connect() as conn:
            row = (await conn.execute(sa.select(SESSIONS).where(SESSIONS.c.token_hash == _hash(token)))).first()
        if row is None or _aware(row.expires_at) <= datetime.now(timezone.utc):
            return None
        view = await self._keys.get_key(row.key_id)
        if view is None:
            return None
        principal = principal_from_view(view)
        if principal.revoked or principal.expired():
            return None
        return Session(principal, row.csrf_token, row.token_hash, _aware(row.expires_at))

    async def logout(self, token: str | None) -> None:
        if token:
            async with self._db.begin() as conn:
                await conn.execute(SESSIONS.delete().where(SESSIONS.c.token_hash == _hash(token)))


async def current_session(request: Request) -> Session | None:
    store: SessionStore = request.app.state.sessions
    return await store.get(read_cookie(request, SESSION_COOKIE))


def _secure(request: Request) -> bool:
    return public_origin(request).startswith("https://")


def cookie_name(request: Request, name: str) -> str:
    """A cookie's name as set and read: `__Host-` first where the dashboard is on https, so a browser
    takes it only from this host (Secure, Path=/, no Domain): a sibling subdomain cannot plant its own
    session in a visitor's browser (cookie tossing) and have them act in its account."""
    return "__Host-" + name if _secure(request) else name


def read_cookie(request: Request, name: str) -> str | None:
    """The cookie's value when the request carries it once. Twice (one set for a parent domain, or
    over plain http, beside ours) is none: which one a parser keeps is not ours to pick."""
    wanted = cookie_name(request, name)
    values = [value for part in request.headers.get("cookie", "").split(";")
              for key, sep, value in [part.strip().partition("=")] if sep and key == wanted]
    return values[0] if len(values) == 1 and values[0] else None


def set_cookie(response: Response, request: Request, name: str, value: str, max_age: int | None) -> None:
    response.set_cookie(cookie_name(request, name), value, max_age=max_age, path="/", httponly=True, samesite="strict", secure=_secure(request))


def clear_cookie(response: Response, request: Request, name: str) -> None:
    response.delete_cookie(cookie_name(request, name), path="/", httponly=True, samesite="strict", secure=_secure(request))


def same_origin(request: Request) -> bool:
    """A browser's Origin (when sent) must be this server: a second line behind the CSRF token."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    return origin in (public_origin(request), f"{request.url.scheme}://{request.url.netloc}")
