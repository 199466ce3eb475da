"""An invoice below Stripe's minimum charge (USD $0.50), end to end through the gateway's admin API on
real Postgres with Stripe as the fake server (tests/fakes/stripe_server.py): Stripe charges nothing,
marks the invoice paid and adds the amount to the customer's balance as a debit (`invoice_too_small`),
which the next invoice collects. Ours is paid and says that nothing was charged and the amount was
carried to the next invoice (`carried_to_next_cents`); the next one says what it carries in and its
amount due is what Stripe collects. Before: the push called Stripe's carried debit a credit mismatch
(an error waiting for a person), the invoice read plain "paid" with $0.30 due, and the next invoice
said $10.00 due while Stripe charged $10.30."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.dashboard.billing import invoice_rows
from tests.billing.invoice_helpers import serve
from tests.billing.stripe.test_credit_note_sync import env_for, fake  # noqa: F401  (fake: the fixture)
from tests.billing.stripe.test_customer_balance import Month, customer_of
from tests.fakes.stripe_server import FakeStripe

FINALIZE = r"/v1/invoices/[^/]+/finalize"


def txns(fake: FakeStripe) -> list[tuple[str, int]]:
    return [(t["type"], t["amount"]) for t in fake.balance_transactions.values()]


@pytest.mark.parametrize("method", ["charge_automatically", "send_invoice"])
async def test_an_invoice_below_the_minimum_charge_is_paid_by_carrying_it_to_the_next_invoice(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path, method: str) -> None:
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake), TOLLGATE_STRIPE_COLLECTION_METHOD=method) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            june = await m.invoice(6, 30)  # $0.30: closed and pushed
            remote = m.remote(june)
            assert (remote["status"], remote["amount_due"], remote["amount_paid"], remote["total"]) == ("paid", 0, 0, 30)
            assert txns(fake) == [("invoice_too_small", 30)] and m.stripe_balance() == -30  # a debit on the customer
            assert june["stripe"]["error"] is None and june["stripe"]["total_cents"] == 30, june["stripe"]
            assert (june["status"], june["carried_to_next_cents"], june["amount_due_cents"]) == ("paid", 30, 0)
            assert june["paid_at"] is not None and fake.sent == {}  # nothing charged, nothing sent to pay
            [row] = invoice_rows([june], admin=True)
            assert row["status"] == "paid, nothing charged: $0.30 carried to the next invoice" and row["amount_due"] == "$0.00"
            html = (await admin.get(f"/admin/invoices/{june['id']}/html")).text
            assert "Carried to the next invoice (below the minimum charge)" in html and "nothing charged" in html

            # Stripe's events for it (invoice.finalized, invoice.paid) change nothing of that
            for event in fake.events:
                assert (await fake.deliver(event, app.base_url + "/webhooks/stripe")).status_code == 200
            assert await m.ours("2026-06") == june

            # July, $10: Stripe collects it and June's $0.30; ours says so
            july = await m.invoice(7, 1_000)
            assert july["stripe"]["error"] is None, july["stripe"]
            assert (july["carried_in_cents"], july["amount_due_cents"]) == (30, 1_030) == (30, m.remote(july)["amount_due"])
            html = (await admin.get(f"/admin/invoices/{july['id']}/html")).text
            assert "Carried from earlier invoices (below the minimum charge)" in html and "$10.30" in html
            await m.pay(july)
            assert m.stripe_balance() == 0 and txns(fake) == [("invoice_too_small", 30), ("applied_to_invoice", -30)]
            collected = sum(i["amount_paid"] for i in fake.invoices.values())
            assert collected == june["total_cents"] + july["total_cents"] == 1_030  # every cent once


async def test_the_webhook_says_what_was_carried_when_the_push_lost_stripes_answer(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    """The finalize ran on Stripe but its answer was lost (the close's push failed): invoice.paid tells
    ours that it is paid, with nothing charged and $0.30 carried."""
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            fake.fail("POST", FINALIZE, 0)
            june = await m.invoice(6, 45)
            assert june["status"] == "open" and june["stripe"]["error"], june["stripe"]
            assert m.remote(june)["status"] == "paid" and txns(fake) == [("invoice_too_small", 45)]
            paid = next(e for e in fake.events if e["type"] == "invoice.paid")
            assert (await fake.deliver(paid, app.base_url + "/webhooks/stripe")).status_code == 200
            june = await m.ours("2026-06")
            assert (june["status"], june["carried_to_next_cents"], june["amount_due_cents"]) == ("paid", 45, 0)


async def test_a_credit_and_a_carried_debit_meet_on_the_next_invoice(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    """June $1 paid, a $0.80 credit note on it; July $1.10 applies the $0.80 and leaves $0.30, below
    the minimum: carried; August $5 collects $5.30. Stripe applies our credit exactly each time."""
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            june = await m.invoice(6, 100)
            await m.pay(june)
            await m.credit(june, 80)
            july = await m.invoice(7, 110)
            assert july["stripe"]["error"] is None, july["stripe"]
            assert (july["credit_applied_cents"], july["carried_to_next_cents"], july["amount_due_cents"], july["status"]) == (80, 30, 0, "paid")
            august = await m.invoice(8, 500)
            assert august["stripe"]["error"] is None, august["stripe"]
            assert (august["carried_in_cents"], august["amount_due_cents"]) == (30, 530) == (30, m.remote(august)["amount_due"])
            await m.pay(august)
            assert sum(i["amount_paid"] for i in fake.invoices.values()) == 100 + 110 - 80 + 500
