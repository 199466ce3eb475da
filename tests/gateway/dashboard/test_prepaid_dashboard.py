"""Cached input tokens and prepaid statements on the dashboards, in a real browser (Debian's
Chromium driven by Playwright), issue 25: the customer's and the admin's "By model" tables show
the cached prompt tokens and what they cost, equal to the figure computed here from the ledger
rows and the price versions (one hour holds a price change, so its rows are priced one by one);
the customer's prepaid section lists its monthly statement, whose PDF downloads by a click, and
another account's statement is a 404 page; a balance alert shows on both pages, and the admin's
account page shows the balance, the credit rows and a custom price's cached-input price. Screenshots go to tests/artifacts/prepaid/."""

from __future__ import annotations

import io
import re
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from playwright.async_api import Browser, expect
from pypdf import PdfReader

from billing import migrate
from billing.credits.balance import CreditBook
from billing.db import create_engine
from billing.ledger.writer import UsageRecord, write_records
from billing.invoices.periods import Period
from billing.prices.book import PriceBook
from gateway.dashboard.pages import fmt_int, fmt_usd
from tests.billing.invoice_helpers import new_account, new_key, serve
from tests.billing.alerts.test_alerts import Receiver
from tests.gateway.dashboard.test_dashboard import CHROMIUM, Watched
from tests.gateway.dashboard.test_invoice_dashboard import browser, log_in  # noqa: F401  (the browser fixture)

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "prepaid"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (make setup installs it)")


def from_ledger(rows: list[Any], versions: list[tuple[datetime, Decimal]]) -> int:
    """nano-USD of the cached prompt tokens: each row's (at most its prompt) x the cached price in force when admitted."""
    total = Decimal(0)
    for cached, prompt, admitted in rows:
        admitted = admitted if admitted.tzinfo else admitted.replace(tzinfo=timezone.utc)
        unit = max((v for v in versions if v[0] <= admitted), key=lambda v: v[0])[1]
        total += min(int(cached), int(prompt)) * unit * 1000
    assert total == int(total)
    return int(total)


async def test_dashboards_show_cached_tokens_and_their_cost_and_the_prepaid_statement(
    browser: Browser, fresh_pg_database: Any, tmp_path: Path,  # noqa: F811
) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    db_url = fresh_pg_database(migrated=True)
    migrate.upgrade(db_url)
    db = create_engine(db_url)
    try:
        month = Period.containing(datetime.now(timezone.utc))
        change = month.start - timedelta(hours=3) + timedelta(minutes=30)  # a price change half-way through an hour
        versions = [(month.start - timedelta(days=40), Decimal("0.125")), (change, Decimal("0.250"))]
        book = PriceBook(db)
        await book.add("m", "1.250", "2.500", versions[0][0], backdate=True, cached_input_per_million="0.125")
        await book.add("m", "1.500", "3.000", change, backdate=True, cached_input_per_million="0.250")
        credits = CreditBook(db)
        accounts = [await new_account(db, f"{name}-{uuid.uuid4().hex[:6]}") for name in ("cache-co", "other-co")]
        for a in accounts:
            await credits.set_mode(a, "prepaid")
            async with db.begin() as conn:
                await conn.execute(sa.text("UPDATE accounts SET prepaid_since = :t WHERE id = :a"), {"t": month.start - timedelta(days=20), "a": a})
            await credits.add(a, "topup", 5 * 10**9, now=month.start - timedelta(days=10), external_id=f"cs_test_{a}")
        a, other = accounts
        # (prompt, completion, cached, admitted): before and after the change in one hour, another day, an engine that said nothing
        usage = [(1000, 50, 600, change - timedelta(minutes=20)), (2000, 10, 1500, change + timedelta(minutes=10)),
                 (500, 5, 500, month.start - timedelta(days=2)), (300, 3, None, month.start - timedelta(days=1))]
        records = []
        for acct in (a, other):
            for prompt, completion, cached, admitted in usage:
                price = book.price_for(acct, "m", admitted)
                assert price is not None
                records.append(UsageRecord(
                    request_id=uuid.uuid4().hex, account_id=acct, key_id=1, model="m", prompt_tokens=prompt, completion_tokens=completion,
                    status="completed", finish_reason="stop", total_ms=5.0, cost_nanos=price.cost_nanos(prompt, completion, cached),
                    cached_tokens=cached, created_at=admitted + timedelta(milliseconds=5), admitted_at=admitted))
        await write_records(db, records)
        async with db.connect() as conn:
            ledger = (await conn.execute(sa.text(
                "SELECT cached_tokens, prompt_tokens, admitted_at FROM ledger_entries WHERE account_id = :a AND cached_tokens > 0"),
                {"a": a})).all()
        expected_cost = from_ledger(ledger, versions)  # 600 x 125 + 1,500 x 250 + 500 x 125 = 512,500 nano-USD
        expected_tokens = sum(int(r[0]) for r in ledger)
        assert (expected_cost, expected_tokens) == (512_500, 2600)
        key = await new_key(db, a)

        with serve(db_url, tmp_path, TOLLGATE_CREDITS_CHECK_SECONDS="0") as app, Receiver() as receiver:
            async with app.admin() as api:
                rule = await api.post(f"/admin/accounts/{a}/alerts", json={"metric": "balance_below", "threshold": "10.00", "url": receiver.url})
                assert rule.status_code == 201, rule.text
                assert len((await api.post("/admin/credits/housekeeping")).json()["alerts"]) == 1  # $4.99... < $10: one crossing
                future = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat()
                override = await api.post(f"/admin/accounts/{a}/prices", json={
                    "model": "m", "input_per_million": "2.000", "output_per_million": "4.000", "cached_input_per_million": "0.500",
                    "effective_from": future})
                assert override.status_code == 201 and override.json()["cached_input_per_million"] == "0.500", override.text
                closed = (await api.post("/admin/invoices/close", json={"period": str(month.minus(1))})).json()
                assert len(closed["statement_ids"]) == 2, closed
                mine = (await api.get("/admin/statements", params={"account_id": a})).json()["data"][0]
                theirs = (await api.get("/admin/statements", params={"account_id": other})).json()["data"][0]

            customer = Watched(await browser.new_context(accept_downloads=True))
            page = await customer.page()
            await log_in(page, app.base_url, key)
            await page.goto(f"{app.base_url}/dashboard/account?days=90")
            row = page.locator("#models-table tbody tr[data-model='m']")
            await expect(row.locator("td.cached-tokens")).to_have_text(fmt_int(expected_tokens))
            await expect(row.locator("td.cached-cost")).to_have_text(fmt_usd(expected_cost))  # $0.0005125
            statement = page.locator(f"#statements-table tbody tr[data-statement-id='{mine['id']}']")
            await expect(statement).to_contain_text(mine["number"])
            await expect(statement).to_contain_text(fmt_usd(mine["closing_balance_nanos"]))
            await expect(page.locator(f"#statements-table tbody tr[data-statement-id='{theirs['id']}']")).to_have_count(0)
            alert = "The prepaid balance of account"
            await expect(page.locator("#alerts-table")).to_contain_text(alert)
            await page.screenshot(path=str(ARTIFACTS / "01-customer-cached-and-statement.png"), full_page=True)
            async with page.expect_download() as info:
                await statement.locator("a.statement-pdf").click()
            path = await (await info.value).path()
            assert path is not None
            text = "\n".join(p.extract_text() for p in PdfReader(io.BytesIO(Path(path).read_bytes())).pages)
            for part in (f"Prepaid statement {mine['number']}", "No amount due", "Amount due: $0.00",
                         f"Closing balance ({month.start:%Y-%m-%d}): {fmt_usd(mine['closing_balance_nanos'])}"):
                assert part in text, (part, text)
            assert customer.problems == []
            refused = await page.goto(f"{app.base_url}/dashboard/statements/{theirs['id']}/pdf")
            assert refused is not None and refused.status == 404
            await expect(page.locator("body")).not_to_contain_text(theirs["number"])

            admin = Watched(await browser.new_context())
            page = await admin.page()
            await log_in(page, app.base_url, app.admin_key)
            await expect(page).to_have_url(re.compile(r"/dashboard/admin$"))
            await page.goto(f"{app.base_url}/dashboard/admin?days=90")
            row = page.locator("#models-table tbody tr[data-model='m']")  # both accounts: twice the figures
            await expect(row.locator("td.cached-tokens")).to_have_text(fmt_int(2 * expected_tokens))
            await expect(row.locator("td.cached-cost")).to_have_text(fmt_usd(2 * expected_cost))
            await page.goto(f"{app.base_url}/dashboard/admin/accounts/{a}")
            await expect(page.locator("#billing #statements-table")).to_contain_text(mine["number"])
            balance = (await CreditBook(db).balance(a))["balance_nanos"]  # type: ignore[index]
            await expect(page.locator("#prepaid #admin-credit-balance")).to_have_text(fmt_usd(balance))
            await expect(page.locator("#prepaid #credit-entries-table")).to_contain_text(f"cs_test_{a}")
            await expect(page.locator("#account-alerts")).to_contain_text(alert)
            await expect(page.locator("#overrides-table")).to_contain_text("$0.500")  # the custom price's cached price
            await page.screenshot(path=str(ARTIFACTS / "02-admin-cached-and-statements.png"), full_page=True)
            assert admin.problems == []
    finally:
        await db.dispose()


def test_dashboard_amounts_keep_their_sign_below_a_dollar() -> None:
    """A refund, a negative adjustment or an overdrawn balance shows its minus sign whatever its size
    (before, -$0.10 showed as $0.10: the sign went with int("-0"), and -$1 showed as $-1.00)."""
    shown = [fmt_usd(n) for n in (-1, -100_000_000, -999_999_999, -1_000_000_000, -1_234_567_890_000, 0, 1_500_000_000)]
    assert shown == ["-$0.000000001", "-$0.10", "-$0.999999999", "-$1.00", "-$1,234.56789", "$0.00", "$1.50"]
