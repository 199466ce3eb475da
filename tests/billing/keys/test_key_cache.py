"""Caches on the request path against a real Postgres: KeyStore (one query per key at a time, renewal
ahead of expiry without making callers wait, a revocation shown within `cache_seconds`) and the
PriceBook (one read for all requests that find it stale)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from billing import migrate
from billing.db import create_engine
from billing.keys.store import KeyStore

SECRET = b"key-cache-test-secret"


@pytest.fixture
async def db(fresh_pg_database: Any) -> AsyncIterator[Any]:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    engine = create_engine(url)
    yield engine
    await engine.dispose()


class CountingStore(KeyStore):
    """The real store, counting the database lookups it makes."""

    lookups = 0

    async def _principal_from_db(self, digest: str) -> Any:
        self.lookups += 1
        return await super()._principal_from_db(digest)


async def test_callers_that_miss_together_share_one_query(db: Any) -> None:
    store = CountingStore(db, SECRET, cache_seconds=5.0)
    account = await store.create_account("shared-miss")
    key = (await store.create_key(account["id"]))["key"]
    principals = await asyncio.gather(*(store.authenticate(key) for _ in range(64)))
    assert store.lookups == 1
    assert {p.account_id for p in principals} == {account["id"]}
    assert await store.authenticate("sk-not-a-key-at-all") is None and store.lookups == 2


async def test_a_busy_key_is_renewed_ahead_without_waiting(db: Any) -> None:
    store = CountingStore(db, SECRET, cache_seconds=0.4)
    account = await store.create_account("renewed")
    key = (await store.create_key(account["id"]))["key"]
    await store.authenticate(key)
    assert store.lookups == 1
    await asyncio.sleep(0.32)  # in the last quarter of the entry's life
    principal = await store.authenticate(key)  # answered from the cache at once; a renewal is scheduled
    assert principal is not None and store.lookups == 1
    await asyncio.sleep(0.05)
    assert store.lookups == 2
    # The renewal landed: well past the first entry's expiry, still no new lookup.
    await asyncio.sleep(0.2)
    assert await store.authenticate(key) is not None and store.lookups == 2


async def test_a_revocation_elsewhere_shows_within_cache_seconds(db: Any) -> None:
    ttl = 0.5
    gateway = KeyStore(db, SECRET, cache_seconds=ttl)  # the serving process
    admin = KeyStore(db, SECRET, cache_seconds=ttl)  # another process revokes
    account = await admin.create_account("revoked-elsewhere")
    created = await admin.create_key(account["id"])
    assert not (await gateway.authenticate(created["key"])).revoked
    await admin.revoke_key(created["id"])
    revoked_at = time.monotonic()
    while not (await gateway.authenticate(created["key"])).revoked:  # busy: renewals ahead of expiry
        assert time.monotonic() - revoked_at <= ttl + 0.1
        await asyncio.sleep(0.01)


async def test_a_change_here_is_not_overwritten_by_a_read_in_flight(db: Any) -> None:
    store = KeyStore(db, SECRET, cache_seconds=30.0)
    account = await store.create_account("in-flight")
    created = await store.create_key(account["id"])
    lookup = asyncio.ensure_future(store.authenticate(created["key"]))  # reads the key as it is now
    await asyncio.sleep(0)
    await store.revoke_key(created["id"])  # clears the cache while that read may be in flight
    await lookup
    assert (await store.authenticate(created["key"])).revoked


async def test_requests_that_find_the_price_book_stale_share_one_read(db: Any) -> None:
    from billing.prices.book import PriceBook

    class CountingBook(PriceBook):
        reads = 0

        async def _load(self, force: bool) -> None:
            self.reads += 1
            await super()._load(force)

    book = CountingBook(db, refresh_seconds=0.2)
    await book.add("m", "1.000", "2.000")
    before = book.reads
    prices = await asyncio.gather(*(book.current_for(1, "m") for _ in range(64)))
    assert book.reads - before <= 1 and {str(p.input_per_million) for p in prices} == {"1.000"}
    await asyncio.sleep(0.25)  # stale again: 64 callers, one read
    await asyncio.gather(*(book.current_for(1, "m") for _ in range(64)))
    assert book.reads - before <= 2


async def test_a_price_read_per_request_changes_at_the_instant_a_scheduled_version_takes_effect(db: Any) -> None:
    """`current_for` keeps one EffectivePrice per (account, model) between reloads, but never past
    the next instant a base price, the account's override or its "*" multiplier takes effect."""
    from datetime import timedelta

    from billing.keys.store import KeyStore
    from billing.models import utcnow
    from billing.prices.book import PriceBook

    store = KeyStore(db, SECRET)
    account = (await store.create_account("scheduled-prices"))["id"]
    other = (await store.create_account("scheduled-prices-other"))["id"]
    book = PriceBook(db, refresh_seconds=3600.0)  # no reload during the test: only the schedule moves prices
    await book.add("m", "1.000", "2.000")
    base_at = utcnow() + timedelta(seconds=0.6)
    await book.add("m", "3.000", "4.000", effective_from=base_at)
    multiplier_at = utcnow() + timedelta(seconds=1.2)
    await book.add_override(account, "*", multiplier="0.5", effective_from=multiplier_at)

    first = await book.current_for(account, "m")
    assert (str(first.input_per_million), str(first.output_per_million)) == ("1.000", "2.000")
    assert await book.current_for(account, "m") is first  # kept between requests
    assert first.cost_nanos(1000, 1000) == 3_000_000  # 0.003 USD in nano-units

    while utcnow() < base_at:
        await asyncio.sleep(0.02)
    second = await book.current_for(account, "m")
    assert (str(second.input_per_million), str(second.output_per_million)) == ("3.000", "4.000")
    assert str((await book.current_for(other, "m")).input_per_million) == "3.000"

    while utcnow() < multiplier_at:
        await asyncio.sleep(0.02)
    third = await book.current_for(account, "m")
    assert third.cost_nanos(1000, 1000) == 3_500_000  # (3.000 + 4.000) per million x 0.5
    assert str((await book.current_for(other, "m")).input_per_million) == "3.000"  # only the account's multiplier


async def test_a_stale_price_book_prices_with_what_it_has_while_it_rereads(db: Any) -> None:
    """A burst that finds the book stale is priced at once with the book in hand; the re-read runs
    beside it (issue 26: awaiting it held every request of a burst behind one database round trip).
    A book that never loaded still waits for its first read."""
    from billing.prices.book import PriceBook

    gate = asyncio.Event()

    class HeldBook(PriceBook):
        hold = False

        async def _load(self, force: bool) -> None:
            if self.hold and not force:
                await gate.wait()
            await super()._load(force)

    book = HeldBook(db, refresh_seconds=3600.0)
    assert await book.current_for(1, "m") is None  # the first read is awaited: nothing priced "m" yet
    await book.add("m", "1.000", "2.000")
    assert str((await book.current_for(1, "m")).input_per_million) == "1.000"
    await PriceBook(db).add("m", "3.000", "4.000")  # another process changes the price
    book.hold = True
    book._loaded_at -= 7200.0  # stale (as an hour without a read would leave it)
    prices = await asyncio.wait_for(asyncio.gather(*(book.current_for(1, "m") for _ in range(64))), 5.0)
    assert {str(p.input_per_million) for p in prices} == {"1.000"}  # answered with the book in hand, the read still held
    assert book._loading is not None and not book._loading.done()
    gate.set()
    await asyncio.wait_for(book._loading, 5.0)
    assert str((await book.current_for(1, "m")).input_per_million) == "3.000"


async def test_a_change_of_a_keys_models_is_seen_by_the_next_request(db: Any) -> None:
    store = KeyStore(db, SECRET, cache_seconds=30.0)
    account = await store.create_account("models-change")
    created = await store.create_key(account["id"])
    assert (await store.authenticate(created["key"])).models is None  # cached: every model
    await store.set_key_models(created["id"], ["small"])  # the dashboard's form
    assert (await store.authenticate(created["key"])).models == frozenset({"small"})
    await store.set_key_models(created["id"], None)
    assert (await store.authenticate(created["key"])).models is None


async def test_a_limit_set_elsewhere_on_a_key_only_batch_lines_used_is_reported_by_the_recheck(db: Any) -> None:
    """A key whose requests are a batch's lines (read by id, principal_of_key, never authenticated
    here): the limits served to its lines are what the recheck compares with, so a limit set by
    another process while they run is reported (the review found its first read only set the
    baseline, and the change went unseen)."""
    gateway = KeyStore(db, SECRET)
    admin = KeyStore(db, SECRET)
    seen: list[Any] = []

    async def changed(principal: Any) -> None:
        seen.append(principal.account_limits)

    gateway.on_limits_changed = changed
    account = await admin.create_account("batch-only")
    created = await admin.create_key(account["id"])
    assert (await gateway.principal_of_key(created["id"])) is not None  # a line admitted, unlimited
    await admin.set_account_limits(account["id"], {"monthly_tokens": 1000})
    await gateway.recheck({created["id"]})
    assert [limits.monthly_tokens for limits in seen] == [1000]


class HeldStore(KeyStore):
    """The real store, reporting limit changes into `seen`, whose key lookups stop once before or
    after their query (`after_query`) until `release` is set; `stopped` says they have."""

    def __init__(self, db: Any, *, after_query: bool) -> None:
        super().__init__(db, SECRET, cache_seconds=0.0)
        self.after_query = after_query
        self.stopped, self.release = asyncio.Event(), asyncio.Event()
        self.seen: list[Any] = []  # the account's monthly_tokens of each change reported
        self.on_limits_changed = self._changed

    async def _changed(self, principal: Any) -> None:
        self.seen.append(principal.account_limits.monthly_tokens)

    async def _principal_from_db(self, digest: str) -> Any:
        if not self.after_query:
            await self._stop()
        found = await super()._principal_from_db(digest)
        if self.after_query:
            await self._stop()
        return found

    async def _stop(self) -> None:
        self.stopped.set()
        await self.release.wait()


async def _served_unlimited(db: Any, gateway: KeyStore) -> tuple[KeyStore, dict[str, Any], dict[str, Any]]:
    """(another process's store, an account without limits, its key), the key read by `gateway`."""
    admin = KeyStore(db, SECRET)
    account = await admin.create_account(f"held-{id(gateway)}")
    created = await admin.create_key(account["id"])
    assert (await gateway.principal_of_key(created["id"])) is not None  # served unlimited
    return admin, account, created


async def test_a_key_read_that_began_before_a_recheck_does_not_bring_the_old_limits_back(db: Any) -> None:
    """A key lookup reads the limits, a limit is set elsewhere, the recheck reads and reports it, then
    the lookup's answer (the old limits) lands: older news, not a change back (review: it reported
    the old limits as a change and the running requests briefly settled under them)."""
    gateway = HeldStore(db, after_query=True)
    admin, account, created = await _served_unlimited(db, gateway)
    lookup = asyncio.ensure_future(gateway.authenticate(created["key"]))
    await gateway.stopped.wait()  # it has read: no limit
    await admin.set_account_limits(account["id"], {"monthly_tokens": 1000})
    await gateway.recheck({created["id"]})
    gateway.release.set()
    await lookup
    assert gateway.seen == [1000]


async def test_a_key_read_that_waited_and_saw_a_new_limit_reports_it(db: Any) -> None:
    """A key lookup begins, waits before its query (a pool connection), a recheck reads the limits as
    they are, a limit is set elsewhere, then the lookup's query sees it: the only read that saw the
    change began first, so it is not taken as older news and dropped (a review's repro: the new limit
    served but never reported); the key is read again, and the change reported."""
    gateway = HeldStore(db, after_query=False)
    admin, account, created = await _served_unlimited(db, gateway)
    lookup = asyncio.ensure_future(gateway.authenticate(created["key"]))
    await gateway.stopped.wait()
    await gateway.recheck({created["id"]})  # nothing changed yet
    await admin.set_account_limits(account["id"], {"monthly_tokens": 1000})
    gateway.release.set()
    assert (await lookup).account_limits.monthly_tokens == 1000
    assert gateway.seen == [1000]
