"""An invoice sent for payment (collection method send_invoice) gets no payment attempt that could
fail: unpaid past its due date, the account is past due, then suspended after the grace period,
by the clock alone (no event), and paying it makes the account active again. Invoices Stripe
charges itself, or never reached Stripe, are judged by their payment failures only."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from billing.config import BillingConfig
from billing.invoices.account_state import AccountStates, account_standing
from billing.invoices.close import close_period
from billing.invoices.models import BillingAccount
from billing.invoices.scheduler import MonthlyClose
from billing.invoices.views import list_invoices
from billing.keys.store import KeyStore
from billing.prices.book import PriceBook
from billing.stripe.sync import StripeSync, stripe_client
from billing.stripe.webhooks import WebhookHandler
from tests.billing.invoice_helpers import at, new_key
from tests.billing.invoices.test_invoices import AFTER_OCT, SEPT, september
from tests.billing.stripe.test_stripe import config_for, fake  # noqa: F401  (the fake Stripe fixture)
from tests.conftest import SECRET
from tests.fakes.stripe_server import FakeStripe

GRACE = 7 * 86400.0
BILLING = BillingAccount.__table__
CLOSED = at(10, 1, 2)  # the scheduler's tick that closes September and pushes it


async def _state(db: Any, account_id: int, now: datetime) -> dict[str, Any]:
    return await account_standing(db, account_id, grace_seconds=GRACE, now=now)


async def test_an_unpaid_sent_invoice_suspends_after_its_due_date_and_grace(db: Any, fake: FakeStripe) -> None:
    ids = await september(db)
    key = await new_key(db, ids["a"])
    principal = await KeyStore(db, SECRET.encode()).authenticate(key)
    config = config_for(fake, close_delay_seconds=3600, grace_seconds=GRACE)  # send_invoice, net 30 (the defaults)
    sync = StripeSync(db, stripe_client(config), config)
    clock = [CLOSED]
    job = MonthlyClose(db, PriceBook(db), config, stripe=sync, clock=lambda: clock[0])
    await job.tick()
    (invoice,) = [i for i in await list_invoices(db, period="2026-09") if i["account_id"] == ids["a"]]
    due = datetime.fromisoformat(invoice["due_at"])
    assert due == CLOSED + timedelta(days=30) and invoice["stripe"]["status"] == "open"
    states = AccountStates(db, grace_seconds=GRACE)

    # before its due date: active, nothing said of delinquency (stored so by the tick too)
    async with db.connect() as conn:
        stored = (await conn.execute(sa.select(BILLING.c.state).where(BILLING.c.account_id == ids["a"]))).scalar_one()
    assert stored == "active"
    standing = await _state(db, ids["a"], due - timedelta(seconds=1))
    assert standing["state"] == "active" and standing["delinquent_since"] is None
    assert standing["unpaid_invoices"][0]["overdue"] is False
    # past it: past due (keys keep working), from the due date on
    clock[0] = due + timedelta(days=1)
    await job.tick()
    standing = await _state(db, ids["a"], clock[0])
    assert standing["state"] == "past_due" and datetime.fromisoformat(standing["delinquent_since"]) == due
    assert standing["unpaid_invoices"][0]["overdue"] is True
    await states.refresh()
    assert states.suspension(principal, now=clock[0]) is None
    # past the grace period: suspended, no event from Stripe needed; the other account's invoice too
    clock[0] = due + timedelta(seconds=GRACE + 1)
    await job.tick()
    assert (await _state(db, ids["a"], clock[0]))["state"] == "suspended"
    await states.refresh()
    reason = states.suspension(principal, now=clock[0])
    assert reason is not None and invoice["number"] in reason
    assert (await _state(db, ids["b"], clock[0]))["state"] == "suspended"

    # paid on Stripe (September's, and October's the later ticks closed): each webhook re-reads its
    # invoice, and once none is left unpaid the account is active at once
    handler = WebhookHandler(db, stripe_client(config), fake.webhook_secret, grace_seconds=GRACE, overdue=config.sends_for_payment)
    unpaid = [i for i in await list_invoices(db, account_id=ids["a"]) if i["status"] == "open"]
    assert sorted(i["period"] for i in unpaid) == ["2026-09", "2026-10"]
    for each in unpaid:
        paid = json.dumps(fake.pay(each["stripe"]["invoice_id"])).encode()
        state = (await handler.handle(paid, fake.sign(paid)))["state"]
    assert state == "active"
    await states.refresh()
    assert states.suspension(principal, now=clock[0]) is None
    await job.tick()  # and the clock does not bring it back
    assert (await _state(db, ids["a"], clock[0]))["state"] == "active"


async def test_invoices_stripe_charges_or_that_never_reached_stripe_do_not_suspend_by_date(db: Any, fake: FakeStripe) -> None:
    ids = await september(db)
    charged = config_for(fake, close_delay_seconds=3600, grace_seconds=GRACE, collection_method="charge_automatically")
    job = MonthlyClose(db, PriceBook(db), charged, stripe=StripeSync(db, stripe_client(charged), charged), clock=lambda: CLOSED)
    await job.tick()
    assert {i["stripe"]["status"] for i in await list_invoices(db, period="2026-09")} == {"open"}
    later = CLOSED + timedelta(days=90)
    await MonthlyClose(db, PriceBook(db), charged, clock=lambda: later).tick()
    assert (await _state(db, ids["a"], later))["state"] == "active"  # Stripe charges it: a failure is what counts


async def test_an_invoice_that_never_reached_stripe_does_not_suspend(db: Any) -> None:
    ids = await september(db)
    await close_period(db, PriceBook(db), SEPT, now=AFTER_OCT)
    later = AFTER_OCT + timedelta(days=90)
    await MonthlyClose(db, PriceBook(db), BillingConfig(grace_seconds=GRACE), clock=lambda: later).tick()
    assert (await _state(db, ids["a"], later))["state"] == "active"  # the customer had no way to pay it


async def test_a_payment_whose_webhook_never_came_suspends_nobody(db: Any, fake: FakeStripe) -> None:
    """Paid on Stripe, no event delivered (an endpoint down past Stripe's retries): past its due date
    the monthly job asks Stripe before the date counts, and stores the payment."""
    ids = await september(db)
    config = config_for(fake, close_delay_seconds=3600, grace_seconds=GRACE)
    clock = [CLOSED]
    job = MonthlyClose(db, PriceBook(db), config, stripe=StripeSync(db, stripe_client(config), config), clock=lambda: clock[0])
    await job.tick()
    (invoice,) = [i for i in await list_invoices(db, period="2026-09") if i["account_id"] == ids["a"]]
    fake.pay(invoice["stripe"]["invoice_id"])  # the event is made, never delivered
    clock[0] = datetime.fromisoformat(invoice["due_at"]) + timedelta(seconds=GRACE + 1)
    await job.tick()
    assert (await _state(db, ids["a"], clock[0]))["state"] == "active"
    paid = [i for i in await list_invoices(db, period="2026-09") if i["account_id"] == ids["a"]][0]
    assert (paid["status"], paid["stripe"]["status"]) == ("paid", "paid")
    assert (await _state(db, ids["b"], clock[0]))["state"] == "suspended"  # b's, not paid, still counts


def test_due_dates_count_only_where_payments_reach_us() -> None:
    """Without Stripe's webhooks a paid invoice would stay open here: due dates do not count."""
    assert BillingConfig(stripe_api_key="sk_test_x", stripe_webhook_secret="whsec_x").sends_for_payment
    assert not BillingConfig(stripe_api_key="sk_test_x").sends_for_payment
    assert not BillingConfig().sends_for_payment
    assert not BillingConfig(stripe_api_key="sk_test_x", stripe_webhook_secret="whsec_x",
                             collection_method="charge_automatically").sends_for_payment
