"""A percent rule fires when the metric reaches that percent of the limit, not one unit before: 15%
of a 10-token monthly limit is 1.5 tokens, so 1 token (10%) is no crossing and 2 tokens are."""

from __future__ import annotations

import uuid

from billing.alerts.spend import AlertService
from billing.credits.balance import CreditBook
from billing.db import create_engine
from billing.keys.store import KeyStore
from tests.billing.alerts.test_alerts import Receiver, db_url, spend  # noqa: F401  (db_url: the fixture)
from tests.conftest import SECRET


async def test_a_percent_rule_fires_at_the_percent_not_a_unit_before(db_url: str) -> None:  # noqa: F811
    db = create_engine(db_url)
    service = AlertService(db, CreditBook(db), backoff=0.01)
    try:
        keys = KeyStore(db, SECRET.encode())
        account = (await keys.create_account("pct-" + uuid.uuid4().hex[:6]))["id"]
        key = (await keys.create_key(account))["id"]
        await keys.set_account_limits(account, {"monthly_tokens": 10})
        with Receiver() as receiver:
            await service.add_rule(account, "monthly_tokens", percent=15, url=receiver.url)
            await spend(db, account, key, 0, tokens=1)  # 10% of the limit
            assert await service.check() == []
            await spend(db, account, key, 0, tokens=1)  # 20%: past 15%
            assert len(await service.check()) == 1
            [event] = await service.events(account)
            assert (event["value"], event["threshold"]) == (2, 2)
            await service.drain()
    finally:
        await service.close()
        await db.dispose()
