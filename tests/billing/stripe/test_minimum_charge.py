"""An invoice below Stripe's minimum charge (USD $0.50), end to end through the gateway's admin API on
real Postgres with Stripe as the fake server (tests/fakes/stripe_server.py): Stripe charges nothing,
marks the invoice paid and adds the amount to the customer's balance as a debit (`invoice_too_small`),
which the next invoice collects. Ours is paid and says that nothing was charged and the amount was
carried to the next invoice (`carried_to_next_cents`); the next one says what it carries in and its
amount due is what Stripe collects. Before: the push called Stripe's carried debit a credit mismatch
(an error waiting for a person), the invoice read plain "paid" with $0.30 due, and the next invoice
said $10.00 due while Stripe charged $10.30. A credit note on a carried invoice whose debit is not
collected yet credits once: Stripe nets it against the debit on the balance, and the next push adds
nothing (before: it posted the credit again, and Stripe and ours said $9.70 for a $10.00 month)."""

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


async def june_carried_unheard(m: Month, fake: FakeStripe) -> dict[str, Any]:
    """June's $0.45 invoice, whose finalize carried it on Stripe (paid, an invoice_too_small debit)
    while its answer was lost: ours is still open, with the push's error."""
    fake.fail("POST", FINALIZE, 0)
    june = await m.invoice(6, 45)
    assert june["status"] == "open" and june["stripe"]["error"], june["stripe"]
    assert m.remote(june)["status"] == "paid" and txns(fake) == [("invoice_too_small", 45)]
    return june


async def test_the_webhook_says_what_was_carried_when_the_push_lost_stripes_answer(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    """The finalize ran on Stripe but its answer was lost (the close's push failed): invoice.paid tells
    ours that it is paid, with nothing charged and $0.30 carried."""
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            june = await june_carried_unheard(m, fake)
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


def collected(fake: FakeStripe) -> int:
    return sum(int(i["amount_paid"]) for i in fake.invoices.values())


@pytest.mark.parametrize("credited", [30, 10])
async def test_a_credit_note_on_an_invoice_carried_below_the_minimum_credits_once(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path, credited: int) -> None:
    """June $0.30 is carried (an invoice_too_small debit, not collected yet), then credited by a note
    (all of it, or $0.10). Stripe puts the note on the customer's balance (post-payment: June's
    amount_remaining is 0), where it nets against the debit. July $10 must collect $10 + what is left
    of June: Tollgate's July applies the note's credit and carries June's $0.30 in, and the balance
    push leaves Stripe's balance alone. Before: the push saw Stripe apply less than our credit and
    added it again (a -$0.30 adjustment): Stripe collected $9.70 and ours said $9.70, the customer
    credited twice."""
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            june = await m.invoice(6, 30)
            assert (june["status"], june["carried_to_next_cents"]) == ("paid", 30)
            note = await m.credit(june, credited)
            assert note["applies_to"] == "balance" and note["stripe"]["result"] == "synced", note
            remote_note = fake.credit_notes[note["stripe"]["stripe_credit_note_id"]]
            assert (remote_note["pre_payment_amount"], remote_note["post_payment_amount"], remote_note["_credit_amount"]) == (0, credited, credited)
            assert txns(fake) == [("invoice_too_small", 30), ("credit_note", -credited)]
            assert m.stripe_balance() == credited - 30  # the debit less the credit: each once
            june = await m.ours("2026-06")
            assert (june["status"], june["amount_due_cents"], june["credited_cents"]) == ("paid", 0, credited)

            july = await m.invoice(7, 1_000)
            assert july["stripe"]["error"] is None, july["stripe"]
            want = 1_000 + 30 - credited
            shown = (july["credit_applied_cents"], july["carried_in_cents"], july["amount_due_cents"], m.remote(july)["amount_due"])
            assert shown == (credited, 30, want, want)  # ours: credit applied, carried in, amount due; Stripe's amount due
            assert [t for t, _ in txns(fake)].count("adjustment") == 0  # nothing added on Stripe
            html = (await admin.get(f"/admin/invoices/{july['id']}/html")).text
            assert "Carried from earlier invoices (below the minimum charge)" in html and f"${want / 100:.2f}" in html
            await m.pay(july)
            assert collected(fake) == june["total_cents"] + july["total_cents"] - credited == want  # every cent once
            assert m.stripe_balance() == await m.our_balance() == 0


async def test_a_credit_note_on_a_carried_invoice_whose_finalize_answer_was_lost_credits_once(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    """The finalize carried June's $0.45 on Stripe but its answer was lost: ours is still open when it is
    credited in full (ours void, a pre-payment note). Stripe's invoice is paid, so the note goes to the
    balance (post-payment); the push says ours was paid, and what Stripe carried, before any webhook."""
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            june = await june_carried_unheard(m, fake)
            note = await m.credit(june, 45)
            assert note["stripe"]["result"] == "synced", note
            june = await m.ours("2026-06")
            assert (june["status"], june["carried_to_next_cents"], june["amount_due_cents"]) == ("paid", 45, 0)
            july = await m.invoice(7, 1_000)
            assert july["stripe"]["error"] is None, july["stripe"]
            assert (july["credit_applied_cents"], july["carried_in_cents"], july["amount_due_cents"]) == (45, 45, 1_000)
            assert m.remote(july)["amount_due"] == 1_000
            for event in fake.events:  # Stripe's late events change none of it (but Stripe's status: paid)
                assert (await fake.deliver(event, app.base_url + "/webhooks/stripe")).status_code == 200
            late = await m.ours("2026-06")
            assert (late["status"], late["carried_to_next_cents"], late["amount_due_cents"], late["credited_cents"]) == ("paid", 45, 0, 45)
            await m.pay(july)
            assert collected(fake) == 45 + 1_000 - 45 and m.stripe_balance() == await m.our_balance() == 0


async def test_a_carry_collected_by_an_invoice_whose_finalize_answer_was_lost_is_not_collected_again(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    """May $0.20 is carried; June $0.25 collects it and, $0.45 being below the minimum too, carries
    $0.45 on, but June's finalize answer is lost and its invoice.paid webhook tells ours. July $10 must
    collect $10.45: the webhook records what June collected of May's carry as the push would have.
    Before: it recorded only what June carried out, the balance push took May's $0.20 as still owed
    and added it to Stripe's balance: July collected $10.65."""
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            may = await m.invoice(5, 20)
            assert (may["status"], may["carried_to_next_cents"]) == ("paid", 20)
            fake.fail("POST", FINALIZE, 0)
            june = await m.invoice(6, 25)
            assert june["status"] == "open" and june["stripe"]["error"], june["stripe"]
            remote = m.remote(june)
            paid = next(e for e in fake.events if e["type"] == "invoice.paid" and e["data"]["object"]["id"] == remote["id"])
            assert (await fake.deliver(paid, app.base_url + "/webhooks/stripe")).status_code == 200
            june = await m.ours("2026-06")
            assert (june["status"], june["carried_in_cents"], june["carried_to_next_cents"]) == ("paid", 20, 45)
            july = await m.invoice(7, 1_000)
            assert july["stripe"]["error"] is None, july["stripe"]
            assert (july["carried_in_cents"], july["amount_due_cents"], m.remote(july)["amount_due"]) == (45, 1_045, 1_045)
            assert [t for t, _ in txns(fake)].count("adjustment") == 0  # nothing added on Stripe
