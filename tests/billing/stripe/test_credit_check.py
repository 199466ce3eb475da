"""After the finalize, the credit Stripe applied is compared with ours (docs/invoices.md, "The balance
on both sides"): a credit that reaches Stripe's customer balance between the push setting it and the
finalize (posted by hand in the dashboard at that moment) makes Stripe collect less than our amount
due. That is a `credit mismatch` recorded on the invoice and raised, never a silent "synced"."""

from __future__ import annotations

from typing import Any

import pytest

from billing.invoices.views import get_invoice
from billing.stripe.sync import StripeCreditMismatch, StripeSync, stripe_client
from tests.billing.stripe.test_stripe import closed_september, config_for, fake  # noqa: F401  (the fake Stripe fixture)
from tests.fakes.stripe_server import FakeStripe


async def test_a_credit_stripe_applies_beyond_ours_is_a_mismatch(db: Any, fake: FakeStripe) -> None:
    ids, invoices = await closed_september(db)
    ours = invoices[ids["a"]]
    assert ours["credit_applied_cents"] == 0 and ours["total_cents"] - 20 >= 50  # still above Stripe's minimum charge
    config = config_for(fake)
    client = stripe_client(config)
    sync = StripeSync(db, client, config)
    customer = await sync.ensure_customer(ids["a"])
    finalize = client.v1.invoices.finalize_invoice_async

    async def credited_by_hand_then_finalize(*args: Any, **kwargs: Any) -> Any:
        await stripe_client(config).v1.customers.balance_transactions.create_async(
            customer, {"amount": -20, "currency": "usd", "description": "goodwill, by hand"})
        return await finalize(*args, **kwargs)

    client.v1.invoices.finalize_invoice_async = credited_by_hand_then_finalize  # type: ignore[method-assign]
    with pytest.raises(StripeCreditMismatch, match="credit mismatch"):
        await sync.push(ours["id"])
    remote = next(v for v in fake.invoices.values() if v["customer"] == customer)
    assert (remote["amount_due"], remote["ending_balance"] - remote["starting_balance"]) == (ours["total_cents"] - 20, 20)
    after = await get_invoice(db, ours["id"])
    assert after is not None and "credit mismatch" in after["stripe"]["error"]
