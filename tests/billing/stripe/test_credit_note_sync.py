"""Credit notes on Stripe exactly once (billing/stripe/sync.py), through the gateway's admin API on
real Postgres with Stripe as the fake server: a note whose push failed is sent by the next sync of
its invoice and by the periodic push, whatever our invoice's status is now (a void one included);
a note an earlier run made on Stripe whose response was lost is found by metadata and adopted, not
made again (after its idempotency key expired, and within the key's life when the invoice's state
changed the parameters); an invoice voided by a credit note stays void when Stripe marks it paid."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from billing.config import BillingConfig
from billing.invoices.scheduler import MonthlyClose
from billing.prices.book import PriceBook
from billing.stripe.sync import StripeSync, stripe_client
from tests.billing.invoice_helpers import at, serve
from tests.billing.invoices.test_invoices import september
from tests.fakes.stripe_server import FakeStripe

NOTES = r"/v1/credit_notes"


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    server = FakeStripe().start()
    yield server
    server.stop()


def env_for(fake: FakeStripe) -> dict[str, str]:
    return {"TOLLGATE_STRIPE_API_KEY": fake.api_key, "TOLLGATE_STRIPE_API_BASE": fake.url,
            "TOLLGATE_STRIPE_WEBHOOK_SECRET": fake.webhook_secret, "TOLLGATE_STRIPE_MAX_RETRIES": "0",
            "TOLLGATE_STRIPE_SYNC_AFTER_CLOSE": "1"}


async def on_stripe(admin: Any, ids: dict[str, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """September closed and pushed: a's (89 cents) and b's (51 cents) invoices open on Stripe."""
    assert (await admin.post("/admin/invoices/close", json={"period": "2026-09"})).status_code == 200
    invoices = {i["account_id"]: i for i in (await admin.get("/admin/invoices")).json()["data"]}
    a, b = invoices[ids["a"]], invoices[ids["b"]]
    assert (a["total_cents"], b["total_cents"]) == (89, 51)
    assert a["stripe"]["status"] == b["stripe"]["status"] == "open"
    return a, b


async def note_of(admin: Any, note_id: int) -> dict[str, Any]:
    return (await admin.get(f"/admin/credit_notes/{note_id}")).json()  # type: ignore[no-any-return]


async def test_a_void_whose_credit_note_failed_to_reach_stripe_is_sent_by_the_invoice_sync(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    ids = await september(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            a, _ = await on_stripe(admin, ids)
            remote = fake.invoices[a["stripe"]["invoice_id"]]
            fake.fail("POST", NOTES, 500)
            r = await admin.post(f"/admin/invoices/{a['id']}/credit_notes", json={"reason": "duplicate"})
            note = r.json()
            assert r.status_code == 201 and note["kind"] == "void" and note["total_cents"] == 89, r.text
            assert note["stripe"]["result"].startswith("error"), note
            assert (await admin.get(f"/admin/invoices/{a['id']}")).json()["status"] == "void"
            assert fake.credit_notes == {} and remote["status"] == "open" and remote["amount_remaining"] == 89  # Stripe would collect it

            r = await admin.post(f"/admin/invoices/{a['id']}/sync")
            assert r.status_code == 200 and r.json()["result"] == "credit notes synced", r.text
            [remote_note] = fake.credit_notes.values()
            assert remote_note["metadata"] == {"tollgate_credit_note": note["number"], "tollgate_invoice": a["number"]}
            assert (remote_note["pre_payment_amount"], remote_note["post_payment_amount"]) == (89, 0)
            assert remote["status"] == "paid" and remote["amount_remaining"] == 0 and remote["amount_paid"] == 0  # nothing collected
            assert (await note_of(admin, note["id"]))["stripe_credit_note_id"] == remote_note["id"]

            posts = fake.count("POST", NOTES)
            again = (await admin.post(f"/admin/invoices/{a['id']}/sync")).json()
            assert again["result"] == "skipped: nothing to collect" and fake.count("POST", NOTES) == posts and len(fake.credit_notes) == 1


async def test_the_periodic_push_sends_every_credit_note_that_failed_to_reach_stripe(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    """A partial note on an open invoice already synced and a void's note: push_pending (the monthly
    job's tick) sends both, once; a second tick sends nothing."""
    ids = await september(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            a, b = await on_stripe(admin, ids)
            fake.fail("POST", NOTES, 500, times=2)
            partial = (await admin.post(f"/admin/invoices/{a['id']}/credit_notes", json={"amount_cents": 30})).json()
            void = (await admin.post(f"/admin/invoices/{b['id']}/credit_notes", json={})).json()
            assert partial["stripe"]["result"].startswith("error") and void["stripe"]["result"].startswith("error")
            assert (await admin.get(f"/admin/invoices/{b['id']}")).json()["status"] == "void"
            assert fake.credit_notes == {}

            config = BillingConfig.from_mapping({**env_for(fake), "TOLLGATE_BILLING_CLOSE_DELAY_SECONDS": "3600"})
            job = MonthlyClose(db, PriceBook(db), config, stripe=StripeSync(db, stripe_client(config), config), clock=lambda: at(10, 1, 2))
            await job.tick()
            by_number = {n["metadata"]["tollgate_credit_note"]: n for n in fake.credit_notes.values()}
            assert set(by_number) == {partial["number"], void["number"]}
            assert by_number[partial["number"]]["invoice"] == a["stripe"]["invoice_id"] and by_number[partial["number"]]["pre_payment_amount"] == 30
            assert by_number[void["number"]]["invoice"] == b["stripe"]["invoice_id"] and by_number[void["number"]]["pre_payment_amount"] == 51
            remote_a, remote_b = fake.invoices[a["stripe"]["invoice_id"]], fake.invoices[b["stripe"]["invoice_id"]]
            assert (remote_a["status"], remote_a["amount_remaining"]) == ("open", 59)
            assert (remote_b["status"], remote_b["amount_remaining"], remote_b["amount_paid"]) == ("paid", 0, 0)
            for note in (partial, void):
                assert (await note_of(admin, note["id"]))["stripe_credit_note_id"] == by_number[note["number"]]["id"]

            posts = fake.count("POST", NOTES)
            await job.tick()
            assert fake.count("POST", NOTES) == posts and len(fake.credit_notes) == 2


async def test_a_credit_note_made_on_stripe_whose_response_was_lost_is_adopted_not_made_again(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    ids = await september(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            a, b = await on_stripe(admin, ids)
            # a partial note: Stripe makes it, the response is lost; a day passes (the key expires)
            fake.fail("POST", NOTES, 0)
            partial = (await admin.post(f"/admin/invoices/{a['id']}/credit_notes", json={"amount_cents": 9})).json()
            assert partial["stripe"]["result"].startswith("error") and len(fake.credit_notes) == 1
            fake.forget_idempotency_keys()
            assert (await admin.post(f"/admin/invoices/{a['id']}/sync")).json()["result"] == "synced"
            [made] = fake.credit_notes.values()
            assert (await note_of(admin, partial["id"]))["stripe_credit_note_id"] == made["id"]
            assert fake.invoices[a["stripe"]["invoice_id"]]["amount_remaining"] == 80  # credited once

            # a void's note: made, response lost; Stripe now shows the invoice paid, so a new create's
            # parameters (all to the balance) differ from the stored key's: adopted, not an idempotency error
            fake.fail("POST", NOTES, 0)
            void = (await admin.post(f"/admin/invoices/{b['id']}/credit_notes", json={})).json()
            assert void["stripe"]["result"].startswith("error") and len(fake.credit_notes) == 2
            r = await admin.post(f"/admin/invoices/{b['id']}/sync")
            assert r.status_code == 200 and r.json()["result"] == "credit notes synced", r.text
            [made_b] = [n for n in fake.credit_notes.values() if n["invoice"] == b["stripe"]["invoice_id"]]
            assert (await note_of(admin, void["id"]))["stripe_credit_note_id"] == made_b["id"] and len(fake.credit_notes) == 2
            customer = fake.customers[fake.invoices[b["stripe"]["invoice_id"]]["customer"]]
            assert customer["balance"] == 0 and made_b["post_payment_amount"] == 0  # nothing credited twice to the balance


async def test_an_invoice_voided_by_a_credit_note_stays_void_when_stripe_marks_it_paid(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    ids = await september(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            a, b = await on_stripe(admin, ids)
            void = (await admin.post(f"/admin/invoices/{a['id']}/credit_notes", json={})).json()
            assert void["stripe"]["result"] == "synced"
            remote_id = a["stripe"]["invoice_id"]
            assert fake.invoices[remote_id]["status"] == "paid" and fake.invoices[remote_id]["amount_paid"] == 0
            for kind in ("invoice.updated", "invoice.paid"):  # the handler re-reads the invoice whatever the kind
                r = await fake.deliver(fake.invoice_event(kind, remote_id), app.base_url + "/webhooks/stripe")
                assert r.status_code == 200, r.text
            ours = (await admin.get(f"/admin/invoices/{a['id']}")).json()
            assert ours["status"] == "void" and ours["paid_at"] is None and ours["stripe"]["status"] == "paid"

            paid = fake.pay(b["stripe"]["invoice_id"])  # an invoice really paid still becomes paid
            assert (await fake.deliver(paid, app.base_url + "/webhooks/stripe")).status_code == 200
            assert (await admin.get(f"/admin/invoices/{b['id']}")).json()["status"] == "paid"


async def test_a_credit_note_on_an_invoice_stripe_wrote_off_never_leaves_stripe_collecting_what_we_credited(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    """Stripe takes credit notes on open or paid invoices only, and an uncollectible invoice can still
    be paid. A note that takes all of ours voids Stripe's (the customer can no longer pay what we
    voided); a partial one waits, and reaches the customer's balance once the invoice is paid."""
    ids = await september(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            a, b = await on_stripe(admin, ids)
            remote_a, remote_b = fake.invoices[a["stripe"]["invoice_id"]], fake.invoices[b["stripe"]["invoice_id"]]
            for remote in (remote_a, remote_b):
                event = fake.mark_uncollectible(remote["id"])
                assert (await fake.deliver(event, app.base_url + "/webhooks/stripe")).status_code == 200

            void = (await admin.post(f"/admin/invoices/{b['id']}/credit_notes", json={})).json()
            assert void["kind"] == "void" and void["stripe"]["result"].startswith("synced: the uncollectible Stripe invoice voided"), void
            assert remote_b["status"] == "void" and remote_b["amount_paid"] == 0 and fake.credit_notes == {}
            ours_b = (await admin.get(f"/admin/invoices/{b['id']}")).json()
            assert ours_b["status"] == "void" and ours_b["stripe"]["status"] == "void"

            partial = (await admin.post(f"/admin/invoices/{a['id']}/credit_notes", json={"amount_cents": 30})).json()
            assert partial["stripe"]["result"].startswith("skipped: the Stripe invoice is uncollectible"), partial
            note = await note_of(admin, partial["id"])
            assert note["stripe_credit_note_id"] is None, note
            assert remote_a["status"] == "uncollectible" and fake.credit_notes == {}

            paid = fake.pay(remote_a["id"])  # the customer pays the whole 89 cents after all
            assert (await fake.deliver(paid, app.base_url + "/webhooks/stripe")).status_code == 200
            r = await admin.post(f"/admin/invoices/{a['id']}/sync")
            assert r.status_code == 200, r.text
            [made] = fake.credit_notes.values()
            assert (made["invoice"], made["pre_payment_amount"], made["post_payment_amount"]) == (remote_a["id"], 0, 30)
            assert fake.customers[remote_a["customer"]]["balance"] == -30  # the 30 cents credited, for the next invoice
            assert (await note_of(admin, partial["id"]))["stripe_credit_note_id"] == made["id"]
