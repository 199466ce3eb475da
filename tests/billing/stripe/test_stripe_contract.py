"""The FAKE Stripe (tests/fakes/stripe_server.py, stripe_checkout.py) against the official SDK's own
object definitions (the `stripe` package pins API version 2026-10-28): every object the fake
answers and every event it sends has only fields the SDK's class for that object declares, each
value of the declared type (a documented enum value where the SDK lists them), every event type is
one of the SDK's `Event.type` values and its `data.object` is the kind of object that type names.
The flows are the ones tests/billing/stripe/test_checkout.py and test_disputes.py drive the gateway through."""

from __future__ import annotations

import sys
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import stripe
from stripe import StripeClient, StripeObject
from stripe._object_classes import OBJECT_CLASSES

from tests.fakes.stripe_checkout import FakeStripePayments
from tests.fakes.stripe_server import public

# event type prefix -> the `object` of its data.object (the longest prefix wins)
EVENT_OBJECTS = {
    "checkout.session.": "checkout.session", "payment_intent.": "payment_intent", "charge.refund.": "refund", "charge.dispute.": "dispute",
    "charge.": "charge", "refund.": "refund", "invoice.": "invoice", "customer.subscription.": "subscription",
}


class _Names(dict):  # type: ignore[type-arg]
    """Resolves the SDK's forward references (`"Customer"`) to its classes; unknown ones to Any."""

    def __missing__(self, name: str) -> Any:
        return getattr(stripe, name, Any)


def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, dict(vars(sys.modules[cls.__module__])), _Names(vars(cls)))


def sdk_class(object_name: str) -> type:
    module, name = OBJECT_CLASSES[object_name]
    return getattr(__import__(module, fromlist=[name]), name)  # type: ignore[no-any-return]


def problems(value: Any, annotation: Any, where: str) -> list[str]:
    """Why `value` is not an `annotation` (empty: it is)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is Any:
        return []
    if annotation is type(None):
        return [] if value is None else [f"{where}: {value!r} is not null"]
    if origin in (Union, types.UnionType):
        literals = [a for a in args if get_origin(a) is Literal]
        if isinstance(value, str) and literals:  # an open enum: one of the values Stripe documents
            allowed = [v for a in literals for v in get_args(a)]
            return [] if value in allowed else [f"{where}: {value!r} is none of {allowed}"]
        tried = [problems(value, a, where) for a in args]
        return [] if any(not p for p in tried) else min(tried, key=len)
    if origin is Literal:
        return [] if value in args else [f"{where}: {value!r} is none of {list(args)}"]
    if annotation is bool:
        return [] if isinstance(value, bool) else [f"{where}: {value!r} is not a boolean"]
    if annotation is int:
        return [] if isinstance(value, int) and not isinstance(value, bool) else [f"{where}: {value!r} is not an integer"]
    if annotation is float:
        return [] if isinstance(value, (int, float)) and not isinstance(value, bool) else [f"{where}: {value!r} is not a number"]
    if annotation is str:
        return [] if isinstance(value, str) else [f"{where}: {value!r} is not a string"]
    if origin in (list, typing.List):
        if not isinstance(value, list):
            return [f"{where}: {value!r} is not a list"]
        return [p for i, item in enumerate(value) for p in problems(item, args[0] if args else Any, f"{where}[{i}]")]
    cls = origin or annotation
    if isinstance(cls, type) and issubclass(cls, StripeObject):
        if not isinstance(value, dict):
            return [f"{where}: {value!r} is not an object"]
        if cls.__name__ in ("UntypedStripeObject", "ListObject"):  # metadata, lists: any keys
            return []
        return fields(value, cls, where)
    return []


def fields(obj: dict[str, Any], cls: type, where: str) -> list[str]:
    declared = hints(cls)
    found = [f"{where}.{name}: not a field of the SDK's {cls.__qualname__}" for name in obj if name not in declared]
    return found + [p for name, value in obj.items() if name in declared for p in problems(value, declared[name], f"{where}.{name}")]


def check_object(obj: dict[str, Any], where: str) -> list[str]:
    kind = obj.get("object")
    if kind not in OBJECT_CLASSES:
        return [f"{where}: object {kind!r} is not one the SDK knows"]
    return fields(obj, sdk_class(kind), where)


def check_event(event: dict[str, Any]) -> list[str]:
    where = f"{event['type']} {event['id']}"
    found = fields(event, stripe.Event, where)
    prefix = max((p for p in EVENT_OBJECTS if event["type"].startswith(p)), key=len, default=None)
    obj = event["data"]["object"]
    if prefix is None or obj.get("object") != EVENT_OBJECTS[prefix]:
        found.append(f"{where}: data.object is a {obj.get('object')!r}")
    parsed = stripe.Event.construct_from(event, "sk_test")  # what a webhook handler gets from the SDK
    if not isinstance(parsed.data.object, sdk_class(obj["object"])):
        found.append(f"{where}: the SDK reads data.object as {type(parsed.data.object).__name__}")
    return found + check_object(obj, where + " data.object")


def run_flows(fake: FakeStripePayments) -> None:
    """Every flow the fake has, through the SDK where Tollgate calls Stripe, by test helper where the customer does."""
    client = StripeClient(fake.api_key, base_addresses={"api": fake.url}, max_network_retries=0)
    params: Any = {"mode": "payment", "success_url": "https://x.test/ok", "cancel_url": "https://x.test/no",
                   "line_items": [{"quantity": 1, "price_data": {"currency": "usd", "unit_amount": 1234,
                                                                 "product_data": {"name": "credit"}}}],
                   "metadata": {"tollgate_account": "1"}, "customer_creation": "always",
                   "payment_intent_data": {"metadata": {"tollgate_account": "1"}, "setup_future_usage": "off_session"}}
    card, bank, failing = (client.v1.checkout.sessions.create(params) for _ in range(3))
    fake.complete_session(card.id)
    fake.complete_session(bank.id, delayed=True)
    fake.settle_session(bank.id, succeeded=True)
    fake.complete_session(failing.id, delayed=True)
    fake.settle_session(failing.id, succeeded=False)
    intent = fake.sessions[card.id]["payment_intent"]
    refund = fake._create_refund({"payment_intent": intent, "amount": "234"})
    fake.fail_refund(refund["id"])
    fake.pend_refunds()
    fake._create_refund({"payment_intent": intent, "amount": "100"})
    pi = fake.payment_intents[intent]
    charge: Any = {"amount": 500, "currency": "usd", "customer": pi["customer"], "payment_method": pi["payment_method"],
                   "off_session": True, "confirm": True, "metadata": {"tollgate_recharge": "1"}}
    recharged = client.v1.payment_intents.create(charge)
    # disputes (billing/stripe/checkout.py re-reads each one): won, lost, an inquiry closed and one escalated and won
    won, lost = fake.dispute(intent, reason="product_not_received")[0], fake.dispute(recharged.id)[0]
    fake.review_dispute(won["data"]["object"]["id"])
    fake.close_dispute(won["data"]["object"]["id"], won=True)
    fake.close_dispute(lost["data"]["object"]["id"], won=False)
    asked = fake.dispute(fake.sessions[bank.id]["payment_intent"], 500, "unrecognized", inquiry=True)[0]["data"]["object"]["id"]
    fake.review_dispute(asked)
    fake.close_dispute(asked, won=True)
    # Adaptive Pricing on in the Dashboard: a session that leaves it on is paid in EUR (its PaymentIntent,
    # Charge, Refund, Dispute), one that turns it off in USD; the lists checkout.py reads them back by
    fake.localize("eur", 92)
    local, usd = (client.v1.checkout.sessions.create({**params, "adaptive_pricing": {"enabled": on}}) for on in (True, False))
    assert (local.adaptive_pricing.enabled, usd.adaptive_pricing.enabled) == (True, False)
    fake.complete_session(local.id)
    fake.complete_session(usd.id)
    paid = fake.sessions[local.id]["payment_intent"]
    assert fake.payment_intents[paid]["currency"] == "eur" and fake.payment_intents[fake.sessions[usd.id]["payment_intent"]]["currency"] == "usd"
    eur_refund = fake._create_refund({"payment_intent": paid, "amount": "500"})
    fake.dispute(paid)
    sessions = client.v1.checkout.sessions.list({"payment_intent": paid, "limit": 1}).data
    assert [x.id for x in sessions] == [local.id] and check_object(sessions[0].to_dict(), "listed session") == []
    refunds = client.v1.refunds.list({"charge": fake.payment_intents[paid]["latest_charge"], "limit": 100}).data
    assert [x.id for x in refunds] == [eur_refund["id"]] and check_object(refunds[0].to_dict(), "listed refund") == []
    partly = fake.payment(900)["id"]  # a full-amount dispute after a partial refund, "partially won"
    fake._create_refund({"payment_intent": partly, "amount": "200"})
    partial = fake.dispute(partly, 900, "credit_not_processed")[0]["data"]["object"]["id"]
    fake.close_dispute(partial, won=False, reinstated=200)
    assert [t.amount for t in client.v1.disputes.retrieve(partial).balance_transactions] == [-900, 200]
    escalated = fake.dispute(fake.payment(700)["id"], inquiry=True)[0]["data"]["object"]["id"]
    fake.escalate_dispute(escalated)
    fake.close_dispute(escalated, won=True)
    assert client.v1.disputes.retrieve(escalated).status == "won" and fake.charges[recharged.latest_charge]["disputed"] is True
    listed = client.v1.disputes.list({"payment_intent": intent})  # billing/stripe/checkout.py:_charged_back
    assert [d.id for d in listed.data] == [won["data"]["object"]["id"]] and listed.object == "list"
    assert check_object(listed.data[0].to_dict(), "listed dispute") == []
    for decline in (fake.decline_next, fake.require_authentication_next):
        decline()
        try:
            client.v1.payment_intents.create(charge)
        except stripe.CardError as exc:
            assert exc.http_status == 402 and (exc.json_body or {})["error"]["payment_intent"]["status"] == "requires_payment_method"
        else:
            raise AssertionError("the declined charge succeeded")
    # invoices (billing/stripe/sync.py, billing/invoices/credit_notes.py) and the events billing/stripe/webhooks.py reads
    customer = client.v1.customers.create({"name": "A", "email": "a@x.test", "address": {"country": "DE", "line1": "1 Road"}})
    client.v1.customers.tax_ids.create(customer.id, {"type": "eu_vat", "value": "DE123456789"})
    invoice = client.v1.invoices.create({"customer": customer.id, "collection_method": "send_invoice", "days_until_due": 30,
                                         "currency": "usd", "metadata": {"tollgate_invoice": "INV-1"}})
    item = client.v1.invoice_items.create({"customer": customer.id, "invoice": invoice.id, "amount": 1000, "currency": "usd"})
    line = client.v1.invoices.line_items.list(invoice.id).data[0]
    client.v1.invoices.line_items.update(invoice.id, line.id, {"tax_amounts": [{"amount": 190, "taxable_amount": 1000,
        "tax_rate_data": {"display_name": "VAT", "inclusive": False, "percentage": "19", "country": "DE"}}]})
    client.v1.customers.balance_transactions.create(customer.id, {"amount": -300, "currency": "usd", "description": "credit",
                                                                  "metadata": {"tollgate_invoice": "INV-1"}})
    client.v1.invoices.finalize_invoice(invoice.id)  # takes the balance: applied_to_invoice
    client.v1.invoices.send_invoice(invoice.id)
    client.v1.credit_notes.create({"invoice": invoice.id, "amount": 100})
    fake.fail_payment(invoice.id)
    fake.pay(invoice.id)
    # its payment (billing/stripe/invoice_disputes.py finds the invoice of a disputed PaymentIntent by it)
    paid_by = fake.payment_of(invoice.id)
    links = client.v1.invoice_payments.list({"payment": {"type": "payment_intent", "payment_intent": paid_by}, "status": "paid",
                                             "limit": 100})
    assert links.object == "list" and [x.invoice for x in links.data] == [invoice.id]
    assert check_object(links.data[0].to_dict(), "listed invoice payment") == []
    link = client.v1.invoice_payments.retrieve(links.data[0].id)
    assert (link.payment.type, link.payment.payment_intent, link.amount_paid) == ("payment_intent", paid_by, 790)  # 1190 - 300 - 100
    assert client.v1.payment_intents.retrieve(paid_by).metadata.to_dict() == {}  # the invoice's metadata is not copied
    assert [x.id for x in client.v1.invoice_payments.list({"invoice": invoice.id}).data] == [link.id]
    assert client.v1.invoice_payments.list({"invoice": invoice.id, "status": "open"}).data == []
    fake.dispute(paid_by)
    client.v1.credit_notes.create({"invoice": invoice.id, "amount": 50, "credit_amount": 50})
    fake.set_subscription(customer.id, "past_due")
    assert item.invoice == invoice.id
    kinds = [t.type for t in client.v1.customers.balance_transactions.list(customer.id).data]
    assert kinds == ["credit_note", "applied_to_invoice", "adjustment"]  # newest first
    voided = client.v1.invoices.create({"customer": customer.id, "collection_method": "send_invoice", "days_until_due": 30})
    client.v1.invoice_items.create({"customer": customer.id, "invoice": voided.id, "amount": 500, "currency": "usd"})
    client.v1.invoices.finalize_invoice(voided.id)
    assert client.v1.invoices.void_invoice(voided.id).status == "void"
    fake.invoice_event("invoice.voided", voided.id)
    # the $0.50 of credit the voided invoice applied goes back (API 2019-12-03 and later)
    txns = client.v1.customers.balance_transactions.list(customer.id).data
    assert [(t.type, t.amount) for t in txns[:3]] == [("unapplied_from_invoice", -50), ("applied_to_invoice", 50), ("credit_note", -50)]
    assert client.v1.customers.retrieve(customer.id).balance == txns[0].ending_balance == -50
    # below Stripe's minimum charge ($0.50): $0.80 less the $0.50 credit is $0.30, not charged; paid, carried as a debit
    small = client.v1.invoices.create({"customer": customer.id, "collection_method": "charge_automatically", "currency": "usd"})
    client.v1.invoice_items.create({"customer": customer.id, "invoice": small.id, "amount": 80, "currency": "usd"})
    small = client.v1.invoices.finalize_invoice(small.id)
    assert (small.status, small.amount_due, small.amount_paid, small.amount_remaining) == ("paid", 0, 0, 0)
    assert (small.starting_balance, small.ending_balance, small.status_transitions.paid_at is not None) == (-50, 30, True)
    txns = client.v1.customers.balance_transactions.list(customer.id).data
    assert [(t.type, t.amount, t.invoice) for t in txns[:2]] == [("invoice_too_small", 30, small.id), ("applied_to_invoice", 50, small.id)]
    assert [e["type"] for e in fake.events[-2:]] == ["invoice.finalized", "invoice.paid"]
    # a credit note on it (paid, nothing paid, the debit not collected yet): all post-payment, up to its total;
    # no refund (nothing was charged), a credit to the balance nets against the debit there
    for refused in ({"amount": 30, "refund_amount": 30}, {"amount": 81, "credit_amount": 81}, {"amount": 30}):
        try:
            client.v1.credit_notes.create({"invoice": small.id, **refused})
            raise AssertionError(f"{refused} was not refused")
        except stripe.InvalidRequestError as exc:
            assert exc.http_status == 400, exc
    note = client.v1.credit_notes.create({"invoice": small.id, "amount": 30, "credit_amount": 30})
    assert (note.type, note.pre_payment_amount, note.post_payment_amount, note.out_of_band_amount) == ("post_payment", 0, 30, 0)
    small = client.v1.invoices.retrieve(small.id)
    assert (small.status, small.amount_paid, small.post_payment_credit_notes_amount, small.pre_payment_credit_notes_amount) == ("paid", 0, 30, 0)
    txns = client.v1.customers.balance_transactions.list(customer.id).data
    assert [(t.type, t.amount, t.credit_note) for t in txns[:2]] == [("credit_note", -30, note.id), ("invoice_too_small", 30, None)]
    assert client.v1.customers.retrieve(customer.id).balance == 0
    rest = client.v1.credit_notes.create({"invoice": small.id, "amount": 50, "out_of_band_amount": 50})  # the rest of its total
    assert (rest.post_payment_amount, rest.out_of_band_amount, rest.customer_balance_transaction) == (50, 50, None)


def test_every_object_and_event_the_fake_makes_is_the_sdks_shape() -> None:
    fake = FakeStripePayments().start()
    try:
        run_flows(fake)
        objects = [*fake.sessions.values(), *fake.payment_intents.values(), *fake.charges.values(), *fake.refunds.values(),
                   *fake.disputes.values(), *fake.invoice_payments.values(),
                   *fake.customers.values(), *fake.tax_ids.values(), *fake.invoices.values(), *fake.items.values(),
                   *(line for i in fake.invoices.values() for line in i["lines"]["data"]), *fake.tax_rates.values(),
                   *fake.credit_notes.values(), *fake.subscriptions.values(), *fake.balance_transactions.values()]
        found = [p for o in objects for p in check_object(public(o), o["id"])]
        found += [p for e in fake.events for p in check_event(e)]
        kinds = {e["type"] for e in fake.events}
    finally:
        fake.stop()
    assert found == []
    assert kinds == {
        "checkout.session.completed", "checkout.session.async_payment_succeeded", "checkout.session.async_payment_failed",
        "payment_intent.created", "payment_intent.processing", "payment_intent.succeeded", "payment_intent.payment_failed",
        "charge.pending", "charge.succeeded", "charge.failed", "charge.refunded", "charge.refund.updated",
        "refund.created", "refund.updated", "refund.failed", "charge.dispute.created", "charge.dispute.updated",
        "charge.dispute.closed", "charge.dispute.funds_withdrawn", "charge.dispute.funds_reinstated", "invoice.finalized", "invoice.payment_failed",
        "invoice.paid", "invoice.voided",
        "customer.subscription.updated",
    }


def test_the_checker_finds_what_is_not_stripes() -> None:
    """The contract check itself: an unknown field, a wrong type, an undocumented enum value and a
    mislabelled event are each reported."""
    session = {"id": "cs_1", "object": "checkout.session", "payment_status": "settled", "amount_total": "12", "paid": True}
    assert sorted(p.split(": ")[0] for p in check_object(session, "s")) == ["s.amount_total", "s.paid", "s.payment_status"]
    event = {"id": "evt_1", "object": "event", "type": "charge.succeeded", "created": 1, "livemode": False, "api_version": "x",
             "pending_webhooks": 1, "request": {"id": None, "idempotency_key": None},
             "data": {"object": {"id": "pi_1", "object": "payment_intent"}}}
    assert any("data.object is a 'payment_intent'" in p for p in check_event(event))
    assert check_event({**event, "type": "refund.reversed"})  # not an event type Stripe has
