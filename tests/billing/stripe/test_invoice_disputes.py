"""Chargebacks on the payments of postpaid invoices (billing/stripe/invoice_disputes.py), through the
real gateway: the official SDK against the FAKE Stripe, signed deliveries. Stripe leaves the invoice
`paid`; the dispute comes as charge.dispute.* about a PaymentIntent with none of Tollgate's metadata,
tied to its invoice only by an InvoicePayment. A chargeback makes the invoice owed again (shown
charged back, the account delinquent from the dispute's creation and suspended after the grace
period, as a failed payment would); a won dispute makes it paid again; events in any order, and
repeated, end the same; an inquiry, and a dispute of a payment that is no invoice of ours, change nothing."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
from stripe import StripeClient

from billing.keys.store import KeyStore
from tests.billing.invoice_helpers import App, new_key, serve
from tests.billing.stripe.test_checkout import fake  # noqa: F401  (the fixture)
from tests.billing.stripe.test_stripe import closed_september, wait_for
from tests.conftest import SECRET
from tests.fakes.stripe_checkout import FakeStripePayments


def env_for(fake: FakeStripePayments, grace: str) -> dict[str, str]:
    # Stripe charges the invoices (a sent invoice's due date, a month after these tests' past dates, would count too)
    return {"TOLLGATE_STRIPE_API_KEY": fake.api_key, "TOLLGATE_STRIPE_API_BASE": fake.url,
            "TOLLGATE_STRIPE_WEBHOOK_SECRET": fake.webhook_secret, "TOLLGATE_STRIPE_MAX_RETRIES": "0",
            "TOLLGATE_STRIPE_COLLECTION_METHOD": "charge_automatically", "TOLLGATE_BILLING_GRACE_SECONDS": grace,
            "TOLLGATE_CREDITS_CHECK_SECONDS": "0"}


class Postpaid:
    """September's invoices of accounts a and b, pushed to Stripe and paid there, their payments' events delivered."""

    def __init__(self, app: App, fake: FakeStripePayments, admin: httpx.AsyncClient, ids: dict[str, int],
                 invoices: dict[int, dict[str, Any]]) -> None:
        self.app, self.fake, self.admin, self.ids, self.invoices = app, fake, admin, ids, invoices
        self.hook = app.base_url + "/webhooks/stripe"
        self.rng = random.Random(11)

    async def paid(self, name: str) -> str:
        """The account's invoice pushed, paid on Stripe, invoice.paid delivered: its PaymentIntent."""
        ours = self.invoices[self.ids[name]]["id"]
        assert (await self.admin.post(f"/admin/invoices/{ours}/sync")).json()["stripe_status"] == "open"
        remote = (await self.invoice(name))["stripe"]["invoice_id"]
        assert (await self.deliver([self.fake.pay(remote)]))[0]["state"] == "active"
        assert (await self.invoice(name))["status"] == "paid"
        return self.fake.payment_of(remote)

    async def invoice(self, name: str) -> dict[str, Any]:
        return (await self.admin.get(f"/admin/invoices/{self.invoices[self.ids[name]]['id']}")).json()  # type: ignore[no-any-return]

    async def standing(self, name: str) -> dict[str, Any]:
        return (await self.admin.get(f"/admin/accounts/{self.ids[name]}/billing")).json()  # type: ignore[no-any-return]

    async def deliver(self, events: list[dict[str, Any]], order: str = "as sent") -> list[dict[str, Any]]:
        """Each event once, as sent, reversed or shuffled: the answers."""
        answers = []
        sequence = events if order == "as sent" else events[::-1] if order == "reversed" else self.rng.sample(events, len(events))
        for event in sequence:
            r = await self.fake.deliver(event, self.hook)
            assert r.status_code == 200, (event["type"], r.text)
            answers.append(r.json())
        return answers

    async def deliver_twice(self, events: list[dict[str, Any]], order: str) -> None:
        """In `order`, then all again at once (duplicates), then each again, shuffled, as a new event about the same dispute."""
        await self.deliver(events, order)
        again = await asyncio.gather(*(self.fake.deliver(e, self.hook) for e in self.rng.sample(events, len(events))))
        assert all(a.status_code == 200 and a.json().get("duplicate") for a in again)
        await self.deliver([self.fake._event(e["type"], e["data"]["object"]) for e in events], "shuffled")


async def test_a_chargeback_makes_a_paid_invoice_owed_again_and_a_won_dispute_paid_again(
        db_url: str, db: Any, fake: FakeStripePayments, tmp_path: Path) -> None:
    ids, invoices = await closed_september(db)
    key = await new_key(db, ids["a"])
    principal = await KeyStore(db, SECRET.encode()).authenticate(key)
    with serve(db_url, tmp_path, **env_for(fake, "0")) as app:
        async with app.admin() as admin:
            p = Postpaid(app, fake, admin, ids, invoices)
            intent = await p.paid("a")
            assert fake.payment_intents[intent]["metadata"] == {}  # as on Stripe: nothing of the invoice's
            opened = fake.dispute(intent)  # created, funds_withdrawn
            dispute = opened[0]["data"]["object"]
            answers = await p.deliver(opened)
            assert [(x["account_id"], x.get("state")) for x in answers] == [(ids["a"], "suspended")] * 2
            shown = await p.invoice("a")
            assert shown["status"] == "paid" and shown["stripe"]["status"] == "paid"  # Stripe's paid is final
            assert shown["charged_back_at"] is not None and shown["stripe"]["chargeback_dispute_id"] == dispute["id"]
            standing = await p.standing("a")
            assert standing["state"] == "suspended" and standing["delinquent_since"] == shown["charged_back_at"]
            assert [(u["number"], u["total_cents"], u["charged_back_at"]) for u in standing["unpaid_invoices"]] == [
                (invoices[ids["a"]]["number"], 89, shown["charged_back_at"])]
            await wait_for(lambda: _suspended(app, principal))
            reason = app.billing.states.suspension(principal)
            assert reason is not None and invoices[ids["a"]]["number"] in reason and "0.89 USD" in reason
            async with app.as_key(key) as customer:  # the customer's own view says so too
                mine = (await customer.get(f"/v1/invoices/{invoices[ids['a']]['id']}")).json()
                assert mine["status"] == "paid" and mine["charged_back_at"] == shown["charged_back_at"]
            assert (await p.standing("b"))["state"] == "active"  # b's invoice is not paid on Stripe: no date counts

            # evidence submitted (under review: the money is still withdrawn), then won: paid again, active
            assert (await p.deliver(fake.review_dispute(dispute["id"])))[0]["state"] == "suspended"
            closed = await p.deliver(fake.close_dispute(dispute["id"], won=True))
            assert [x["state"] for x in closed] == ["active", "active"]
            shown = await p.invoice("a")
            assert shown["charged_back_at"] is None and shown["stripe"]["chargeback_dispute_id"] is None
            assert (await p.standing("a"))["unpaid_invoices"] == []
            await wait_for(lambda: _not_suspended(app, principal))


async def test_a_grace_period_applies_to_a_chargeback_as_to_a_failed_payment(
        db_url: str, db: Any, fake: FakeStripePayments, tmp_path: Path) -> None:
    ids, invoices = await closed_september(db)
    with serve(db_url, tmp_path, **env_for(fake, "3600")) as app:
        async with app.admin() as admin:
            p = Postpaid(app, fake, admin, ids, invoices)
            answers = await p.deliver(fake.dispute(await p.paid("a"), 50))  # a partial chargeback: the invoice is owed all the same
            assert [x.get("state") for x in answers] == ["past_due", "past_due"]
            standing = await p.standing("a")
            assert standing["state"] == "past_due" and standing["suspends_at"] is not None


async def test_dispute_events_in_any_order_and_repeated_end_the_same(db_url: str, db: Any, fake: FakeStripePayments,
                                                                     tmp_path: Path) -> None:
    """a's dispute lost, b's won: all their events, interleaved, shuffled, duplicated and sent again as new
    events. a's invoice ends charged back (its account suspended), b's paid (active), whatever came first.
    Then a's chargeback is recorded settled outside Stripe: paid again, and its dispute's events again change nothing."""
    ids, invoices = await closed_september(db)
    with serve(db_url, tmp_path, **env_for(fake, "0")) as app:
        async with app.admin() as admin:
            p = Postpaid(app, fake, admin, ids, invoices)
            lost_pi, won_pi = await p.paid("a"), await p.paid("b")
            events, disputes = [], []
            for intent, won in ((lost_pi, False), (won_pi, True)):
                opened = fake.dispute(intent, reason="product_unacceptable")
                disputes.append(opened[0]["data"]["object"]["id"])
                events += opened + fake.review_dispute(disputes[-1]) + fake.close_dispute(disputes[-1], won=won)
            for order in ("reversed", "shuffled"):  # reversed: the won dispute's `created` last, its `closed` first
                await p.deliver_twice(events, order)
                a, b = await p.invoice("a"), await p.invoice("b")
                assert (a["stripe"]["chargeback_dispute_id"], b["stripe"]["chargeback_dispute_id"]) == (disputes[0], None), order
                assert a["charged_back_at"] is not None and b["charged_back_at"] is None
                assert a["charged_back_at"] == (await p.standing("a"))["delinquent_since"]
                assert ((await p.standing("a"))["state"], (await p.standing("b"))["state"]) == ("suspended", "active")
                assert (a["status"], b["status"]) == ("paid", "paid")

            # a's dispute is lost: Stripe's invoice stays paid (final); the customer pays outside it and a
            # person records that. The dispute's events, delivered again, do not make it owed again.
            settled = await admin.post(f"/admin/invoices/{a['id']}/chargeback_settled")
            assert settled.status_code == 200, settled.text
            assert settled.json()["charged_back_at"] is None and settled.json()["stripe"]["chargeback_dispute_id"] == f"settled:{disputes[0]}"
            assert (await p.standing("a"))["state"] == "active"
            await p.deliver([fake._event(e["type"], e["data"]["object"]) for e in events], "shuffled")
            assert (await p.invoice("a"))["charged_back_at"] is None and (await p.standing("a"))["state"] == "active"
            again = await admin.post(f"/admin/invoices/{a['id']}/chargeback_settled")
            assert again.status_code == 409 and again.json()["error"]["code"] == "not_charged_back"
            assert (await admin.post("/admin/invoices/999999/chargeback_settled")).status_code == 404


async def test_an_inquiry_and_a_payment_that_is_no_invoice_of_ours_change_nothing(
        db_url: str, db: Any, fake: FakeStripePayments, tmp_path: Path) -> None:
    ids, invoices = await closed_september(db)
    with serve(db_url, tmp_path, **env_for(fake, "0")) as app:
        async with app.admin() as admin:
            p = Postpaid(app, fake, admin, ids, invoices)
            intent = await p.paid("a")
            asked = fake.dispute(intent, inquiry=True)  # the bank asks first: nothing withdrawn
            dispute = asked[0]["data"]["object"]["id"]
            events = asked + fake.review_dispute(dispute) + fake.close_dispute(dispute, won=True)  # warning_closed
            assert [x["account_id"] for x in await p.deliver(events)] == [None, None, None]
            # another payment on the same Stripe account, and an invoice made there without Tollgate, both disputed
            client = StripeClient(fake.api_key, base_addresses={"api": fake.url}, max_network_retries=0)
            customer = client.v1.customers.create({"name": "someone else"})
            theirs = client.v1.invoices.create({"customer": customer.id, "collection_method": "charge_automatically",
                                                "metadata": {"tollgate_invoice": invoices[ids["a"]]["number"]}})
            client.v1.invoice_items.create({"customer": customer.id, "invoice": theirs.id, "amount": 8900, "currency": "usd"})
            client.v1.invoices.finalize_invoice(theirs.id)
            assert (await p.deliver([fake.pay(theirs.id)]))[0]["account_id"] is None
            others = fake.dispute(fake.payment_of(theirs.id)) + fake.dispute(fake.payment(900)["id"])
            assert [x["account_id"] for x in await p.deliver(others)] == [None] * 4
            shown = await p.invoice("a")
            assert (shown["status"], shown["charged_back_at"], shown["stripe"]["chargeback_dispute_id"]) == ("paid", None, None)
            assert (await p.standing("a"))["state"] == "active" and (await p.standing("a"))["unpaid_invoices"] == []


async def _suspended(app: Any, principal: Any) -> bool:
    return app.billing.states.suspension(principal) is not None  # type: ignore[no-any-return]


async def _not_suspended(app: Any, principal: Any) -> bool:
    return app.billing.states.suspension(principal) is None  # type: ignore[no-any-return]
