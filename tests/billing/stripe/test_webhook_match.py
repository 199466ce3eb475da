"""Which of our invoices a Stripe invoice event changes: the one that stored the Stripe invoice's
id, or (a push that created it and stopped before storing the id) the one its metadata names when
that one has no Stripe invoice yet and belongs to the same customer. A second Stripe invoice that
carries our number (a copy made by hand and voided, another customer's) changes nothing of ours."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from billing.invoices.models import Invoice
from billing.invoices.views import get_invoice
from billing.stripe.sync import StripeSync, stripe_client
from billing.stripe.webhooks import WebhookHandler
from tests.billing.stripe.test_stripe import closed_september, config_for, fake  # noqa: F401  (the fake Stripe fixture)
from tests.fakes.stripe_server import FakeStripe

INVOICES = Invoice.__table__


async def _deliver(handler: WebhookHandler, fake: FakeStripe, event: dict[str, Any]) -> dict[str, Any]:
    body = json.dumps(event).encode()
    return await handler.handle(body, fake.sign(body))


def _open(fake: FakeStripe, customer: str, number: str) -> str:
    """A Stripe invoice made outside Tollgate's push that carries our invoice's number, finalized."""
    client = stripe_client(config_for(fake))
    made = client.v1.invoices.create({"customer": customer, "collection_method": "send_invoice", "days_until_due": 30,
                                      "metadata": {"tollgate_invoice": number}})
    client.v1.invoice_items.create({"customer": customer, "invoice": made.id, "amount": 100, "currency": "usd"})
    client.v1.invoices.finalize_invoice(made.id)
    return str(made.id)


def _copy(fake: FakeStripe, customer: str, number: str) -> str:
    """As `_open`, then voided."""
    made = _open(fake, customer, number)
    stripe_client(config_for(fake)).v1.invoices.void_invoice(made)
    return made


async def test_a_copy_of_our_invoice_on_stripe_does_not_void_ours(db: Any, fake: FakeStripe) -> None:
    ids, invoices = await closed_september(db)
    ours = invoices[ids["a"]]
    config = config_for(fake)
    pushed = await StripeSync(db, stripe_client(config), config).push(ours["id"])
    handler = WebhookHandler(db, stripe_client(config), fake.webhook_secret, grace_seconds=0)
    customer = fake.invoices[pushed["stripe_invoice_id"]]["customer"]

    copy = _copy(fake, customer, ours["number"])
    result = await _deliver(handler, fake, fake.invoice_event("invoice.voided", copy))
    assert result["account_id"] is None
    after = await get_invoice(db, ours["id"])
    assert after is not None and after["status"] == "open"
    assert after["stripe"]["invoice_id"] == pushed["stripe_invoice_id"] and after["stripe"]["status"] == "open"
    # the genuine one still drives ours
    paid = await _deliver(handler, fake, fake.pay(pushed["stripe_invoice_id"]))
    assert paid["account_id"] == ids["a"] and (await get_invoice(db, ours["id"]))["status"] == "paid"  # type: ignore[index]


async def test_a_number_match_needs_no_stored_id_and_the_same_customer(db: Any, fake: FakeStripe) -> None:
    ids, invoices = await closed_september(db)
    a, b = invoices[ids["a"]], invoices[ids["b"]]
    config = config_for(fake)
    sync = StripeSync(db, stripe_client(config), config)
    handler = WebhookHandler(db, stripe_client(config), fake.webhook_secret, grace_seconds=0)
    customer_b = await sync.ensure_customer(ids["b"])
    customer_a = await sync.ensure_customer(ids["a"])

    # another customer's Stripe invoice naming a's number: not a's
    other = _copy(fake, customer_b, a["number"])
    assert (await _deliver(handler, fake, fake.invoice_event("invoice.voided", other)))["account_id"] is None
    assert (await get_invoice(db, a["id"]))["status"] == "open"  # type: ignore[index]

    # a's own, made by a push that stopped before storing its id: matched by number, its id stored
    made = _open(fake, customer_a, a["number"])
    result = await _deliver(handler, fake, fake.invoice_event("invoice.finalized", made))
    assert result["account_id"] == ids["a"]
    async with db.connect() as conn:
        stored = (await conn.execute(sa.select(INVOICES.c.stripe_invoice_id).where(INVOICES.c.id == a["id"]))).scalar_one()
    assert stored == made
    assert (await get_invoice(db, b["id"]))["stripe"]["invoice_id"] is None  # type: ignore[index]


async def test_a_push_does_not_adopt_a_voided_stripe_invoice_that_carries_our_number(db: Any, fake: FakeStripe) -> None:
    """The push looks for a Stripe invoice an interrupted run made but did not store, by our number: a
    voided one (a copy made by hand, or the lost one voided since) is not it: adopted, ours would be
    `void` on Stripe (never collected), or compared with another invoice's total."""
    ids, invoices = await closed_september(db)
    ours = invoices[ids["a"]]
    config = config_for(fake)
    sync = StripeSync(db, stripe_client(config), config)
    customer = await sync.ensure_customer(ids["a"])
    copy = _copy(fake, customer, ours["number"])
    pushed = await sync.push(ours["id"])
    assert pushed["stripe_invoice_id"] != copy
    remote = fake.invoices[pushed["stripe_invoice_id"]]
    assert (remote["status"], remote["total"], remote["metadata"]["tollgate_invoice"]) == ("open", ours["total_cents"], ours["number"])
    assert fake.invoices[copy]["status"] == "void"
