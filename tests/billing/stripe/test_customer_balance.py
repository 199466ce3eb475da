"""The customer's balance credit, ours and Stripe's, applied alike (billing/stripe/sync.py,
billing/invoices/documents.py balance_credit), through the gateway's admin API on real Postgres with
Stripe as the fake server (which applies a customer's balance on finalize as Stripe documents it):
each month, what Stripe collects on an invoice equals our invoice's amount due, and Stripe applies
exactly the credit our invoice applied: an invoice our balance paid in full goes to Stripe too (its
finalize takes that credit), a credit note on such an invoice reaches Stripe, a void gives back the
balance credit its invoice had applied on both sides, a credit posted to Stripe after our invoice
was made is not taken by that invoice, and one that reaches Stripe late is applied once."""

from __future__ import annotations

from pathlib import Path
from typing import Any


import pytest

from billing.invoices.documents import balance_credit
from billing.prices.book import PriceBook
from tests.billing.invoice_helpers import App, at, new_account, serve, usage
from tests.billing.stripe.test_credit_note_sync import env_for, fake  # noqa: F401  (fake: the fixture)
from tests.fakes.stripe_server import FakeStripe

NOTES = r"/v1/credit_notes"
BALANCE = r"/v1/customers/[^/]+/balance_transactions"
TOKENS_PER_CENT = 100  # omega costs $100 per million tokens: 100 tokens = 1 cent


async def customer_of(db: Any) -> int:
    await PriceBook(db).add("omega", "100.000", "100.000", at(5, 1, 0), backdate=True)
    return await new_account(db, "balance-corp")


class Month:
    def __init__(self, app: App, admin: Any, db: Any, fake: FakeStripe, account: int) -> None:
        self.app, self.admin, self.db, self.fake, self.account = app, admin, db, fake, account

    async def invoice(self, month: int, cents: int) -> dict[str, Any]:
        """The month's usage worth `cents`, closed (and pushed by the close): our invoice."""
        await usage(self.db, self.account, "omega", cents * TOKENS_PER_CENT, 0, at(month, 10))
        period = f"2026-{month:02d}"
        r = await self.admin.post("/admin/invoices/close", json={"period": period})
        assert r.status_code == 200, r.text
        return await self.ours(period)

    async def ours(self, period: str) -> dict[str, Any]:
        found = (await self.admin.get("/admin/invoices", params={"period": period, "account_id": self.account})).json()["data"]
        return found[0]  # type: ignore[no-any-return]

    def remote(self, invoice: dict[str, Any]) -> dict[str, Any]:
        assert invoice["stripe"]["invoice_id"], f"{invoice['number']} is not on Stripe"
        return self.fake.invoices[invoice["stripe"]["invoice_id"]]

    def collects(self, invoice: dict[str, Any]) -> int:
        """What Stripe collects on our invoice: its amount due once finalized (the balance applied)."""
        remote = self.remote(invoice)
        assert remote["status"] in ("open", "paid"), remote["status"]
        assert remote["total"] == invoice["total_cents"]
        assert remote["ending_balance"] - remote["starting_balance"] == invoice["credit_applied_cents"]  # the same credit
        return int(remote["amount_due"])

    async def pay(self, invoice: dict[str, Any]) -> None:
        paid = self.fake.pay(self.remote(invoice)["id"])
        assert (await self.fake.deliver(paid, self.app.base_url + "/webhooks/stripe")).status_code == 200
        assert (await self.ours(invoice["period"]))["status"] == "paid"

    async def credit(self, invoice: dict[str, Any], cents: int) -> dict[str, Any]:
        r = await self.admin.post(f"/admin/invoices/{invoice['id']}/credit_notes", json={"amount_cents": cents})
        assert r.status_code == 201, r.text
        return r.json()  # type: ignore[no-any-return]

    def stripe_balance(self) -> int:
        [customer] = self.fake.customers.values()
        return -int(customer["balance"])  # Stripe's is negative for a credit

    async def our_balance(self) -> int:
        async with self.db.connect() as conn:
            return await balance_credit(conn, self.account)


async def test_stripe_collects_our_amount_due_every_month_as_credit_notes_come_and_go(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            # June: A, $100, paid; then a $30 credit note on it: the customer's balance, on both sides
            a = await m.invoice(6, 10_000)
            assert m.collects(a) == a["amount_due_cents"] == 10_000
            await m.pay(a)
            cn1 = await m.credit(a, 3_000)
            assert cn1["applies_to"] == "balance" and cn1["stripe"]["result"] == "synced"
            assert await m.our_balance() == m.stripe_balance() == 3_000

            # July: B, $20, paid in full by our balance: it goes to Stripe, whose finalize takes the $20 too
            b = await m.invoice(7, 2_000)
            assert (b["credit_applied_cents"], b["amount_due_cents"], b["status"]) == (2_000, 0, "paid")
            assert m.collects(b) == 0 and m.remote(b)["status"] == "paid" and m.remote(b)["amount_paid"] == 0
            assert await m.our_balance() == m.stripe_balance() == 1_000

            # August: C, $50, $10 of credit left: $40 due on both sides (Stripe took all $30 before: $20)
            c = await m.invoice(8, 5_000)
            assert (c["credit_applied_cents"], c["amount_due_cents"]) == (1_000, 4_000)
            assert m.collects(c) == 4_000
            await m.pay(c)
            assert await m.our_balance() == m.stripe_balance() == 0

            # a $5 credit note on B (paid by our balance; before, never on Stripe: the note was never posted)
            cn2 = await m.credit(b, 500)
            assert cn2["applies_to"] == "balance" and cn2["stripe"]["result"] == "synced"
            assert await m.our_balance() == m.stripe_balance() == 500

            # September: D, $8, $5 of credit applied, $3 due; then D is voided: the $5 it applied comes back
            d = await m.invoice(9, 800)
            assert (d["credit_applied_cents"], d["amount_due_cents"]) == (500, 300)
            assert m.collects(d) == 300
            void = await m.credit(d, 800)
            assert void["kind"] == "void" and void["applies_to"] == "invoice"
            assert (await m.ours("2026-09"))["status"] == "void" and m.remote(d)["amount_remaining"] == 0
            assert await m.our_balance() == m.stripe_balance() == 500

            # October: E, $10: the $5 applied again, $5 due on both sides
            e = await m.invoice(10, 1_000)
            assert (e["credit_applied_cents"], e["amount_due_cents"]) == (500, 500)
            assert m.collects(e) == 500
            assert await m.our_balance() == m.stripe_balance() == 0
            assert fake.count("POST", BALANCE) == 0  # Stripe applied each credit itself: nothing had to be set


async def test_a_credit_posted_after_our_invoice_was_made_is_not_taken_by_it(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            a = await m.invoice(6, 10_000)
            await m.pay(a)
            # July is closed but its push fails: B ($20, no credit of ours) is not on Stripe yet ...
            fake.fail("POST", r"/v1/invoices", 500)
            b = await m.invoice(7, 2_000)
            assert b["credit_applied_cents"] == 0 and b["stripe"]["invoice_id"] is None
            # ... when a $30 credit note reaches Stripe's balance: ours is for the next invoice, not B
            await m.credit(a, 3_000)
            assert m.stripe_balance() == 3_000
            r = await admin.post(f"/admin/invoices/{b['id']}/sync")
            assert r.status_code == 200, r.text
            b = await m.ours("2026-07")
            assert m.collects(b) == b["amount_due_cents"] == 2_000  # Stripe alone would have taken $20 of the $30: $0
            assert await m.our_balance() == 3_000 and m.stripe_balance() == 0  # ours is still to apply

            c = await m.invoice(8, 5_000)
            assert (c["credit_applied_cents"], c["amount_due_cents"]) == (3_000, 2_000)
            assert m.collects(c) == 2_000
            assert await m.our_balance() == m.stripe_balance() == 0
            adjustments = [t for t in fake.balance_transactions.values() if t["type"] == "adjustment"]
            assert sorted((t["amount"], t["metadata"]["tollgate_invoice"]) for t in adjustments) == [
                (-3_000, c["number"]), (3_000, b["number"])]


async def test_a_credit_note_whose_push_failed_reaches_stripe_before_the_next_invoice_is_finalized(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    """The close's push sends waiting credit notes first: Stripe's balance holds the credit when
    the next invoice is finalized, so nothing has to be set, and no credit is left behind on it."""
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            a = await m.invoice(6, 10_000)
            await m.pay(a)
            fake.fail("POST", NOTES, 500)  # at issue only
            assert (await m.credit(a, 3_000))["stripe"]["result"].startswith("error")
            b = await m.invoice(7, 5_000)
            assert (b["credit_applied_cents"], b["amount_due_cents"]) == (3_000, 2_000)
            assert m.collects(b) == 2_000 and len(fake.credit_notes) == 1
            assert await m.our_balance() == m.stripe_balance() == 0
            assert fake.count("POST", BALANCE) == 0


async def test_a_credit_note_that_reaches_stripe_late_is_applied_once(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            a = await m.invoice(6, 10_000)
            await m.pay(a)
            fake.fail("POST", NOTES, 500, times=2)  # at issue, and again at the close's push
            cn = await m.credit(a, 3_000)
            assert cn["stripe"]["result"].startswith("error") and m.stripe_balance() == 0
            b = await m.invoice(7, 5_000)  # ours applies the $30: B's push puts it on Stripe's balance first
            assert (b["credit_applied_cents"], b["amount_due_cents"]) == (3_000, 2_000)
            assert m.collects(b) == 2_000
            assert len(fake.credit_notes) == 0

            # the note reaches Stripe now (its credit on Stripe's balance again): the next invoice does not take it
            r = await admin.post(f"/admin/invoices/{a['id']}/sync")
            assert r.status_code == 200 and len(fake.credit_notes) == 1, r.text
            c = await m.invoice(8, 1_000)
            assert (c["credit_applied_cents"], c["amount_due_cents"]) == (0, 1_000)
            assert m.collects(c) == 1_000
            assert await m.our_balance() == m.stripe_balance() == 0


async def test_the_balance_set_before_a_finalize_whose_response_was_lost_is_set_once(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            a = await m.invoice(6, 10_000)
            await m.pay(a)
            fake.fail("POST", NOTES, 500, times=2)
            await m.credit(a, 3_000)
            fake.fail("POST", BALANCE, 0)  # Stripe sets the balance, the response is lost: the close's push fails
            b = await m.invoice(7, 5_000)
            assert b["stripe"]["status"] == "draft" and b["stripe"]["error"], b["stripe"]
            assert fake.count("POST", BALANCE) == 1 and m.stripe_balance() == 3_000
            fake.forget_idempotency_keys()
            r = await admin.post(f"/admin/invoices/{b['id']}/sync")  # reads the balance: right already
            assert r.status_code == 200, r.text
            b = await m.ours("2026-07")
            assert m.collects(b) == b["amount_due_cents"] == 2_000
            # the credit set once (by the push whose response was lost), then taken by B's finalize
            assert [(t["type"], t["amount"]) for t in fake.balance_transactions.values()] == [
                ("adjustment", -3_000), ("applied_to_invoice", 3_000)]


async def test_an_invoice_voided_on_stripe_gives_back_the_credit_it_applied_on_both_sides(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    """July applied $30 of balance credit and is voided in Stripe's dashboard: Stripe returns the $30
    to the customer's balance (`unapplied_from_invoice`), and so do we when its `invoice.voided`
    comes. August ($40) then applies the $30 on both sides and Stripe collects $10; without our
    side, our balance said 0, August applied nothing and Stripe collected $40."""
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            june = await m.invoice(6, 10_000)
            await m.pay(june)
            await m.credit(june, 3_000)  # on a paid invoice: $30 of balance credit
            july = await m.invoice(7, 5_000)
            assert july["credit_applied_cents"] == 3_000 and m.collects(july) == 2_000
            assert (await m.our_balance(), m.stripe_balance()) == (0, 0)

            voided = fake.void(m.remote(july)["id"])
            assert m.stripe_balance() == 3_000  # Stripe gave it back
            assert (await fake.deliver(voided, app.base_url + "/webhooks/stripe")).status_code == 200
            assert (await m.ours("2026-07"))["status"] == "void"
            assert await m.our_balance() == 3_000

            august = await m.invoice(8, 4_000)
            assert august["credit_applied_cents"] == 3_000 and m.collects(august) == 1_000
            assert (await m.our_balance(), m.stripe_balance()) == (0, 0)


@pytest.mark.parametrize("cents", [3_000, 10_000], ids=["part", "all"])
async def test_a_credit_note_on_an_invoice_stripe_had_paid_before_we_heard_reaches_the_next_invoice(
        db_url: str, db: Any, fake: FakeStripe, tmp_path: Path, cents: int) -> None:
    """June ($100) is paid on Stripe; its invoice.paid has not been applied here when a credit note is
    issued on it. Ours still says open (the note would reduce what is due), Stripe's says paid: Stripe
    puts the whole note on the customer's balance (post-payment), and so must we. Before: our balance
    stayed 0, July applied none of it and the balance push took Stripe's credit back."""
    account = await customer_of(db)
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            m = Month(app, admin, db, fake, account)
            june = await m.invoice(6, 10_000)
            paid = fake.pay(m.remote(june)["id"])  # paid on Stripe; its webhook comes later
            note = await m.credit(june, cents)
            assert note["stripe"]["result"] == "synced", note
            assert (await m.our_balance(), m.stripe_balance()) == (cents, cents)
            assert (await fake.deliver(paid, app.base_url + "/webhooks/stripe")).status_code == 200
            assert (await m.ours("2026-06"))["status"] == "paid"  # collected, whatever the note took
            july = await m.invoice(7, 2_000)
            assert july["credit_applied_cents"] == 2_000 and m.collects(july) == 0
            assert (await m.our_balance(), m.stripe_balance()) == (cents - 2_000, cents - 2_000)
