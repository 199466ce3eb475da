"""The periodic work of prepaid credit: credit rows written elsewhere reach this instance's
limiter, expired grants go, prepaid usage is posted (billing/credits/balance.py), due auto-recharges
are charged (billing/stripe/checkout.py) and spend alerts are checked (billing/alerts/spend.py).
Run by the server's loop (gateway/billing.py), `POST /admin/credits/housekeeping` and
`tollgate credits post`.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from billing.alerts.spend import AlertService
from billing.credits.balance import ACCOUNTS, CreditBook
from billing.stripe.checkout import CheckoutService


async def housekeeping(book: CreditBook, db: Any, alerts: AlertService | None = None,
                       checkout: CheckoutService | None = None) -> dict[str, Any]:
    """Credit rows written elsewhere reach this limiter; expired grants go; prepaid usage is posted;
    due auto-recharges are charged; alerts are checked."""
    done: dict[str, Any] = {"object": "credit_housekeeping", "recharged": [], "alerts": []}
    await book.sync_recent()
    done["expired"] = len(await book.expire_grants())
    async with db.connect() as conn:
        prepaid = [int(a) for a in (await conn.execute(sa.select(ACCOUNTS.c.id).where(ACCOUNTS.c.billing_mode == "prepaid"))).scalars()]
    for account_id in prepaid:
        await book.post_usage(account_id)
    if checkout is not None:
        done["recharged"] = await checkout.recharge_due()
    if alerts is not None:
        done["alerts"] = await alerts.check()
    return done
