"""Invoices an accounts department accepts (issue 22), on real Postgres through the gateway's admin
API, with Stripe as the fake server: buyer billing details (validated: 400 naming the field), the
seller from settings, snapshots that a later change does not rewrite, issue and due dates and
terms, numbers without gaps per seller, tax once on the subtotal as its own line (and on Stripe,
whose total equals ours), credit notes (never editing the invoice; the next invoice shows them),
the close pushing to Stripe when TOLLGATE_STRIPE_SYNC_AFTER_CLOSE is on, HTML and PDF."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest
from pypdf import PdfReader

from billing.invoices.billing_details import next_number, split_tax, tax_cents
from billing.config import BillingConfig, Seller
from billing.db import create_engine
from billing.invoices.views import get_invoice, list_invoices
from billing.invoices.close import close_account, close_period
from billing.invoices.periods import Period
from billing.prices.book import PriceBook
from billing.invoices.render import render_html, render_pdf
from tests.billing.invoice_helpers import at, new_account, serve, usage
from tests.billing.invoices.test_invoices import SEPT, september
from tests.fakes.stripe_server import FakeStripe

SELLER = {
    "TOLLGATE_SELLER_NAME": "Tollgate Networks Ltd", "TOLLGATE_SELLER_ADDRESS": "1 Gate Street|London EC1A 1AA",
    "TOLLGATE_SELLER_COUNTRY": "GB", "TOLLGATE_SELLER_TAX_ID": "GB999999973", "TOLLGATE_SELLER_EMAIL": "billing@tollgate.example",
}
A_DETAILS = {"legal_name": "A Corporation GmbH", "address_line1": "Hauptstraße 1", "postal_code": "10115", "city": "Berlin",
             "country": "de", "email": "ap@a-corp.example", "tax_id": "DE123456789"}


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    server = FakeStripe().start()
    yield server
    server.stop()


def stripe_env(fake: FakeStripe, **extra: str) -> dict[str, str]:
    return {"TOLLGATE_STRIPE_API_KEY": fake.api_key, "TOLLGATE_STRIPE_API_BASE": fake.url,
            "TOLLGATE_STRIPE_WEBHOOK_SECRET": fake.webhook_secret, **extra}


def half_up(value: Decimal) -> int:
    return int(value.quantize(Decimal(1), ROUND_HALF_UP))


async def penny_lines(db: Any) -> int:
    """An account whose three lines are one cent each: 19% once on 3 cents is 1 cent, per line 0."""
    d = await new_account(db, "d-pennies")
    await usage(db, d, "alpha", 66_667, 16_667, at(9, 5))  # 1.00 cent input, 1.00 cent output at 0.150 / 0.600
    await usage(db, d, "beta", 10_000, 0, at(9, 6))  # 1 cent at 1.000
    return d


def pdf_text(data: bytes) -> str:
    return "\n".join(page.extract_text() for page in PdfReader(io.BytesIO(data)).pages)


async def test_details_tax_numbers_snapshots_and_stripe(db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    ids = await september(db)
    d = await penny_lines(db)
    with serve(db_url, tmp_path, **stripe_env(fake), **SELLER, TOLLGATE_STRIPE_SYNC_AFTER_CLOSE="1") as app:
        async with app.admin() as admin:
            path = f"/admin/accounts/{ids['a']}/billing_details"
            assert (await admin.get(path)).status_code == 404
            for bad, field in (({**A_DETAILS, "country": "XX"}, "country"), ({**A_DETAILS, "legal_name": " "}, "legal_name"),
                               ({**A_DETAILS, "country": None}, "country"), ({**A_DETAILS, "email": "not-an-address"}, "email"),
                               ({**A_DETAILS, "tax_rate": "19.0001"}, "tax_rate"), ({**A_DETAILS, "tax_rate": True}, "tax_rate"),
                               ({**A_DETAILS, "tax_id_type": "xx_vat"}, "tax_id_type"), ({**A_DETAILS, "colour": "red"}, "colour"),
                               ({**A_DETAILS, "city": "x" * 101}, "city")):
                r = await admin.put(path, json=bad)
                assert r.status_code == 400, (bad, r.text)
                assert r.json()["error"]["param"] == field and r.json()["error"]["type"] == "invalid_request_error", r.text
            r = await admin.put(path, content=b"[1, 2")
            assert r.status_code == 400
            assert (await admin.put("/admin/accounts/999999/billing_details", json=A_DETAILS)).status_code == 404
            saved = (await admin.put(path, json=A_DETAILS)).json()
            assert saved["country"] == "DE" and saved["tax_id_type"] == "eu_vat" and saved["tax_rate"] is None
            assert (await admin.put("/admin/tax_rates/DE", json={"rate": "nineteen"})).status_code == 400
            assert (await admin.put("/admin/tax_rates/ZZ", json={"rate": "19.000"})).json()["error"]["param"] == "country"
            assert (await admin.put("/admin/tax_rates/de", json={"rate": "19.000"})).json() == {"object": "tax_rate", "country": "DE", "rate": "19.000"}
            # d: no country rate (US), its own 19.000% overrides
            r = await admin.put(f"/admin/accounts/{d}/billing_details", json={"legal_name": "D Pennies Inc", "country": "US", "tax_rate": "19.000"})
            assert r.status_code == 200, r.text

            r = await admin.post("/admin/invoices/close", json={"period": "2026-09"})
            assert r.status_code == 200, r.text
            closed = r.json()
            assert [s["result"] for s in closed["stripe"]] == ["synced"] * 3  # a, b, d (pushed after the close)
            invoices = {i["account_id"]: i for i in (await admin.get("/admin/invoices", params={"period": "2026-09"})).json()["data"]}

            a = invoices[ids["a"]]
            assert a["document"] == "invoice" and a["seller"]["legal_name"] == "Tollgate Networks Ltd"
            assert a["seller"]["address"] == ["1 Gate Street", "London EC1A 1AA"] and a["seller"]["tax_id"] == "GB999999973"
            assert a["buyer"]["legal_name"] == "A Corporation GmbH" and a["buyer"]["tax_id"] == "DE123456789"
            assert a["buyer"]["address"] == ["Hauptstraße 1", "10115 Berlin"] and a["buyer"]["country"] == "DE"
            issued, due = datetime.fromisoformat(a["issued_at"]), datetime.fromisoformat(a["due_at"])
            assert due - issued == timedelta(days=30) and a["payment_terms"] == "Net 30 days" and a["currency"] == "usd"
            assert a["subtotal_cents"] == 89 == sum(line["amount_cents"] for line in a["lines"])
            assert a["tax"] == {"rate": "19.000", "amount_cents": 17, "amount": "0.17"}  # 89 x 19% = 16.91 -> 17
            assert a["total_cents"] == 106 == a["amount_due_cents"]
            b = invoices[ids["b"]]
            assert b["tax"] is None and b["total_cents"] == b["subtotal_cents"] and b["buyer"]["legal_name"] == "b-resale"
            pennies = invoices[d]
            assert [line["amount_cents"] for line in pennies["lines"]] == [1, 1, 1]
            assert pennies["tax"]["amount_cents"] == 1 == half_up(Decimal(3) * Decimal("0.19"))  # per line: 3 x 0
            assert pennies["total_cents"] == 4
            # numbers without gaps per seller, in the order the close made them
            assert sorted(i["number"] for i in invoices.values()) == ["INV-000001", "INV-000002", "INV-000003"]

            # Stripe: the customer's details, tax on the invoice, items summing to our subtotal, totals equal
            for account, invoice in invoices.items():
                remote = fake.invoices[invoice["stripe"]["invoice_id"]]
                items = fake.items_of(remote["id"])
                assert sum(i["amount"] for i in items) == invoice["subtotal_cents"] == remote["subtotal"]
                assert sum(t["amount"] for t in remote["total_taxes"]) == (invoice["tax"] or {}).get("amount_cents", 0)
                assert remote["total"] == invoice["total_cents"] and invoice["stripe"]["total_cents"] == invoice["total_cents"]
            remote_a = fake.invoices[a["stripe"]["invoice_id"]]
            [rate] = {t["tax_rate_details"]["tax_rate"] for t in remote_a["total_taxes"]}
            assert fake.tax_rates[rate]["percentage"] == 19.0 and fake.tax_rates[rate]["inclusive"] is False
            assert remote_a["customer_name"] == "A Corporation GmbH" and remote_a["customer_email"] == "ap@a-corp.example"
            assert remote_a["customer_address"] == {"line1": "Hauptstraße 1", "line2": None, "city": "Berlin", "postal_code": "10115",
                                                    "state": None, "country": "DE"}
            assert remote_a["customer_tax_ids"] == [{"type": "eu_vat", "value": "DE123456789"}]

            # a later change of the buyer does not rewrite the issued invoice
            r = await admin.patch(f"/admin/accounts/{d}/billing_details", json={"email": "ap@pennies.example"})
            assert r.status_code == 200 and r.json()["tax_rate"] == "19.000", r.text  # kept: PATCH changes only what it names
            r = await admin.patch(path, json={"legal_name": "A Corp Renamed AG"})
            assert r.json()["legal_name"] == "A Corp Renamed AG" and r.json()["city"] == "Berlin"
            again = (await admin.get(f"/admin/invoices/{a['id']}")).json()
            assert again["buyer"]["legal_name"] == "A Corporation GmbH"

            html = (await admin.get(f"/admin/invoices/{a['id']}/html")).text
            for text in ("Invoice INV-000001", "Tollgate Networks Ltd", "GB999999973", "A Corporation GmbH", "DE123456789",
                         f"Due date</dt><dd>{a['due_at'][:10]}", "Tax (19.000%)", "$0.17", "$1.06", "Net 30 days"):
                assert text in html, text
            assert "usage statement" not in html
            text = pdf_text((await admin.get(f"/admin/invoices/{a['id']}/pdf")).content)
            for part in ("Invoice INV-000001", "Tollgate Networks Ltd", "A Corporation GmbH", f"Due date: {a['due_at'][:10]}",
                         "Tax (19.000%): $0.17", "Total (USD): $1.06", "Amount due: $1.06"):
                assert part in text, (part, text)


async def test_credit_notes_never_edit_the_invoice_and_show_on_the_next(db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    ids = await september(db)
    with serve(db_url, tmp_path, **stripe_env(fake), **SELLER) as app:
        async with app.admin() as admin:
            await admin.put(f"/admin/accounts/{ids['a']}/billing_details", json={**A_DETAILS, "tax_rate": "19.000"})
            assert (await admin.post("/admin/invoices/close", json={"period": "2026-09"})).status_code == 200
            invoices = {i["account_id"]: i for i in (await admin.get("/admin/invoices")).json()["data"]}
            a, b = invoices[ids["a"]], invoices[ids["b"]]
            before = (await admin.get(f"/admin/invoices/{a['id']}")).json()
            for bad, field in (({"amount_cents": 0}, "amount_cents"), ({"amount_cents": 107}, "amount_cents"),
                               ({"amount_cents": 10, "reason": "because"}, "reason"), ({"amount_cents": "10"}, "amount_cents")):
                r = await admin.post(f"/admin/invoices/{a['id']}/credit_notes", json=bad)
                assert r.status_code == 400 and r.json()["error"]["param"] == field, (bad, r.text)
            assert (await admin.post("/admin/invoices/999999/credit_notes", json={})).status_code == 404

            # partial credit on an open invoice: Stripe reduces what is due on it
            r = await admin.post(f"/admin/invoices/{a['id']}/credit_notes",
                                 json={"amount_cents": 50, "reason": "order_change", "memo": "Goodwill for the outage"})
            assert r.status_code == 201, r.text
            first = r.json()
            assert first["number"] == "CN-000001" and first["kind"] == "partial" and first["applies_to"] == "invoice"
            assert (first["subtotal_cents"], first["tax_cents"], first["total_cents"]) == (42, 8, 50)  # 50 x 17/106 = 8.02
            remote_note = fake.credit_notes[first["stripe"]["stripe_credit_note_id"]]
            assert remote_note["pre_payment_amount"] == 50 and remote_note["metadata"]["tollgate_credit_note"] == "CN-000001"
            assert fake.invoices[a["stripe"]["invoice_id"]]["amount_remaining"] == 56
            after = (await admin.get(f"/admin/invoices/{a['id']}")).json()
            assert after["lines"] == before["lines"] and after["total_cents"] == before["total_cents"] == 106
            assert after["number"] == before["number"] and after["tax"] == before["tax"] and after["status"] == "open"
            assert [c["number"] for c in after["credit_notes"]] == ["CN-000001"] and after["credited_cents"] == 50

            # voiding b's invoice: a credit note for all of it; the invoice itself is untouched but void
            voided = (await admin.post(f"/admin/invoices/{b['id']}/credit_notes", json={"reason": "duplicate"})).json()
            assert voided["number"] == "CN-000002" and voided["kind"] == "void" and voided["total_cents"] == b["total_cents"]
            b_after = (await admin.get(f"/admin/invoices/{b['id']}")).json()
            assert b_after["status"] == "void" and b_after["lines"] == b["lines"] and b_after["total_cents"] == b["total_cents"]
            assert fake.invoices[b["stripe"]["invoice_id"]]["status"] == "paid"  # Stripe: nothing left due
            assert (await admin.post(f"/admin/invoices/{b['id']}/credit_notes", json={})).json()["error"]["code"] == "nothing_to_credit"

            # a paid invoice: the credit goes to the customer's balance, and the next invoice applies it
            paid = fake.pay(a["stripe"]["invoice_id"])
            assert (await fake.deliver(paid, app.base_url + "/webhooks/stripe")).status_code == 200
            assert (await admin.get(f"/admin/invoices/{a['id']}")).json()["status"] == "paid"
            third = (await admin.post(f"/admin/invoices/{a['id']}/credit_notes", json={"amount_cents": 20})).json()
            assert third["number"] == "CN-000003" and third["applies_to"] == "balance"
            customer = fake.customers[fake.invoices[a["stripe"]["invoice_id"]]["customer"]]
            assert customer["balance"] == -20 and fake.credit_notes[third["stripe"]["stripe_credit_note_id"]]["_credit_amount"] == 20

            note_pdf = pdf_text((await admin.get(f"/admin/credit_notes/{third['id']}/pdf")).content)
            assert "Credit note CN-000003" in note_pdf and a["number"] in note_pdf and "-$0.20" in note_pdf
            key_headers = {"Authorization": f"Bearer {await _key(db, ids['b'])}"}
            async with app.as_key(key_headers["Authorization"][7:]) as b_client:
                assert (await b_client.get(f"/v1/credit_notes/{third['id']}")).status_code == 404  # not b's

            await usage(db, ids["a"], "alpha", 1_000_000, 0, at(10, 3))  # 20 cents, and september()'s 5M on Oct 1: 100
            assert (await admin.post("/admin/invoices/close", json={"period": "2026-10"})).status_code == 200
            october = (await admin.get("/admin/invoices", params={"period": "2026-10", "account_id": ids["a"]})).json()["data"][0]
            assert october["number"] == "INV-000003"  # the credit notes have their own sequence
            assert [c["number"] for c in october["credit_notes_since_last_invoice"]] == ["CN-000001", "CN-000003"]
            assert october["subtotal_cents"] == 120 and october["total_cents"] == 120 + 23  # 19% of 120 = 22.8 -> 23
            assert october["credit_applied_cents"] == 20 and october["amount_due_cents"] == 123
            remote_oct = fake.invoices[october["stripe"]["invoice_id"]]
            assert remote_oct["total"] == 143 and remote_oct["amount_due"] == 123 and remote_oct["starting_balance"] == -20
            html = (await admin.get(f"/admin/invoices/{october['id']}/html")).text
            assert "CN-000003" in html and "Credit balance applied" in html and "-$0.20" in html


async def _key(db: Any, account_id: int) -> str:
    from tests.billing.invoice_helpers import new_key
    return await new_key(db, account_id)


async def test_numbers_have_no_gaps_across_rollbacks_and_concurrent_closes(db: Any) -> None:
    book = PriceBook(db)
    await book.add("alpha", "1.000", "1.000", at(8, 1, 0), backdate=True)
    accounts = [await new_account(db) for _ in range(6)]
    for account in accounts:
        await usage(db, account, "alpha", 1_000_000, 0, at(9, 2))
    config = BillingConfig(seller=Seller(legal_name="Seller One", tax_id="S1"))
    async with db.connect() as conn:  # a close that rolls back gives its number back
        await conn.begin()
        assert await next_number(conn, "S1", "invoice") == 1
        await conn.rollback()
    await book.refresh(force=True)
    made = await asyncio.gather(*(close_account(db, book, a, SEPT, [], now=at(10, 1, 1), config=config) for a in accounts))
    invoices = [await get_invoice(db, i) for i, _ in made]
    assert sorted(i["number"] for i in invoices if i) == [f"INV-{n:06d}" for n in range(1, 7)]
    other = BillingConfig(seller=Seller(legal_name="Seller Two", tax_id="S2", invoice_prefix="S2INV"))
    await usage(db, accounts[0], "alpha", 1_000_000, 0, at(10, 2))
    second, _ = await close_account(db, book, accounts[0], Period.month(2026, 10), [], now=at(11, 1, 1), config=other)
    assert (await get_invoice(db, second))["number"] == "S2INV-000001"  # per seller


async def test_without_seller_identity_the_document_is_a_usage_statement(db: Any) -> None:
    ids = await september(db)
    await close_period(db, PriceBook(db), SEPT, now=at(10, 1, 2))
    [invoice] = await list_invoices(db, account_id=ids["a"])
    assert invoice["document"] == "usage_statement" and invoice["number"] == "US-000001" and invoice["seller"] is None
    html = render_html(invoice)
    assert "Usage statement US-000001" in html and "usage statement, not an invoice" in html and "<h1>Invoice" not in html
    text = pdf_text(render_pdf(invoice))
    assert "Usage statement US-000001" in text and "not an invoice" in text


def test_tax_rounds_once_half_up_and_splits_exactly() -> None:
    assert tax_cents(89, Decimal("19.000")) == 17 and tax_cents(3, Decimal("19.000")) == 1 and tax_cents(50, Decimal("7.000")) == 4
    assert tax_cents(250, Decimal("0.200")) == 1  # 0.5 -> 1 (half up)
    assert tax_cents(0, Decimal("19.000")) == 0 and tax_cents(100, None) == 0
    for amounts, tax in (([1, 1, 1], 1), ([15, 15, 51, 6, 1, 1], 17), ([5], 1), ([0, 0], 0), ([7, 3, 90], 19)):
        shares = split_tax(amounts, tax)
        assert sum(shares) == tax and all(s >= 0 for s in shares)


async def test_close_pushes_to_stripe_only_when_configured(db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    await september(db)
    with serve(db_url, tmp_path, **stripe_env(fake), TOLLGATE_STRIPE_SYNC_AFTER_CLOSE="0") as app:
        async with app.admin() as admin:
            r = await admin.post("/admin/invoices/close", json={"period": "2026-09"})
            assert r.status_code == 200 and "stripe" not in r.json()
    assert fake.invoices == {} and fake.count("POST", r".*") == 0


async def test_cli_billing_details_tax_rate_and_credit_note_on_sqlite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded default: billing details, a country's rate, the close and a credit note from the CLI."""
    import json

    from tests.test_cli import tollgate

    for name, value in SELLER.items():
        monkeypatch.setenv(name, value)  # the CLI reads the seller from the environment, as the server does
    assert tollgate(tmp_path, "migrate").returncode == 0
    assert tollgate(tmp_path, "accounts", "create", "acme").returncode == 0
    assert tollgate(tmp_path, "prices", "add", "alpha", "--input", "1.000", "--output", "1.000",
                    "--effective-from", "2026-08-01T00:00:00Z", "--backdate").returncode == 0
    bad = tollgate(tmp_path, "billing", "details", "--account", "acme", "--legal-name", "Acme SARL", "--country", "XX")
    assert bad.returncode == 1 and "country" in bad.stderr and "ISO 3166" in bad.stderr
    made = tollgate(tmp_path, "billing", "details", "--account", "acme", "--legal-name", "Acme SARL", "--country", "fr",
                    "--email", "compta@acme.example", "--tax-id", "FR40303265045")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["tax_id_type"] == "eu_vat"
    assert json.loads(tollgate(tmp_path, "billing", "tax-rate", "FR", "20.000").stdout)["rate"] == "20.000"
    assert tollgate(tmp_path, "billing", "tax-rate", "FR", "200").returncode == 1
    db = create_engine(f"sqlite:///{tmp_path / 'tollgate.db'}")
    try:
        await usage(db, 1, "alpha", 1_234_567, 0, at(10, 5))  # $1.234567 -> 123 cents
    finally:
        await db.dispose()
    closed = tollgate(tmp_path, "invoices", "close", "--period", "2026-10", "--no-progress")
    assert closed.returncode == 0, closed.stderr
    [listed] = json.loads(tollgate(tmp_path, "invoices", "list").stdout)
    shown = json.loads(tollgate(tmp_path, "invoices", "show", str(listed["id"])).stdout)
    assert shown["number"] == "INV-000001" and shown["buyer"]["legal_name"] == "Acme SARL"
    assert (shown["subtotal_cents"], shown["tax"]["amount_cents"], shown["total_cents"]) == (123, 25, 148)  # 24.6 -> 25
    credit = tollgate(tmp_path, "invoices", "credit", str(listed["id"]), "--amount-cents", "48", "--reason", "order_change")
    assert credit.returncode == 0, credit.stderr
    note = json.loads(credit.stdout)
    assert note["number"] == "CN-000001" and (note["subtotal_cents"], note["tax_cents"]) == (40, 8)
    too_much = tollgate(tmp_path, "invoices", "credit", str(listed["id"]), "--amount-cents", "101")
    assert too_much.returncode == 1 and "between 1 and 100" in too_much.stderr


async def test_the_seller_logo_is_on_html_and_pdf(db: Any, tmp_path: Path) -> None:
    from PIL import Image

    logo = tmp_path / "logo.png"
    Image.new("RGB", (120, 40), (37, 99, 235)).save(logo)
    config = BillingConfig.from_mapping({**SELLER, "TOLLGATE_SELLER_LOGO": str(logo)})
    ids = await september(db)
    await close_period(db, PriceBook(db), SEPT, now=at(10, 1, 2), config=config)
    [invoice] = await list_invoices(db, account_id=ids["a"])
    assert invoice["seller"]["logo"] == str(logo)
    assert 'src="data:image/png;base64,' in render_html(invoice)
    assert sum(len(page.images) for page in PdfReader(io.BytesIO(render_pdf(invoice))).pages) == 1
    with pytest.raises(SystemExit, match="TOLLGATE_SELLER_LOGO"):
        BillingConfig.from_mapping({**SELLER, "TOLLGATE_SELLER_LOGO": str(tmp_path / "missing.png")})


async def test_a_credit_note_issued_before_the_invoice_reached_stripe_follows_it(db_url: str, db: Any, fake: FakeStripe,
                                                                                 tmp_path: Path) -> None:
    ids = await september(db)
    with serve(db_url, tmp_path, **stripe_env(fake), **SELLER, TOLLGATE_STRIPE_SYNC_AFTER_CLOSE="0") as app:
        async with app.admin() as admin:
            assert (await admin.post("/admin/invoices/close", json={"period": "2026-09"})).status_code == 200
            [a] = (await admin.get("/admin/invoices", params={"account_id": ids["a"]})).json()["data"]
            note = (await admin.post(f"/admin/invoices/{a['id']}/credit_notes", json={"amount_cents": 9})).json()
            assert note["stripe"]["result"] == "skipped: the invoice is not on Stripe" and fake.credit_notes == {}
            synced = (await admin.post(f"/admin/invoices/{a['id']}/sync")).json()
            assert synced["result"] == "synced", synced
            [remote_note] = fake.credit_notes.values()
            assert remote_note["metadata"]["tollgate_credit_note"] == note["number"] and remote_note["pre_payment_amount"] == 9
            assert fake.invoices[synced["stripe_invoice_id"]]["amount_remaining"] == a["total_cents"] - 9
            again = (await admin.post(f"/admin/invoices/{a['id']}/sync")).json()  # a repeat sends nothing more
            assert again["result"] == "synced" and len(fake.credit_notes) == 1


async def test_two_credit_notes_at_once_never_credit_more_than_the_invoice(db: Any) -> None:
    from billing.invoices.credit_notes import CreditNoteRefused, CreditRequest, issue_credit_note

    ids = await september(db)
    await close_period(db, PriceBook(db), SEPT, now=at(10, 1, 2))
    [invoice] = await list_invoices(db, account_id=ids["a"])
    results = await asyncio.gather(*(issue_credit_note(db, invoice["id"], CreditRequest(None)) for _ in range(4)), return_exceptions=True)
    made = [r for r in results if isinstance(r, dict)]
    assert len(made) == 1 and made[0]["total_cents"] == invoice["total_cents"], results
    assert all(isinstance(r, CreditNoteRefused) and r.code == "nothing_to_credit" for r in results if not isinstance(r, dict)), results
