"""Shared setup for the invoice and Stripe tests: a migrated Postgres database, price history,
ledger rows written by the real ledger writer, and a gateway app (no model needed) on a port."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx

from billing.db import create_engine
from billing.keys.store import KeyStore
from billing.ledger.writer import UsageRecord, write_records
from billing.prices.book import PriceBook
from gateway.app import create_app
from gateway.config import HttpSettings, Settings
from tests.conftest import SECRET, ServerThread, bootstrap


def at(month: int, day: int, hour: int = 12, minute: int = 0, second: int = 0, micro: int = 0, year: int = 2026) -> datetime:
    return datetime(year, month, day, hour, minute, second, micro, tzinfo=timezone.utc)


async def usage(db: Any, account_id: int, model: str, prompt: int, completion: int, when: datetime, status: str = "completed") -> None:
    # cost_nanos is deliberately nonsense: invoices must price tokens themselves. `when` is the
    # admission instant (what prices a row and names its month); it finished 1 ms later.
    await write_records(db, [UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account_id, key_id=1, model=model, prompt_tokens=prompt,
        completion_tokens=completion, status=status, finish_reason="stop", total_ms=1.0, cost_nanos=7,
        created_at=when + timedelta(milliseconds=1), admitted_at=when,
    )])


async def price_history(book: PriceBook) -> None:
    """alpha: 0.150/0.600 from Aug 1, 0.200/0.800 from Sep 16 00:00; beta: 1.000/2.000 from Aug 1."""
    await book.add("alpha", "0.150", "0.600", at(8, 1, 0), backdate=True)
    await book.add("alpha", "0.200", "0.800", at(9, 16, 0), backdate=True)
    await book.add("beta", "1.000", "2.000", at(8, 1, 0), backdate=True)


async def new_account(db: Any, name: str | None = None) -> int:
    created = await KeyStore(db, SECRET.encode()).create_account(name or f"acct-{uuid.uuid4().hex[:8]}")
    return int(created["id"])


async def new_key(db: Any, account_id: int) -> str:
    created = await KeyStore(db, SECRET.encode()).create_key(account_id)
    return str(created["key"])


class App:
    """The real gateway app (lifespan, routes, billing) served on an ephemeral port, no engines."""

    def __init__(self, db_url: str, admin_key: str, base_url: str, app: Any) -> None:
        self.db_url = db_url
        self.admin_key = admin_key
        self.base_url = base_url
        self.app = app

    def admin(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=60)

    def as_key(self, key: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    @property
    def billing(self) -> Any:
        return self.app.state.billing


@contextmanager
def serve(db_url: str, tmp: Path, engines: dict[str, Any] | None = None, public_url: str | None = None, **billing: str) -> Iterator[App]:
    """`billing`: TOLLGATE_BILLING_* / TOLLGATE_STRIPE_* settings (the scheduler is off unless given);
    `public_url`: TOLLGATE_PUBLIC_URL."""
    admin_key = bootstrap(db_url, SECRET)
    extra = {"TOLLGATE_BILLING_AUTO_CLOSE": "0", "TOLLGATE_BILLING_STATE_REFRESH_SECONDS": "0.1", **billing}
    settings = Settings(database_url=db_url, server_secret=SECRET, data_dir=tmp, extra=extra, http=HttpSettings(public_url=public_url))
    app = create_app(settings, engines=engines or {})
    server = ServerThread(app).__enter__()
    try:
        yield App(db_url, admin_key, f"http://127.0.0.1:{server.port}", app)
    finally:
        server.__exit__()


def engine_for(url: str) -> Any:
    return create_engine(url)
