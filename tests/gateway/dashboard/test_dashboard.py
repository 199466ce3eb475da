"""The dashboards in a real browser (Debian's Chromium driven by Playwright): the admin logs in,
creates an account and a key, sees the secret once; the key is used through the openai SDK; the
usage shows in the charts and tables; the customer logs in with that key and sees only its own
account. No console errors anywhere; screenshots go to tests/artifacts/dashboard/."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser, BrowserContext, Page, async_playwright, expect

from engines.backends.hf import HFEngine
from tests.conftest import MODEL, Gateway, start_gateway, stop_server

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "dashboard"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (make setup installs it)")


@pytest.fixture(scope="module")
def gateway(engine: HFEngine, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """This module's own gateway and database: the admin overview lists the top ten keys of all
    accounts, which in the shared session gateway are whichever other tests spent the most."""
    server, gw = start_gateway(fresh_pg_database(migrated=True), engine, tmp_path_factory.mktemp("gw-dashboard"))
    try:
        yield gw
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as p:
        b = await p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield b
        await b.close()


class Watched:
    """A browser context whose console errors, page errors and failed requests are collected."""

    def __init__(self, context: BrowserContext) -> None:
        self.context = context
        self.problems: list[str] = []

    async def page(self) -> Page:
        page = await self.context.new_page()
        page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        # ERR_ABORTED is the browser dropping a load because the test navigated on: not a fault.
        page.on("requestfailed", lambda r: None if "ERR_ABORTED" in (r.failure or "") else self.problems.append(f"request failed: {r.url} {r.failure}"))
        return page


async def shot(page: Page, name: str) -> None:
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


async def log_in(page: Page, gw: Gateway, key: str) -> None:
    await page.goto(gw.base_url + "/dashboard")
    await expect(page).to_have_url(re.compile(r"/dashboard/login$"))
    await page.fill("input[name=api_key]", key)
    await page.click("button[type=submit]")


async def chart_ready(page: Page, selector: str) -> dict[str, str]:
    chart = page.locator(selector)
    await expect(chart).to_have_attribute("data-state", "ready", timeout=20_000)
    await expect(chart.locator(".main-svg").first).to_be_visible()
    return {"traces": await chart.get_attribute("data-traces") or "", "total": await chart.get_attribute("data-total") or ""}


def cell(page: Page, table: str, row: str, column: int) -> Any:
    return page.locator(f"{table} tbody tr{row} td").nth(column)


MARKUP = '<a href="https://evil.example/phish"><span style="font-size:40px">browser key</span></a>'


async def test_admin_and_customer_journey(browser: Browser, gateway: Gateway, client_for: Any) -> None:
    # Someone else's usage, which the customer must never see.
    stranger = await gateway.new_key(name="stranger-key")
    stranger_account = next(a for a in (await admin_accounts(gateway)) if a["id"] == stranger["account_id"])
    await client_for(stranger["key"]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3)

    admin = Watched(await browser.new_context())
    page = await admin.page()
    await log_in(page, gateway, gateway.admin_key)
    await expect(page).to_have_url(re.compile(r"/dashboard/admin$"))
    cookie = next(c for c in await admin.context.cookies() if c["name"] == "tollgate_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    await shot(page, "01-admin-overview-before")

    # Create an account and a key; the secret is shown once.
    name = f"browser-{uuid.uuid4().hex[:6]}"
    await page.click("header nav >> text=Accounts")
    await page.fill("#create-account input[name=name]", name)
    await page.click("#create-account button")
    await expect(page.locator("h1")).to_contain_text(name)
    account_url = page.url
    # Markup in a key's name is text everywhere, plotly's legends included (it drew it as a live link)
    await page.fill("#create-key input[name=name]", MARKUP)
    await page.click("#create-key button")
    secret = (await page.locator("#new-key-secret").inner_text()).strip()
    assert secret.startswith("sk-") and len(secret) > 40
    await shot(page, "02-key-created-secret-once")
    await page.goto(account_url)
    await expect(page.locator("#keys-table")).to_contain_text(secret[:11])
    assert await page.locator("#new-key").count() == 0 and secret not in await page.content()

    # Use the key through the official SDK: one plain request, one stream with usage.
    client = client_for(secret)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8, temperature=0)
    first = raw.parse()
    rids = [raw.headers["x-request-id"]]
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        rids.append(chunk.id.removeprefix("chatcmpl-"))
    assert usage is not None and first.usage is not None
    tokens = first.usage.total_tokens + usage.total_tokens
    for rid in set(rids):
        await gateway.ledger_row(rid)
    await gateway.app.state.ledger.flush(timeout=10)

    # The admin sees it on the account page: the key's row and the charts by key.
    await page.goto(account_url)
    key_row = page.locator("#keys-table tbody tr", has_text=secret[:11])
    await expect(key_row.locator("td").nth(4)).to_have_text("2")
    await expect(key_row.locator("td").nth(5)).to_have_text(f"{tokens:,}")
    chart = await chart_ready(page, "#chart-tokens")
    assert secret[:11] in chart["traces"] and float(chart["total"]) == tokens
    requests_chart = await chart_ready(page, "#chart-requests")
    assert requests_chart["traces"] == "requests|errors|cancelled"

    # Limits and allowed models through the forms; quota use shows what is left.
    await page.fill("form.limits >> nth=-1 >> input[name=monthly_tokens]", "100000")
    await page.click("form.limits >> nth=-1 >> button")
    quota_row = page.locator("#quota-table tbody tr", has_text=name)
    await expect(quota_row).to_contain_text("monthly_tokens 100000")
    await expect(quota_row.locator("td").nth(4)).to_have_text(f"{100000 - tokens:,}")
    await key_row.locator("form.models input[name=models]").fill(MODEL)
    await key_row.locator("form.models button").click()
    await expect(page.locator("#keys-table tbody tr", has_text=secret[:11]).locator("form.models input[name=models]")).to_have_value(MODEL)
    async with gateway.admin_client() as c:
        keys = (await c.get("/admin/keys")).json()["data"]
    assert next(k for k in keys if k["prefix"] == secret[:11])["models"] == [MODEL]
    await shot(page, "03-admin-account-usage")

    # The overview: by model, top keys, latency, charts by model.
    await page.goto(gateway.base_url + "/dashboard/admin?days=7")
    await expect(page.locator("#models-table tbody tr[data-model]", has_text=MODEL)).to_be_visible()
    await expect(page.locator("#top-keys-table")).to_contain_text(secret[:11])
    latency_row = page.locator(f"#latency-table tbody tr[data-model='{MODEL}']")
    await expect(latency_row.locator("td").nth(2)).to_contain_text("ms")
    overview = await chart_ready(page, "#chart-tokens")
    assert MODEL in overview["traces"] and float(overview["total"]) >= tokens
    await chart_ready(page, "#chart-spend")
    await shot(page, "04-admin-overview-after")

    # The customer logs in with the key and sees only its own account.
    customer = Watched(await browser.new_context())
    cpage = await customer.page()
    await log_in(cpage, gateway, secret)
    await expect(cpage).to_have_url(re.compile(r"/dashboard/account$"))
    await expect(cpage.locator("h1")).to_contain_text(name)
    await expect(cpage.locator("#kpi-tokens")).to_have_text(f"{tokens:,}")
    await expect(cpage.locator("#keys-table tbody tr")).to_have_count(1)
    mine = await chart_ready(cpage, "#chart-tokens")
    assert float(mine["total"]) == tokens and mine["traces"] == MODEL
    by_key = await chart_ready(cpage, "#chart-keys")
    assert secret[:11] in by_key["traces"] and float(by_key["total"]) == tokens
    # The trace's name as plotly got it: entities, which it shows as the characters (it drew the raw
    # name's link and 40px span in a legend of several keys)
    assert "&lt;a href" in by_key["traces"] and "<a" not in by_key["traces"], by_key["traces"]
    assert await cpage.locator("#chart-keys a").count() == 0
    await expect(cpage.locator("#quota-table")).to_contain_text("monthly_tokens 100000")
    html = await cpage.content()
    for foreign in (stranger["prefix"], stranger_account["name"], "stranger-key", gateway.admin_key, secret):
        assert foreign not in html
    await shot(cpage, "05-customer-view")

    # A customer session cannot open the console (Chromium logs the refused page load, nothing else).
    assert customer.problems == []
    response = await cpage.goto(gateway.base_url + "/dashboard/admin")
    assert response is not None and response.status == 403
    assert [p for p in customer.problems if "403 (Forbidden)" not in p] == []
    customer.problems.clear()
    await expect(cpage.locator("h1")).to_have_text("Admins only")
    await shot(cpage, "06-customer-refused-admin")

    # Revoking the key ends the customer's session; logging out ends the admin's.
    await page.goto(account_url)
    await page.locator("#keys-table tbody tr", has_text=secret[:11]).locator("form.revoke button").click()
    await expect(page.locator("#keys-table tbody tr", has_text=secret[:11])).to_contain_text("revoked")
    await cpage.goto(gateway.base_url + "/dashboard/account")
    await expect(cpage).to_have_url(re.compile(r"/dashboard/login$"))
    await page.click("header .logout button")
    await expect(page).to_have_url(re.compile(r"/dashboard/login$"))
    await page.goto(gateway.base_url + "/dashboard/admin")
    await expect(page).to_have_url(re.compile(r"/dashboard/login$"))

    assert admin.problems == [] and customer.problems == []
    await admin.context.close()
    await customer.context.close()


async def admin_accounts(gw: Gateway) -> list[dict[str, Any]]:
    async with gw.admin_client() as c:
        return (await c.get("/admin/accounts")).json()["data"]
