"""When an account became delinquent is the first fact that made it so, whatever Stripe sends after:
a second failed payment of the same invoice, or another `customer.subscription.updated` of a
subscription still past due, must not move `delinquent_since` later (which would push the
suspension back by as much, for as long as Stripe keeps retrying). And the grace period ends at
`delinquent_since + grace` exactly: suspended from that instant on (docs/billing.md)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa

from billing.invoices.account_state import ACTIVE, PAST_DUE, SUSPENDED, AccountStates, derive_state, recompute
from billing.invoices.models import BillingAccount, Invoice
from billing.keys.store import Principal
from billing.stripe.sync import StripeSync, stripe_client
from billing.stripe.webhooks import WebhookHandler
from tests.billing.stripe.test_stripe import closed_september, config_for, fake  # noqa: F401  (the fake Stripe fixture)
from tests.fakes.stripe_server import FakeStripe

BILLING = BillingAccount.__table__
INVOICES = Invoice.__table__
GRACE = 600  # seconds


async def _deliver(handler: WebhookHandler, fake: FakeStripe, event: dict[str, Any], created: int) -> dict[str, Any]:
    event = {**event, "created": created}  # when Stripe says it happened (re-signed: the body is what is verified)
    body = json.dumps(event).encode()
    return await handler.handle(body, fake.sign(body))


async def _since(db: Any, account_id: int) -> datetime | None:
    async with db.connect() as conn:
        value = (await conn.execute(sa.select(BILLING.c.delinquent_since).where(BILLING.c.account_id == account_id))).scalar_one()
    return None if value is None else (value if value.tzinfo else value.replace(tzinfo=timezone.utc))


def test_the_grace_period_ends_at_its_last_instant() -> None:
    since = datetime(2026, 10, 1, tzinfo=timezone.utc)
    assert derive_state(since, since - timedelta(microseconds=1), GRACE) == ACTIVE
    assert derive_state(since, since, GRACE) == PAST_DUE
    assert derive_state(since, since + timedelta(seconds=GRACE) - timedelta(microseconds=1), GRACE) == PAST_DUE
    assert derive_state(since, since + timedelta(seconds=GRACE), GRACE) == SUSPENDED


async def test_a_second_failed_payment_does_not_move_the_delinquency_later(db: Any, fake: FakeStripe) -> None:
    ids, invoices = await closed_september(db)
    config = config_for(fake, collection_method="charge_automatically")  # judged by failed payments only
    pushed = await StripeSync(db, stripe_client(config), config).push(invoices[ids["a"]]["id"])
    handler = WebhookHandler(db, stripe_client(config), fake.webhook_secret, grace_seconds=GRACE)
    first = int(time.time()) - GRACE - 100  # failed more than the grace period ago: suspended now
    result = await _deliver(handler, fake, fake.fail_payment(pushed["stripe_invoice_id"]), first)
    assert result["state"] == SUSPENDED
    # Stripe's retry fails again 200 s later: still the same unpaid invoice, delinquent since the first failure
    result = await _deliver(handler, fake, fake.fail_payment(pushed["stripe_invoice_id"]), first + 200)
    assert (result["state"], await _since(db, ids["a"])) == (SUSPENDED, datetime.fromtimestamp(first, tz=timezone.utc))


async def test_a_subscription_still_past_due_keeps_its_first_delinquency(db: Any, fake: FakeStripe) -> None:
    ids, _ = await closed_september(db)
    config = config_for(fake)
    customer = await StripeSync(db, stripe_client(config), config).ensure_customer(ids["a"])
    handler = WebhookHandler(db, stripe_client(config), fake.webhook_secret, grace_seconds=GRACE)
    first = int(time.time()) - GRACE - 100
    result = await _deliver(handler, fake, fake.set_subscription(customer, "past_due"), first)
    assert result["state"] == SUSPENDED
    sub_id = next(iter(fake.subscriptions))
    # another update of the same subscription (its metadata, a retry) while it is still past due
    result = await _deliver(handler, fake, fake.set_subscription(customer, "past_due", sub_id), first + 200)
    assert (result["state"], await _since(db, ids["a"])) == (SUSPENDED, datetime.fromtimestamp(first, tz=timezone.utc))
    # back to active clears it; past due again later is a new delinquency, from then
    assert (await _deliver(handler, fake, fake.set_subscription(customer, "active", sub_id), first + 300))["state"] == ACTIVE
    now = int(time.time())
    assert (await _deliver(handler, fake, fake.set_subscription(customer, "past_due", sub_id), now))["state"] == PAST_DUE
    assert await _since(db, ids["a"]) == datetime.fromtimestamp(now, tz=timezone.utc)


async def test_an_invoice_event_without_a_payment_attempt_is_no_failure(db: Any, fake: FakeStripe) -> None:
    """`invoice.finalized`, `invoice.updated` (and the like) of an open invoice nobody tried to charge
    yet: nothing failed, the account stays active; the same invoice's failed attempt counts."""
    ids, invoices = await closed_september(db)
    config = config_for(fake, collection_method="charge_automatically")
    pushed = await StripeSync(db, stripe_client(config), config).push(invoices[ids["a"]]["id"])
    handler = WebhookHandler(db, stripe_client(config), fake.webhook_secret, grace_seconds=GRACE)
    long_ago = int(time.time()) - GRACE - 100
    for kind in ("invoice.finalized", "invoice.updated"):
        result = await _deliver(handler, fake, fake.invoice_event(kind, pushed["stripe_invoice_id"]), long_ago)
        assert (result["account_id"], result["state"], await _since(db, ids["a"])) == (ids["a"], ACTIVE, None)
    result = await _deliver(handler, fake, fake.fail_payment(pushed["stripe_invoice_id"]), long_ago)
    assert result["state"] == SUSPENDED


async def test_only_an_invoice_open_on_stripe_counts_by_its_due_date(db: Any) -> None:
    """Past its due date, an invoice that never reached Stripe (or whose push stopped at the draft)
    makes nobody delinquent: the customer has no way to pay it. Open on Stripe, it does."""
    ids, invoices = await closed_september(db)
    ours = invoices[ids["a"]]
    now = datetime.now(timezone.utc)
    assert datetime.fromisoformat(ours["due_at"]) < now  # due a month after these tests' past close

    async def state() -> str:
        async with db.begin() as conn:
            return await recompute(conn, ids["a"], now=now, grace_seconds=0, overdue=True)

    for stripe_status in (None, "draft"):
        async with db.begin() as conn:
            await conn.execute(INVOICES.update().where(INVOICES.c.id == ours["id"]).values(stripe_status=stripe_status))
        assert await state() == ACTIVE, stripe_status
    async with db.begin() as conn:
        await conn.execute(INVOICES.update().where(INVOICES.c.id == ours["id"]).values(stripe_status="open"))
    assert await state() == SUSPENDED


async def test_the_request_path_suspends_at_the_same_instant_as_the_stored_state(db: Any) -> None:
    """AccountStates.suspension (no I/O, on every request) ends the grace where derive_state does."""
    ids, invoices = await closed_september(db)
    since = datetime(2026, 11, 20, tzinfo=timezone.utc)
    async with db.begin() as conn:
        await conn.execute(INVOICES.update().where(INVOICES.c.id == invoices[ids["a"]]["id"]).values(payment_failed_at=since))
        await recompute(conn, ids["a"], now=since, grace_seconds=GRACE)
    states = AccountStates(db, grace_seconds=GRACE)
    await states.refresh()
    principal = Principal(key_id=1, account_id=ids["a"], is_admin=False, models=None, expires_at=None, revoked=False)
    end = since + timedelta(seconds=GRACE)
    assert states.suspension(principal, now=end - timedelta(microseconds=1)) is None
    assert derive_state(since, end, GRACE) == SUSPENDED
    reason = states.suspension(principal, now=end)
    assert reason is not None and invoices[ids["a"]]["number"] in reason
