"""Invoices from the dashboards in a real browser (Debian's Chromium driven by Playwright), issue 22:
the admin and a customer log in, download the invoice PDF by clicking its link (the session
authorises it: no bearer key), and the PDF's text (pypdf) holds the seller, the buyer, the due
date, the tax line and a total equal to the one computed here by hand from the ledger rows. The
admin's account page shows the billing state, invoices, overrides and billing details, and
edits them; a customer gets a 404 for another account's invoice; an empty range says so; the
login form's fields line up. Screenshots go to tests/artifacts/invoices/."""

from __future__ import annotations

import io
import re
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from playwright.async_api import Browser, Page, async_playwright, expect
from pypdf import PdfReader

from billing import migrate
from billing.db import create_engine
from billing.ledger.writer import UsageRecord, write_records
from billing.prices.book import PriceBook
from tests.billing.invoice_helpers import at, new_account, new_key, serve
from tests.gateway.dashboard.test_dashboard import CHROMIUM, Watched

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "invoices"
SELLER = {
    "TOLLGATE_SELLER_NAME": "Tollgate Networks Ltd", "TOLLGATE_SELLER_ADDRESS": "1 Gate Street|London EC1A 1AA",
    "TOLLGATE_SELLER_COUNTRY": "GB", "TOLLGATE_SELLER_TAX_ID": "GB999999973", "TOLLGATE_SELLER_EMAIL": "billing@tollgate.example",
}
# (model, prompt, completion, admitted): priced by hand below
ROWS = [("alpha", 1_234_567, 345_678, at(9, 3)), ("alpha", 2_000_000, 1_000_000, at(9, 20)), ("beta", 333_333, 111_111, at(9, 25))]
PRICES = {("alpha", at(8, 1, 0)): (Decimal("0.150"), Decimal("0.600")), ("alpha", at(9, 16, 0)): (Decimal("0.200"), Decimal("0.800")),
          ("beta", at(8, 1, 0)): (Decimal("1.000"), Decimal("2.000"))}

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (make setup installs it)")


def by_hand() -> tuple[int, int, int]:
    """Subtotal, tax (19%) and total in cents: per (model, direction, price) tokens x price, half up once;
    tax once on the subtotal, half up."""
    lines: dict[tuple[str, str, Decimal], int] = {}
    for model, prompt, completion, when in ROWS:
        start = max(t for (m, t) in PRICES if m == model and t <= when)
        price_in, price_out = PRICES[(model, start)]
        lines[(model, "in", price_in)] = lines.get((model, "in", price_in), 0) + prompt
        lines[(model, "out", price_out)] = lines.get((model, "out", price_out), 0) + completion
    subtotal = sum(int((Decimal(tokens) * price / 10_000).quantize(Decimal(1), ROUND_HALF_UP)) for (_, _, price), tokens in lines.items())
    tax = int((Decimal(subtotal) * Decimal("0.19")).quantize(Decimal(1), ROUND_HALF_UP))
    return subtotal, tax, subtotal + tax


def dollars(cents: int) -> str:
    return f"${cents // 100:,}.{cents % 100:02d}"


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu",
                                                                    "--disable-background-networking"])
        yield b
        await b.close()


async def shot(page: Page, name: str) -> None:
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


async def log_in(page: Page, base_url: str, key: str) -> None:
    await page.goto(base_url + "/dashboard/login")
    await page.fill("input[name=api_key]", key)
    await page.click("button[type=submit]")


async def charts_settled(page: Page) -> None:
    """Every chart on the page drew (ready) or said it has nothing to draw (empty)."""
    charts = page.locator("[data-chart]")
    for i in range(await charts.count()):
        await expect(charts.nth(i)).to_have_attribute("data-state", re.compile("^(ready|empty)$"), timeout=20_000)


async def download_pdf(page: Page, row: Any) -> str:
    async with page.expect_download() as info:
        await row.locator("a.invoice-pdf").click()
    download = await info.value
    path = await download.path()
    assert path is not None, await download.failure()
    data = Path(path).read_bytes()
    assert data.startswith(b"%PDF-")
    return "\n".join(p.extract_text() for p in PdfReader(io.BytesIO(data)).pages)


async def test_admin_and_customer_download_invoices_from_the_dashboard(browser: Browser, fresh_pg_database: Any, tmp_path: Path) -> None:
    db_url = fresh_pg_database(migrated=True)
    migrate.upgrade(db_url)
    db = create_engine(db_url)
    try:
        book = PriceBook(db)
        for (model, start), (price_in, price_out) in PRICES.items():
            await book.add(model, str(price_in), str(price_out), start, backdate=True)
        account = await new_account(db, f"acme-{uuid.uuid4().hex[:6]}")
        other = await new_account(db, f"other-{uuid.uuid4().hex[:6]}")
        await write_records(db, [
            UsageRecord(request_id=uuid.uuid4().hex, account_id=acct, key_id=1, model=model, prompt_tokens=prompt,
                        completion_tokens=completion, status="completed", finish_reason="stop", total_ms=5.0, cost_nanos=1,
                        created_at=when + timedelta(milliseconds=5), admitted_at=when)
            for acct in (account, other) for model, prompt, completion, when in ROWS
        ])
        recent = datetime.now(timezone.utc) - timedelta(days=3)  # a tiny spend this month: $0.0002
        await write_records(db, [UsageRecord(
            request_id=uuid.uuid4().hex, account_id=account, key_id=1, model="alpha", prompt_tokens=1000, completion_tokens=0,
            status="completed", finish_reason="stop", total_ms=5.0, cost_nanos=200_000, created_at=recent)])
        customer_key = await new_key(db, account)
        subtotal, tax, total = by_hand()

        with serve(db_url, tmp_path, **SELLER) as app:
            async with app.admin() as api:
                r = await api.put(f"/admin/accounts/{account}/billing_details", json={
                    "legal_name": "Acme Analytics GmbH", "address_line1": "Hauptstraße 1", "postal_code": "10115",
                    "city": "Berlin", "country": "DE", "email": "ap@acme.example", "tax_id": "DE123456789"})
                assert r.status_code == 200, r.text
                assert (await api.put("/admin/tax_rates/DE", json={"rate": "19.000"})).status_code == 200
                assert (await api.post(f"/admin/accounts/{account}/prices", json={
                    "model": "gamma", "input_per_million": "3.000", "output_per_million": "4.000"})).status_code == 201
                closed = (await api.post("/admin/invoices/close", json={"period": "2026-09"})).json()
                assert closed["invoices_created"] == 2, closed
                invoice = (await api.get("/admin/invoices", params={"account_id": account})).json()["data"][0]
                theirs = (await api.get("/admin/invoices", params={"account_id": other})).json()["data"][0]
            assert (invoice["subtotal_cents"], invoice["tax"]["amount_cents"], invoice["total_cents"]) == (subtotal, tax, total)
            due = invoice["due_at"][:10]

            # Without a session the download is the login page, not the document.
            async with httpx.AsyncClient(base_url=app.base_url, follow_redirects=False) as anonymous:
                r = await anonymous.get(f"/dashboard/invoices/{invoice['id']}/pdf")
                assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"

            admin = Watched(await browser.new_context(accept_downloads=True))
            page = await admin.page()
            await log_in(page, app.base_url, app.admin_key)
            await expect(page).to_have_url(re.compile(r"/dashboard/admin$"))
            await page.goto(f"{app.base_url}/dashboard/admin/accounts/{account}")
            billing = page.locator("#billing")
            await expect(billing.locator("#billing-state")).to_contain_text("Active")
            row = billing.locator(f"#invoices-table tbody tr[data-invoice-id='{invoice['id']}']")
            await expect(row).to_contain_text(invoice["number"])
            await expect(row).to_contain_text(dollars(total))
            await expect(row).to_contain_text(due)
            await expect(row).to_contain_text("not sent")  # no Stripe configured
            await expect(billing.locator("#overrides-table")).to_contain_text("gamma")
            await expect(billing.locator("#overrides-table")).to_contain_text("$3.000")
            await charts_settled(page)
            assert "total_cents" not in await billing.inner_text()  # no raw field names or cents
            await shot(page, "01-admin-account-billing")

            text = await download_pdf(page, row)
            for part in ("Tollgate Networks Ltd", "GB999999973", "Acme Analytics GmbH", "DE123456789", f"Due date: {due}",
                         f"Tax (19.000%): {dollars(tax)}", f"Total (USD): {dollars(total)}", f"Invoice {invoice['number']}"):
                assert part in text, (part, text)

            # The HTML document opens in a tab from the same session.
            async with page.context.expect_page() as tab_info:
                await row.locator("a.invoice-html").click()
            tab = await tab_info.value
            await expect(tab.locator("h1")).to_have_text(f"Invoice {invoice['number']}")
            await expect(tab.locator("body")).to_contain_text("Tax (19.000%)")
            await shot(tab, "02-invoice-html")
            await tab.close()

            # Edit the billing details from the page: a bad value is a 400 page naming it, a good one is saved.
            form = page.locator("#billing-details-form")
            await form.locator("input[name=tax_rate]").fill("19.0001")
            await form.locator("button[type=submit]").click()
            await expect(page.locator("p.error")).to_contain_text("tax_rate")
            await form.locator("input[name=tax_rate]").fill("")
            await form.locator("input[name=email]").fill("invoices@acme.example")
            await form.locator("button[type=submit]").click()
            await expect(page).to_have_url(re.compile(rf"/dashboard/admin/accounts/{account}"))
            await expect(page.locator("#billing-details-form input[name=email]")).to_have_value("invoices@acme.example")
            async with app.admin() as api:
                saved = (await api.get(f"/admin/accounts/{account}/billing_details")).json()
                assert saved["email"] == "invoices@acme.example" and saved["country"] == "DE"
                assert (await api.get(f"/admin/invoices/{invoice['id']}")).json()["buyer"]["email"] == "ap@acme.example"
            # A failed payment: the page says past due, since when, until when, and why.
            failed = datetime.now(timezone.utc) - timedelta(days=2)
            async with db.begin() as conn:
                await conn.execute(sa.text("UPDATE invoices SET payment_failed_at = :t WHERE id = :i"), {"t": failed, "i": invoice["id"]})
                await conn.execute(sa.text("INSERT INTO billing_accounts (account_id, state, delinquent_since, updated_at) "
                                           "VALUES (:a, 'past_due', :t, now())"), {"a": account, "t": failed})
            await page.goto(f"{app.base_url}/dashboard/admin/accounts/{account}")
            state = page.locator("#billing-state")
            await expect(state).to_contain_text("Past due")
            await expect(state).to_contain_text(f"since {failed.date().isoformat()}")
            await expect(state).to_contain_text(f"suspended from {(failed + timedelta(days=7)).date().isoformat()}")
            await expect(page.locator("#billing-reasons")).to_contain_text(f"invoice {invoice['number']} ({dollars(total)}) unpaid, payment failed")
            await shot(page, "06-admin-account-past-due")
            admin.problems = [p for p in admin.problems if "status of 400" not in p]  # the refused form above
            assert admin.problems == [], admin.problems

            # The customer: its own invoice by clicking, nobody else's.
            customer = Watched(await browser.new_context(accept_downloads=True))
            cpage = await customer.page()
            await log_in(cpage, app.base_url, customer_key)
            await expect(cpage).to_have_url(re.compile(r"/dashboard/account$"))
            table = cpage.locator("#invoices-table")
            await expect(table.locator("tbody tr")).to_have_count(1)
            crow = table.locator(f"tbody tr[data-invoice-id='{invoice['id']}']")
            await expect(crow).to_contain_text(dollars(total))
            assert await table.locator("th", has_text="Stripe").count() == 0
            # Money ticks: one format, every label distinct, for a spend of $0.0002 (not "$0.0001, $0, $0").
            spend = cpage.locator("#chart-spend")
            await expect(spend).to_have_attribute("data-state", "ready", timeout=20_000)
            ticks = [t.strip() for t in await spend.locator(".ytick text").all_text_contents()]
            assert len(ticks) >= 3 and len(set(ticks)) == len(ticks), ticks
            assert all(re.fullmatch(r"\$0\.\d{5}", t) for t in ticks), ticks
            counts = cpage.locator("#chart-requests")
            await expect(counts).to_have_attribute("data-state", "ready", timeout=20_000)
            assert [t.strip() for t in await counts.locator(".ytick text").all_text_contents()] == ["0", "1"]  # not "200m"
            await charts_settled(cpage)
            await shot(cpage, "03-customer-invoices")
            text = await download_pdf(cpage, crow)
            assert "Acme Analytics GmbH" in text and f"Total (USD): {dollars(total)}" in text and f"Due date: {due}" in text
            await cpage.goto(f"{app.base_url}/dashboard/account?days=1")  # nothing in the last 24 hours
            for selector in ("#chart-tokens", "#chart-spend", "#chart-requests"):
                chart = cpage.locator(selector)
                await expect(chart).to_have_attribute("data-state", "empty", timeout=20_000)
                await expect(chart).to_contain_text("No usage in this range")
            assert await cpage.locator(".main-svg").count() == 0  # no bare axes
            await shot(cpage, "04-customer-empty-range")
            response = await cpage.goto(f"{app.base_url}/dashboard/invoices/{theirs['id']}/pdf")
            assert response is not None and response.status == 404
            await expect(cpage.locator("body")).to_contain_text("No such invoice")
            assert theirs["number"] not in await cpage.content()
            customer.problems = [p for p in customer.problems if "404" not in p]  # the refused download above
            assert customer.problems == [], customer.problems

            # The login form: label, field and button share one left edge and the field fills the card.
            login = await (await browser.new_context()).new_page()
            await login.goto(app.base_url + "/dashboard/login")
            field = await login.locator("input[name=api_key]").bounding_box()
            button = await login.locator("button[type=submit]").bounding_box()
            card = await login.locator(".card.narrow form").bounding_box()
            assert field and button and card
            assert abs(field["x"] - card["x"]) < 1 and abs(button["x"] - card["x"]) < 1 and field["width"] >= card["width"] - 1
            await shot(login, "05-login")
    finally:
        await db.dispose()
