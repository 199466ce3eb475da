"""An invoice with several disputes owed is charged back since the earliest one (docs/billing.md: the
chargeback counts from the dispute's creation, `charged_back_at` the earliest one's `created`), whatever
order they arrive in; the account is delinquent from then. Once that one is won, the next one's."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa

from billing.invoices.account_state import recompute
from billing.invoices.views import get_invoice
from billing.stripe.invoice_disputes import INVOICES, InvoicePayment, chargeback
from tests.billing.stripe.test_stripe import closed_september

EARLY, LATE = 1_796_000_000, 1_796_000_000 + 5 * 86400


async def test_charged_back_since_the_earliest_dispute_owed(db: Any) -> None:
    ids, invoices = await closed_september(db)
    a = invoices[ids["a"]]
    async with db.begin() as conn:
        await conn.execute(INVOICES.update().where(INVOICES.c.id == a["id"]).values(status="paid", stripe_invoice_id="in_a", total_cents=1000))
    paid = [InvoicePayment("in_a", 1000, "usd")]

    def dispute(du: str, created: int, status: str = "needs_response") -> Any:
        return chargeback({"id": du, "status": status, "amount": 300, "currency": "usd", "created": created,
                           "payment_intent": f"pi_{du}"}, paid, 0 if status == "won" else 300, 0)

    async def since() -> tuple[Any, Any]:
        shown = await get_invoice(db, a["id"])
        assert shown is not None
        async with db.begin() as conn:
            await recompute(conn, ids["a"], now=datetime.now(timezone.utc), grace_seconds=0)
            delinquent = (await conn.execute(sa.text("SELECT delinquent_since FROM billing_accounts WHERE account_id = :a"),
                                             {"a": ids["a"]})).scalar_one()
        return shown["charged_back_at"], delinquent

    for apply in (dispute("du_early", EARLY), dispute("du_late", LATE)):  # the earlier one first
        async with db.begin() as conn:
            await apply(conn)
    early, late = datetime.fromtimestamp(EARLY, tz=timezone.utc), datetime.fromtimestamp(LATE, tz=timezone.utc)
    assert await since() == (early.isoformat(), early)
    async with db.begin() as conn:
        await dispute("du_early", EARLY, "won")(conn)
    assert await since() == (late.isoformat(), late)
