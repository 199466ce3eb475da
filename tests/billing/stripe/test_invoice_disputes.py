"""Chargebacks on the payments of postpaid invoices (billing/stripe/invoice_disputes.py), through the
real gateway: the official SDK against the FAKE Stripe, signed deliveries. Stripe leaves the invoice
`paid`; the dispute comes as charge.dispute.* about a PaymentIntent with none of Tollgate's metadata,
tied to its invoice only by an InvoicePayment. A chargeback makes the invoice owed again (shown
charged back, the account delinquent from the dispute's creation and suspended after the grace
period, as a failed payment would) for what the dispute took back (a partial dispute: its part); a won
dispute makes it paid again; an invoice paid by two payments, or a payment disputed twice, keeps each
dispute; events in any order, and repeated, end the same; an inquiry, and a dispute of a payment that is
no invoice of ours, change nothing. The invoice's documents show its chargebacks. A chargeback settled
outside Stripe whose dispute is then won was paid twice: a refund is due, shown and logged once."""

from __future__ import annotations

import asyncio
import html
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from stripe import StripeClient

from billing.invoices.views import get_invoice
from billing.keys.store import KeyStore
from billing.stripe.invoice_disputes import INVOICES, InvoicePayment, chargeback
from gateway.dashboard.billing import invoice_rows
from tests.billing.invoice_helpers import App, new_key, serve
from tests.billing.invoices.test_invoice_documents import pdf_text
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

    async def paid(self, name: str, parts: list[int] | None = None) -> str:
        """The account's invoice pushed, paid on Stripe (in `parts`: several payments), invoice.paid
        delivered: its (last) PaymentIntent."""
        ours = self.invoices[self.ids[name]]["id"]
        assert (await self.admin.post(f"/admin/invoices/{ours}/sync")).json()["stripe_status"] == "open"
        remote = (await self.invoice(name))["stripe"]["invoice_id"]
        assert (await self.deliver([self.fake.pay(remote, parts)]))[0]["state"] == "active"
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
            assert shown["charged_back_at"] is not None and shown["chargeback_cents"] == 89
            assert [(c["dispute_id"], c["status"], c["disputed_cents"], c["amount_cents"], c["owed"]) for c in shown["chargebacks"]] == [
                (dispute["id"], "needs_response", 89, 89, True)]
            assert shown["stripe"]["chargeback_dispute_id"] == dispute["id"]  # the field of before, kept
            standing = await p.standing("a")
            assert standing["state"] == "suspended" and standing["delinquent_since"] == shown["charged_back_at"]
            assert [(u["number"], u["total_cents"], u["amount_owed_cents"], u["charged_back_at"]) for u in standing["unpaid_invoices"]] == [
                (invoices[ids["a"]]["number"], 89, 89, shown["charged_back_at"])]
            await wait_for(lambda: _suspended(app, principal))
            reason = app.billing.states.suspension(principal)
            assert reason is not None and invoices[ids["a"]]["number"] in reason and "0.89 USD" in reason
            async with app.as_key(key) as customer:  # the customer's own view says so too
                mine = (await customer.get(f"/v1/invoices/{invoices[ids['a']]['id']}")).json()
                assert mine["status"] == "paid" and mine["charged_back_at"] == shown["charged_back_at"]
                assert mine["chargeback_cents"] == 89 and "dispute_id" not in mine["chargebacks"][0]  # Stripe's ids: the admin's
            assert (await p.standing("b"))["state"] == "active"  # b's invoice is not paid on Stripe: no date counts

            # evidence submitted (under review: the money is still withdrawn), then won: paid again, active
            assert (await p.deliver(fake.review_dispute(dispute["id"])))[0]["state"] == "suspended"
            closed = await p.deliver(fake.close_dispute(dispute["id"], won=True))
            assert [x["state"] for x in closed] == ["active", "active"]
            shown = await p.invoice("a")
            assert shown["charged_back_at"] is None and shown["chargeback_cents"] == 0
            assert [(c["status"], c["disputed_cents"], c["amount_cents"], c["owed"]) for c in shown["chargebacks"]] == [("won", 89, 0, False)]
            assert shown["stripe"]["chargeback_dispute_id"] is None
            assert (await p.standing("a"))["unpaid_invoices"] == []
            await wait_for(lambda: _not_suspended(app, principal))


async def test_a_partial_chargeback_owes_the_disputed_amount_with_a_grace_period(
        db_url: str, db: Any, fake: FakeStripePayments, tmp_path: Path) -> None:
    """A dispute of 50 cents of an 89-cent invoice's payment: 50 cents are owed again, not 89, in the
    views, the account's state, the suspension message and the invoice's documents; the grace period
    applies as to a failed payment."""
    ids, invoices = await closed_september(db)
    key = await new_key(db, ids["a"])
    principal = await KeyStore(db, SECRET.encode()).authenticate(key)
    with serve(db_url, tmp_path, **env_for(fake, "3600")) as app:
        async with app.admin() as admin:
            p = Postpaid(app, fake, admin, ids, invoices)
            answers = await p.deliver(fake.dispute(await p.paid("a"), 50))  # a partial chargeback
            assert [x.get("state") for x in answers] == ["past_due", "past_due"]
            standing = await p.standing("a")
            assert standing["state"] == "past_due" and standing["suspends_at"] is not None
            assert [(u["total_cents"], u["amount_owed_cents"], u["amount_owed"]) for u in standing["unpaid_invoices"]] == [(89, 50, "0.50")]
            shown = await p.invoice("a")
            assert (shown["chargeback_cents"], [(c["disputed_cents"], c["amount_cents"]) for c in shown["chargebacks"]]) == (50, [(50, 50)])
            later = datetime.now(timezone.utc) + timedelta(hours=2)  # past the grace period: the message names 50 cents

            async def names_the_chargeback() -> bool:
                return "(0.50 USD)" in (app.billing.states.suspension(principal, now=later) or "")

            await wait_for(names_the_chargeback)
            # the invoice's documents say so: the disputed amount, its date, its status, what is owed again
            day = shown["charged_back_at"][:10]
            page = (await admin.get(f"/admin/invoices/{shown['id']}/html")).text
            pdf = pdf_text((await admin.get(f"/admin/invoices/{shown['id']}/pdf")).content)
            line = f"Chargeback of $0.50 USD disputed by the cardholder's bank on {day} (dispute open): $0.50 taken back, owed again"
            assert html.escape(line) in page and "<td>Charged back, owed again</td><td class=n>$0.50</td>" in page
            assert " ".join(pdf.split()).count(line) == 1 and "Charged back, owed again: $0.50" in pdf, pdf
            async with app.as_key(key) as customer:
                mine = (await customer.get(f"/v1/invoices/{shown['id']}/html")).text
                assert html.escape(line) in mine


async def test_several_disputes_of_one_invoice_each_count_until_won_or_settled(
        db_url: str, db: Any, fake: FakeStripePayments, tmp_path: Path) -> None:
    """a's 89-cent invoice paid by two payments (39 and 50 cents, Stripe's partial payments): the first
    disputed in full, the second for 20 cents; then the first dispute won and the first payment disputed
    again (a re-filed dispute: support.stripe.com's multiple-disputes FAQ). Each dispute is kept; what is
    owed is the sum of those that have the money. chargeback_settled settles one dispute
    ({"dispute_id"}) or, without a body, every one of the invoice's."""
    ids, invoices = await closed_september(db)
    with serve(db_url, tmp_path, **env_for(fake, "0")) as app:
        async with app.admin() as admin:
            p = Postpaid(app, fake, admin, ids, invoices)
            await p.paid("a", parts=[39, 50])
            first_pi, second_pi = fake.payments_of((await p.invoice("a"))["stripe"]["invoice_id"])

            async def owed() -> tuple[int, list[tuple[str, int]], list[int], str]:
                shown, standing = await p.invoice("a"), await p.standing("a")
                return (shown["chargeback_cents"], [(c["status"], c["amount_cents"]) for c in shown["chargebacks"]],
                        [u["amount_owed_cents"] for u in standing["unpaid_invoices"]], standing["state"])

            first = fake.dispute(first_pi)
            second = fake.dispute(second_pi, 20, "product_unacceptable")
            du = [first[0]["data"]["object"]["id"], second[0]["data"]["object"]["id"]]
            await p.deliver(second + first, "shuffled")
            assert await owed() == (59, [("needs_response", 39), ("needs_response", 20)], [59], "suspended")
            await p.deliver(fake.close_dispute(du[0], won=True))
            assert await owed() == (20, [("won", 0), ("needs_response", 20)], [20], "suspended")
            refiled = fake.dispute(first_pi, 39)
            du.append(refiled[0]["data"]["object"]["id"])
            await p.deliver(refiled)
            assert await owed() == (59, [("won", 0), ("needs_response", 20), ("needs_response", 39)], [59], "suspended")
            assert [c["dispute_id"] for c in (await p.invoice("a"))["chargebacks"]] == du

            # the re-filed one settled outside Stripe (the customer paid those 39 cents), one dispute at a time
            invoice_id = (await p.invoice("a"))["id"]
            settle = f"/admin/invoices/{invoice_id}/chargeback_settled"
            done = await admin.post(settle, json={"dispute_id": du[2]})
            assert done.status_code == 200, done.text
            assert [(c["status"], c["amount_cents"]) for c in done.json()["chargebacks"]] == [("won", 0), ("needs_response", 20), ("settled", 39)]
            assert await owed() == (20, [("won", 0), ("needs_response", 20), ("settled", 39)], [20], "suspended")
            won = await admin.post(settle, json={"dispute_id": du[0]})  # won: nothing owed to settle
            assert won.status_code == 409 and won.json()["error"]["code"] == "not_charged_back"
            unknown = await admin.post(settle, json={"dispute_id": "du_not_this_invoices"})
            assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "dispute_id"
            assert (await admin.post(settle, json={"dispute_id": 7})).status_code == 400
            await p.deliver(fake.close_dispute(du[2], won=False))  # its later events change it no more
            assert await owed() == (20, [("won", 0), ("needs_response", 20), ("settled", 39)], [20], "suspended")
            everything = await admin.post(settle)  # no body: every chargeback of the invoice still owed
            assert everything.status_code == 200, everything.text
            assert await owed() == (0, [("won", 0), ("settled", 20), ("settled", 39)], [], "active")
            assert (await admin.post(settle)).status_code == 409


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
                assert [(c["dispute_id"], c["status"], c["amount_cents"]) for c in a["chargebacks"] + b["chargebacks"]] == [
                    (disputes[0], "lost", 89), (disputes[1], "won", 0)], order
                assert (a["chargeback_cents"], b["chargeback_cents"]) == (89, 0)
                assert a["charged_back_at"] is not None and b["charged_back_at"] is None
                assert a["charged_back_at"] == (await p.standing("a"))["delinquent_since"]
                assert ((await p.standing("a"))["state"], (await p.standing("b"))["state"]) == ("suspended", "active")
                assert (a["status"], b["status"]) == ("paid", "paid")

            # a's dispute is lost: Stripe's invoice stays paid (final); the customer pays outside it and a
            # person records that. The dispute's events, delivered again, do not make it owed again.
            settled = await admin.post(f"/admin/invoices/{a['id']}/chargeback_settled")
            assert settled.status_code == 200, settled.text
            assert settled.json()["charged_back_at"] is None and settled.json()["chargeback_cents"] == 0
            assert [(c["dispute_id"], c["status"], c["dispute_status"]) for c in settled.json()["chargebacks"]] == [
                (disputes[0], "settled", "lost")] and settled.json()["chargebacks"][0]["settled_at"] is not None
            assert (await p.standing("a"))["state"] == "active"
            # what the code before 0026 reads during a rolling update: the settled marker it kept, so it
            # too leaves that dispute's later events alone; b's won dispute: nothing
            async with db.connect() as conn:
                marks = (await conn.execute(sa.select(INVOICES.c.id, INVOICES.c.chargeback_dispute_id)
                                            .where(INVOICES.c.id.in_([a["id"], b["id"]])).order_by(INVOICES.c.id))).all()
            assert [m.chargeback_dispute_id for m in marks] == [f"settled:{disputes[0]}", None]
            assert settled.json()["stripe"]["chargeback_dispute_id"] is None  # the view: the earliest owed, none
            await p.deliver([fake._event(e["type"], e["data"]["object"]) for e in events], "shuffled")
            assert (await p.invoice("a"))["charged_back_at"] is None and (await p.standing("a"))["state"] == "active"
            again = await admin.post(f"/admin/invoices/{a['id']}/chargeback_settled")
            assert again.status_code == 409 and again.json()["error"]["code"] == "not_charged_back"
            assert (await admin.post("/admin/invoices/999999/chargeback_settled")).status_code == 404


async def test_a_settled_chargeback_whose_dispute_is_then_won_is_a_refund_due_until_recorded_refunded(
        db_url: str, db: Any, fake: FakeStripePayments, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """a's 89 cents charged back and settled outside Stripe (the customer paid them again), then the
    dispute won: the bank returns the 89 cents too, so the customer paid twice. The views (admin's and
    the customer's), the documents and the dashboard show 89 cents to refund, one warning is logged
    when the won event arrives (not again for its repeats, nor for all the dispute's events sent again
    in any order), and chargeback_refunded records the refund: nothing due after, whatever comes. b's
    chargeback settled (by a process of the code before 0027: no settled_cents), then its dispute lost
    with 30 cents reinstated ("partially won"): 30 due."""
    ids, invoices = await closed_september(db)
    key = await new_key(db, ids["a"])
    with serve(db_url, tmp_path, **env_for(fake, "0")) as app:
        async with app.admin() as admin:
            p = Postpaid(app, fake, admin, ids, invoices)
            opened = fake.dispute(await p.paid("a"))
            du = opened[0]["data"]["object"]["id"]
            await p.deliver(opened)
            invoice_id = (await p.invoice("a"))["id"]
            settled = (await admin.post(f"/admin/invoices/{invoice_id}/chargeback_settled")).json()
            assert (settled["refund_due_cents"], [(c["settled_cents"], c["refund_due_cents"]) for c in settled["chargebacks"]]) == (0, [(89, 0)])

            def warnings() -> list[str]:
                return [r.getMessage() for r in caplog.records if r.name == "tollgate.invoice_disputes" and r.levelname == "WARNING"]

            with caplog.at_level("WARNING", logger="tollgate.invoice_disputes"):
                won = fake.close_dispute(du, won=True)  # closed (won), funds_reinstated
                await p.deliver_twice(won, "as sent")
                assert len(warnings()) == 1 and f"invoice {invoice_id} paid twice" in warnings()[0] and "refund 89 usd" in warnings()[0]
                await p.deliver([fake._event(e["type"], e["data"]["object"]) for e in opened + won], "shuffled")
                assert len(warnings()) == 1, warnings()

            shown = await p.invoice("a")
            assert (shown["chargeback_cents"], shown["refund_due_cents"], shown["refund_due"]) == (0, 89, "0.89")
            assert [(c["status"], c["dispute_status"], c["amount_cents"], c["settled_cents"], c["refund_due_cents"], c["refunded_cents"])
                    for c in shown["chargebacks"]] == [("settled", "won", 0, 89, 89, 0)]
            assert (await p.standing("a"))["state"] == "active"  # a refund due is ours to pay: the account owes nothing
            async with app.as_key(key) as customer:
                mine = (await customer.get(f"/v1/invoices/{invoice_id}")).json()
                assert (mine["refund_due_cents"], mine["chargebacks"][0]["refund_due_cents"]) == (89, 89)
                page = (await customer.get(f"/v1/invoices/{invoice_id}/html")).text
            day, paid_again = shown["chargebacks"][0]["disputed_at"][:10], shown["chargebacks"][0]["settled_at"][:10]
            line = (f"Chargeback of $0.89 USD disputed by the cardholder's bank on {day} (dispute won): $0.89 paid again on {paid_again}, "
                    "nothing owed; $0.89 returned by the bank too, paid twice: $0.89 to be refunded to you")
            assert html.escape(line) in page and "<td>Paid twice, to be refunded</td><td class=n>$0.89</td>" in page
            pdf = pdf_text((await admin.get(f"/admin/invoices/{invoice_id}/pdf")).content)
            assert line in " ".join(pdf.split()) and "Paid twice, to be refunded: $0.89" in pdf, pdf
            assert invoice_rows([shown], admin=True)[0]["status"] == "paid, paid twice: refund $0.89"  # the dashboards' tables

            # the operator refunds the 89 cents (Stripe, or a credit note) and records it
            refunded = f"/admin/invoices/{invoice_id}/chargeback_refunded"
            unknown = await admin.post(refunded, json={"dispute_id": "du_not_this_invoices"})
            assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "dispute_id"
            done = await admin.post(refunded, json={"dispute_id": du})
            assert done.status_code == 200, done.text
            assert (done.json()["refund_due_cents"], [(c["refund_due_cents"], c["refunded_cents"]) for c in done.json()["chargebacks"]]) == (
                0, [(0, 89)]) and done.json()["chargebacks"][0]["refunded_at"] is not None
            again = await admin.post(refunded)
            assert again.status_code == 409 and again.json()["error"]["code"] == "no_refund_due"
            with caplog.at_level("WARNING", logger="tollgate.invoice_disputes"):
                await p.deliver([fake._event(e["type"], e["data"]["object"]) for e in opened + won], "shuffled")
                assert len(warnings()) == 1, warnings()
            assert (await p.invoice("a"))["refund_due_cents"] == 0
            assert "refunded on" in (await admin.get(f"/admin/invoices/{invoice_id}/html")).text

            # b: settled, then lost with 30 cents reinstated: those 30 were paid twice
            opened = fake.dispute(await p.paid("b"))
            await p.deliver(opened)
            b_id = (await p.invoice("b"))["id"]
            assert (await admin.post(f"/admin/invoices/{b_id}/chargeback_settled")).status_code == 200
            async with db.begin() as conn:  # settled as a process of the code before 0027 settles (a rolling update): no settled_cents
                await conn.execute(sa.text("UPDATE invoice_chargebacks SET settled_cents = NULL WHERE invoice_id = :i"), {"i": b_id})
            await p.deliver(fake.close_dispute(opened[0]["data"]["object"]["id"], won=False, reinstated=30), "reversed")
            b = await p.invoice("b")
            assert [(c["dispute_status"], c["settled_cents"], c["amount_cents"], c["refund_due_cents"]) for c in b["chargebacks"]] == [
                ("lost", b["total_cents"], b["total_cents"] - 30, 30)] and b["refund_due_cents"] == 30


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
            assert (shown["status"], shown["charged_back_at"], shown["chargeback_cents"], shown["chargebacks"]) == ("paid", None, 0, [])
            assert (await p.standing("a"))["state"] == "active" and (await p.standing("a"))["unpaid_invoices"] == []


async def _suspended(app: Any, principal: Any) -> bool:
    return app.billing.states.suspension(principal) is not None  # type: ignore[no-any-return]


async def _not_suspended(app: Any, principal: Any) -> bool:
    return app.billing.states.suspension(principal) is None  # type: ignore[no-any-return]


async def test_a_dispute_of_a_payment_of_two_invoices_is_split_over_them(db: Any) -> None:
    """One PaymentIntent attached to two invoices (InvoicePayment.amount_paid says what each got): a
    dispute of 100 cents takes a's 89 first (its InvoicePayment the older), the rest from b; lost with
    30 reinstated, 70 is taken back: a's 70 alone. Exact cents, per invoice."""
    ids, invoices = await closed_september(db)
    a, b = invoices[ids["a"]], invoices[ids["b"]]
    async with db.begin() as conn:
        for ours, remote in ((a, "in_a"), (b, "in_b")):
            await conn.execute(INVOICES.update().where(INVOICES.c.id == ours["id"]).values(status="paid", stripe_invoice_id=remote))
    paid = [InvoicePayment("in_a", 89, "usd"), InvoicePayment("in_b", b["total_cents"], "usd")]
    dispute = {"id": "du_both", "status": "needs_response", "amount": 100, "currency": "usd", "created": 1_796_000_000, "payment_intent": "pi_both"}
    for status, withdrawn, reinstated, expected in (("needs_response", 100, 0, (89, min(11, b["total_cents"]))), ("lost", 100, 30, (70, 0))):
        apply = chargeback({**dispute, "status": status}, paid, withdrawn, reinstated)
        assert apply is not None
        async with db.begin() as conn:
            assert await apply(conn) == ids["a"]
        shown = [await get_invoice(db, x["id"]) for x in (a, b)]
        assert tuple(s["chargeback_cents"] for s in shown if s) == expected, status
        assert [c["disputed_cents"] for s in shown if s for c in s["chargebacks"]] == [89, min(11, b["total_cents"])]


async def test_two_disputes_of_one_invoice_applied_at_once_both_count(db: Any) -> None:
    """Two disputes of one invoice's payments (300 and 400 cents of a's total) whose events arrive at
    once: the second waits for the first's transaction (the invoice's row lock), then its sum reads
    both rows. Without the lock it summed before the first committed and wrote last: 400, not 700
    (a review's repro)."""
    ids, invoices = await closed_september(db)
    a = invoices[ids["a"]]
    async with db.begin() as conn:
        await conn.execute(INVOICES.update().where(INVOICES.c.id == a["id"]).values(status="paid", stripe_invoice_id="in_a", total_cents=1000))
    paid = [InvoicePayment("in_a", 1000, "usd")]
    first, second = (chargeback({"id": du, "status": "needs_response", "amount": cents, "currency": "usd", "created": 1_796_000_000 + i,
                                 "payment_intent": f"pi_{du}"}, paid, cents, 0) for i, (du, cents) in enumerate((("du_1", 300), ("du_2", 400))))
    assert first is not None and second is not None
    async with db.connect() as holder, db.connect() as watcher:
        pid = (await holder.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one()
        await holder.commit()
        async with holder.begin():
            await first(holder)  # not committed yet

            async def apply_second() -> None:
                async with db.begin() as conn:
                    await second(conn)

            task = asyncio.create_task(apply_second())
            deadline = asyncio.get_running_loop().time() + 30
            while not (await watcher.execute(sa.text(  # the second event blocked behind the first's transaction
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND :pid = ANY(pg_blocking_pids(pid))"),
                    {"pid": pid})).scalar_one():
                assert asyncio.get_running_loop().time() < deadline and not task.done(), "the second event never waited"
                await watcher.commit()
        await task
    shown = await get_invoice(db, a["id"])
    assert shown is not None
    assert (shown["chargeback_cents"], shown["stripe"]["chargeback_dispute_id"]) == (700, "du_1")
