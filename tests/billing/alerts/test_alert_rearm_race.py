"""A balance rule re-arms once per rise, across processes, and never goes back: a process whose check
read the rule before another process re-armed it twice (a rise, a crossing, a rise again) must not
write its stale count back, or the next fall below would be a crossing already recorded and no alert
would be sent for it (docs/prepaid.md, Spend alerts)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import sqlalchemy as sa

from billing.alerts.spend import AlertService
from billing.credits.balance import CreditBook
from billing.db import create_engine
from billing.keys.store import KeyStore
from tests.billing.alerts.test_alerts import CENT, Receiver, db_url, spend  # noqa: F401  (db_url: the fixture)
from tests.conftest import SECRET


class PausedBook:
    """A CreditBook whose next balance read first lets `during` run: another process's work that
    happens while this process's check is between reading its rules and reading the balance."""

    def __init__(self, book: CreditBook) -> None:
        self._book = book
        self.during: Callable[[], Awaitable[None]] | None = None

    async def balance(self, account_id: int) -> Any:
        during, self.during = self.during, None
        if during is not None:
            await during()
        return await self._book.balance(account_id)


async def test_a_stale_check_does_not_take_the_rearm_count_back(db_url: str) -> None:  # noqa: F811
    db, other_db = create_engine(db_url), create_engine(db_url)
    book = CreditBook(db)
    paused = PausedBook(CreditBook(other_db))
    service = AlertService(db, book, backoff=0.01)
    slow = AlertService(other_db, paused, backoff=0.01)  # type: ignore[arg-type]  (another gateway process)

    async def rearmed() -> int:
        async with db.connect() as conn:
            return int((await conn.execute(sa.text("SELECT rearmed FROM alert_rules"))).scalar_one())

    try:
        keys = KeyStore(db, SECRET.encode())
        account = (await keys.create_account("race-" + uuid.uuid4().hex[:6]))["id"]
        key = (await keys.create_key(account))["id"]
        await book.set_mode(account, "prepaid")
        await book.add(account, "topup", 10 * CENT)
        with Receiver() as receiver:
            await service.add_rule(account, "balance_below", threshold=5 * CENT, url=receiver.url)
            await spend(db, account, key, 6 * CENT)  # $0.04: below-0
            assert len(await service.check()) == 1
            await book.add(account, "topup", 10 * CENT)  # $0.14: above

            async def meanwhile() -> None:  # the other process, while the slow check holds rearmed = 0
                assert await service.check() == [] and await rearmed() == 1
                await spend(db, account, key, 10 * CENT)  # $0.04: below-1
                assert len(await service.check()) == 1
                await book.add(account, "topup", 10 * CENT)  # $0.14: above again
                assert await service.check() == [] and await rearmed() == 2

            paused.during = meanwhile
            assert await slow.check() == []  # it sees the balance above, with the rule as it read it (rearmed 0)
            assert await rearmed() == 2
            await spend(db, account, key, 10 * CENT)  # $0.04: a third fall below, a new crossing
            assert len(await service.check()) == 1
            await service.drain()
            assert len(receiver.seen) == 3
    finally:
        await service.close()
        await slow.close()
        await db.dispose()
        await other_db.dispose()

