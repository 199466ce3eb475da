"""Auto-recharge charges the saved card when the balance is below the threshold (docs/prepaid.md):
at exactly the threshold nothing is charged; one nano-USD below, one recharge."""

from __future__ import annotations

from typing import Any

from billing import migrate
from tests.billing.stripe.test_checkout import fake  # noqa: F401  (the fixture)
from tests.billing.stripe.test_recharge_lost_answer import CENT, _recharges, _setup
from tests.conftest import run_coro
from tests.fakes.stripe_checkout import FakeStripePayments


def test_a_balance_at_the_threshold_is_not_recharged(fake: FakeStripePayments, fresh_pg_database: Any) -> None:  # noqa: F811
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)

    async def scenario() -> None:
        db, service, book, account = await _setup(url, fake)  # $10.00 bought by Checkout, the card saved
        try:
            assert (await book.balance(account))["balance_nanos"] == 1000 * CENT  # type: ignore[index]
            await service.set_recharge(account, 1000 * CENT, 500)  # below $10.00: charge $5.00
            assert await service.recharge_due() == [] and _recharges(fake) == []
            await service.set_recharge(account, 1000 * CENT + 1, 500)  # $10.00 is one nano below this one
            assert await service.recharge_due() == [account] and len(_recharges(fake)) == 1
        finally:
            await db.dispose()

    run_coro(scenario())
