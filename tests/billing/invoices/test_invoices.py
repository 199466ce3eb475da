"""Monthly invoices on real Postgres: amounts by hand, mid-month price changes, account overrides,
idempotent and resumable closes, late usage as adjustments, two instances at once, the APIs,
HTML and PDF."""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pypdf import PdfReader

from billing.db import create_engine
from billing.invoices.views import get_invoice, list_invoices
from billing.ledger.writer import UsageRecord, write_records
from billing.invoices.close import CloseInProgress, PeriodNotEnded, close_lock, close_period, line_amount_cents, period_status
from billing.invoices.periods import InvalidPeriod, Period
from billing.prices.book import EffectivePrice, InvalidPrice, PriceBook
from billing.config import BillingConfig
from billing.invoices.scheduler import MonthlyClose, due_period
from tests import cli_runner
from tests.billing.invoice_helpers import at, new_account, new_key, price_history, serve, usage

SEPT, OCT, NOV = Period.month(2026, 9), Period.month(2026, 10), Period.month(2026, 11)
AFTER_OCT = at(11, 1, 2)  # "now" for closes in these tests
LATER = at(12, 2, 0)


async def september(db: Any) -> dict[str, int]:
    """The scenario computed by hand in test_close_prices_change_mid_month_with_override."""
    book = PriceBook(db)
    await price_history(book)
    a, b, c = await new_account(db, "a-corp"), await new_account(db, "b-resale"), await new_account(db, "c-idle")
    await book.add_override(b, "*", multiplier="0.85", effective_from=at(8, 1, 0), backdate=True)
    await book.add_override(b, "beta", input_per_million="0.500", output_per_million="1.250", effective_from=at(9, 10, 12), backdate=True)
    # a: alpha at v1, then v2 from the 16th (boundary rows on both sides), beta, and rows not billed
    await usage(db, a, "alpha", 1_000_000, 250_000, at(9, 5, 10))
    await usage(db, a, "alpha", 30_000, 0, at(9, 15, 23, 59, 59, 999_999), status="cancelled")
    await usage(db, a, "alpha", 25_000, 10_001, at(9, 16, 0))
    await usage(db, a, "alpha", 2_500_000, 67_776, at(9, 20))
    await usage(db, a, "alpha", 999_999, 999_999, at(9, 21), status="error")
    await usage(db, a, "beta", 12_345, 6_789, at(9, 25))
    await usage(db, a, "alpha", 5_000_000, 0, at(8, 31, 23, 59, 59))
    await usage(db, a, "alpha", 5_000_000, 0, at(10, 1, 0))
    # b: multiplier 0.85 everywhere, a custom beta price from Sep 10 12:00, an unpriced model
    await usage(db, b, "alpha", 1_000_000, 100_000, at(9, 3))
    await usage(db, b, "alpha", 400_000, 0, at(9, 18))
    await usage(db, b, "beta", 100_000, 40_000, at(9, 5))
    await usage(db, b, "beta", 100_000, 40_000, at(9, 12))
    await usage(db, b, "gamma", 500, 500, at(9, 7))
    return {"a": a, "b": b, "c": c}


def lines_of(invoice: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(l["kind"], l["usage_period"], l["model"], l["direction"], l["tokens"], l["unit_price_per_million"], l["amount_cents"])
            for l in invoice["lines"]]


async def test_close_prices_change_mid_month_with_override(db: Any) -> None:
    ids = await september(db)
    book = PriceBook(db)
    result = await close_period(db, book, SEPT, now=AFTER_OCT)
    assert result.status == "closed" and len(result.created) == 2 and result.existing == []

    invoices = {i["account_id"]: i for i in await list_invoices(db, period="2026-09")}
    assert set(invoices) == {ids["a"], ids["b"]}  # c used nothing: no invoice

    a = invoices[ids["a"]]
    assert lines_of(a) == [
        # 1,030,000 x 0.150 / 1e6 = $0.1545 -> 15.45c -> 15c; 250,000 x 0.600 = $0.15 -> 15c
        ("usage", "2026-09", "alpha", "input", 1_030_000, "0.150", 15),
        ("usage", "2026-09", "alpha", "output", 250_000, "0.600", 15),
        # 2,525,000 x 0.200 = $0.505 -> 50.5c -> 51c (half up, not to even); 77,777 x 0.800 = 6.22216c -> 6c
        ("usage", "2026-09", "alpha", "input", 2_525_000, "0.200", 51),
        ("usage", "2026-09", "alpha", "output", 77_777, "0.800", 6),
        # 12,345 x 1.000 = 1.2345c -> 1c; 6,789 x 2.000 = 1.3578c -> 1c
        ("usage", "2026-09", "beta", "input", 12_345, "1.000", 1),
        ("usage", "2026-09", "beta", "output", 6_789, "2.000", 1),
    ]
    assert a["total_cents"] == 89 and a["total"] == "0.89" and a["status"] == "open"
    assert a["number"] == "US-000001" and a["document"] == "usage_statement"  # no seller identity configured

    b = invoices[ids["b"]]
    assert lines_of(b) == [
        # x0.85: 1,000,000 x 0.1275 = 12.75c -> 13c; 100,000 x 0.510 = 5.1c -> 5c; v2: 400,000 x 0.170 = 6.8c -> 7c
        ("usage", "2026-09", "alpha", "input", 1_000_000, "0.1275", 13),
        ("usage", "2026-09", "alpha", "output", 100_000, "0.510", 5),
        ("usage", "2026-09", "alpha", "input", 400_000, "0.170", 7),
        # beta x0.85 before the custom price: 100,000 x 0.850 = 8.5c -> 9c; 40,000 x 1.700 = 6.8c -> 7c
        ("usage", "2026-09", "beta", "input", 100_000, "0.850", 9),
        ("usage", "2026-09", "beta", "output", 40_000, "1.700", 7),
        # custom beta from Sep 10 12:00: 100,000 x 0.500 = 5c; 40,000 x 1.250 = 5c
        ("usage", "2026-09", "beta", "input", 100_000, "0.500", 5),
        ("usage", "2026-09", "beta", "output", 40_000, "1.250", 5),
        ("usage", "2026-09", "gamma", "input", 500, None, 0),
        ("usage", "2026-09", "gamma", "output", 500, None, 0),
    ]
    assert b["total_cents"] == 51 == sum(l["amount_cents"] for l in b["lines"])
    assert "not charged" in b["lines"][-1]["description"]
    assert "account multiplier x0.85" in b["lines"][0]["description"]
    used = {(v["model"], v["input_per_million"], (v["override"] or {}).get("kind")) for v in b["price_versions"]}
    assert used == {("alpha", "0.1275", "multiplier"), ("alpha", "0.170", "multiplier"), ("beta", "0.850", "multiplier"),
                    ("beta", "0.500", "price")}
    assert {v["price_version"]["effective_from"][:10] for v in a["price_versions"]} == {"2026-08-01", "2026-09-16"}

    # A re-run changes nothing: same invoices, same lines.
    again = await close_period(db, book, SEPT, now=LATER)
    assert again.created == [] and sorted(again.existing) == sorted(result.created)
    assert {i["account_id"]: i for i in await list_invoices(db, period="2026-09")} == invoices
    async with db.connect() as conn:
        assert (await conn.execute(sa.text("SELECT count(*) FROM invoice_lines"))).scalar_one() == 15

    # A closed period is never re-priced.
    with pytest.raises(InvalidPrice, match="closed"):
        await book.add("alpha", "9.000", "9.000", at(9, 20), backdate=True)
    with pytest.raises(InvalidPrice, match="past"):
        await book.add("alpha", "9.000", "9.000", at(10, 20))


async def test_late_usage_becomes_an_adjustment_once(db: Any) -> None:
    ids = await september(db)
    book = PriceBook(db)
    await close_period(db, book, SEPT, now=AFTER_OCT)
    # Rows for September that land after it closed, and October usage.
    await usage(db, ids["a"], "alpha", 50_000, 0, at(9, 29))  # v2: 50,000 x 0.200 = 1c
    await usage(db, ids["c"], "beta", 1_000_000, 0, at(9, 30, 23))  # c had no September invoice: $1.00
    await usage(db, ids["a"], "alpha", 100_000, 0, at(10, 2))  # 2c

    await close_period(db, book, OCT, now=AFTER_OCT)
    october = {i["account_id"]: i for i in await list_invoices(db, period="2026-10")}
    a = october[ids["a"]]
    assert lines_of(a) == [
        ("usage", "2026-10", "alpha", "input", 5_100_000, "0.200", 102),  # includes the Oct 1 00:00 row
        ("adjustment", "2026-09", "alpha", "input", 50_000, "0.200", 1),
    ]
    assert a["lines"][1]["description"].startswith("Late usage from 2026-09")
    assert a["total_cents"] == 103
    assert lines_of(october[ids["c"]]) == [("adjustment", "2026-09", "beta", "input", 1_000_000, "1.000", 100)]
    assert ids["b"] not in october

    # The September invoices are untouched; the next close bills nothing twice.
    assert (await get_invoice(db, [i for i in await list_invoices(db, period="2026-09") if i["account_id"] == ids["a"]][0]["id"]))["total_cents"] == 89
    await close_period(db, book, NOV, now=LATER)
    assert await list_invoices(db, period="2026-11") == []


async def test_interrupted_close_resumes_without_duplicates(db: Any) -> None:
    ids = await september(db)
    book = PriceBook(db)

    def crash(done: int, total: int) -> None:
        if done == 1:
            raise RuntimeError("power cut")

    with pytest.raises(RuntimeError, match="power cut"):
        await close_period(db, book, SEPT, now=AFTER_OCT, progress=crash)
    status = await period_status(db, SEPT)
    assert status is not None and status["status"] == "closing" and status["accounts_done"] == 1
    assert len(await list_invoices(db, period="2026-09")) == 1

    # Closing October first finishes September, then closes October.
    seen: list[tuple[int, int]] = []
    await close_period(db, book, OCT, now=AFTER_OCT, progress=lambda d, t: seen.append((d, t)))
    assert (await period_status(db, SEPT))["status"] == "closed"  # type: ignore[index]
    assert {i["account_id"] for i in await list_invoices(db, period="2026-09")} == {ids["a"], ids["b"]}
    assert seen[-1] == (3, 3)
    async with db.connect() as conn:
        counts = (await conn.execute(sa.text("SELECT account_id, period, count(*) FROM invoices GROUP BY 1, 2 HAVING count(*) > 1"))).all()
    assert counts == []


async def test_two_instances_close_at_once(db_url: str, db: Any) -> None:
    ids = await september(db)
    other = create_engine(db_url)
    try:
        first, second = await asyncio.gather(
            close_period(db, PriceBook(db), SEPT, now=AFTER_OCT), close_period(other, PriceBook(other), SEPT, now=AFTER_OCT)
        )
        assert sorted(first.created + second.created) == sorted(first.created + first.existing)
        assert len(first.created + second.created) == 2
        # The scheduler's tick does not wait: while the lock is held it skips.
        async with close_lock(db):
            with pytest.raises(CloseInProgress):
                await close_period(other, PriceBook(other), OCT, now=AFTER_OCT, wait=False)
            config = BillingConfig(close_delay_seconds=3600)
            assert await MonthlyClose(other, PriceBook(other), config, clock=lambda: at(10, 1, 2)).tick() is None
        # Two schedulers on the morning of Oct 1: September is closed already, nothing new.
        ticks = await asyncio.gather(*(MonthlyClose(e, PriceBook(e), config, clock=lambda: at(10, 1, 2)).tick() for e in (db, other)))
        assert all(t is None or t.created == [] for t in ticks)
        assert len(await list_invoices(db, period="2026-09")) == 2
    finally:
        await other.dispose()
    assert ids


async def test_scheduler_closes_the_month_after_the_delay(db: Any) -> None:
    ids = await september(db)
    config = BillingConfig(close_delay_seconds=3600)
    assert due_period(at(10, 1, 0, 30), 3600) == Period.month(2026, 8)  # within the delay: August is the latest due
    job = MonthlyClose(db, PriceBook(db), config, clock=lambda: at(10, 1, 1, 30))
    result = await job.tick()
    assert result is not None and result.period == "2026-09" and len(result.created) == 2
    assert await job.tick() is None
    assert {i["account_id"] for i in await list_invoices(db, period="2026-09")} == {ids["a"], ids["b"]}


async def test_periods_and_rounding_rule() -> None:
    for bad in ("2026-13", "2026-1", "26-01", "2026/01", "", "2026-00"):
        with pytest.raises(InvalidPeriod):
            Period.parse(bad)
    assert Period.parse("2026-12").end == at(1, 1, 0, year=2027)
    assert line_amount_cents(25_000, Decimal("0.200")) == 1  # 0.5c rounds up
    assert line_amount_cents(24_999, Decimal("0.200")) == 0
    assert line_amount_cents(74_999, Decimal("0.200")) == 1  # 1.49998c
    # the largest line: 1e15 tokens at the largest price, with no digit lost
    assert line_amount_cents(10**15, Decimal("999999999999999.999")) == 10**8 * 999_999_999_999_999_999
    assert line_amount_cents(5, None) == 0
    # per request, an effective price rounds half up to whole nano-USD: 0.1275/1M = 127.5 nanos a token
    book_price = EffectivePrice("m", Decimal("0.1275"), Decimal("0.51"), "USD", None, None)
    assert (book_price.cost_nanos(1, 0), book_price.cost_nanos(3, 0), book_price.cost_nanos(0, 1)) == (128, 383, 510)


async def test_period_not_ended_is_refused(db: Any) -> None:
    with pytest.raises(PeriodNotEnded):
        await close_period(db, PriceBook(db), NOV, now=at(11, 30, 23, 59))


async def test_admin_and_customer_api_json_html_pdf(db_url: str, db: Any, tmp_path: Path) -> None:
    ids = await september(db)
    key_a, key_b = await new_key(db, ids["a"]), await new_key(db, ids["b"])
    with serve(db_url, tmp_path) as app:
        async with app.admin() as admin:
            r = await admin.post("/admin/invoices/close", json={"period": "2026-09"})
            assert r.status_code == 200, r.text
            assert r.json()["invoices_created"] == 2 and r.json()["total"] == "1.40"
            again = (await admin.post("/admin/invoices/close", json={"period": "2026-09"})).json()
            assert again["invoices_created"] == 0 and again["invoices_existing"] == 2
            assert (await admin.get("/admin/billing/periods/2026-09")).json()["status"] == "closed"
            listed = (await admin.get("/admin/invoices", params={"period": "2026-09", "account_id": ids["a"]})).json()["data"]
            assert [i["total"] for i in listed] == ["0.89"]
            inv_a = listed[0]
            full = (await admin.get(f"/admin/invoices/{inv_a['id']}")).json()
            assert full["stripe"]["invoice_id"] is None and len(full["lines"]) == 6

            html = await admin.get(f"/admin/invoices/{inv_a['id']}/html")
            assert html.headers["content-type"].startswith("text/html")
            assert inv_a["number"] in html.text and "$0.89" in html.text and "a-corp" in html.text
            pdf = await admin.get(f"/admin/invoices/{inv_a['id']}/pdf")
            assert pdf.headers["content-type"] == "application/pdf" and pdf.content.startswith(b"%PDF")
            text = "".join(page.extract_text() for page in PdfReader(io.BytesIO(pdf.content)).pages)
            assert inv_a["number"] in text and "Total (USD): $0.89" in text and "2,525,000" in text

            # bad input: OpenAI-shaped errors with the right status, never 500
            this_month = time.strftime("%Y-%m", time.gmtime())  # the clock's month has not ended, whenever this runs
            for body, code in (({"period": "2026-13"}, "invalid_value"), ({"period": this_month}, "period_not_ended"),
                               ({"period": 202609}, "invalid_value"), ({}, "missing_required_parameter")):
                r = await admin.post("/admin/invoices/close", json=body)
                assert r.status_code == 400 and r.json()["error"]["code"] == code, (body, r.text)
            r = await admin.post("/admin/invoices/close", content=b"{nope")
            assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
            for path in ("/admin/invoices/abc", "/admin/invoices/999999", f"/admin/invoices/{inv_a['id']}/xml",
                         "/admin/billing/periods/2026-08"):
                assert (await admin.get(path)).status_code == 404, path
            assert (await admin.get("/admin/invoices", params={"period": "sept"})).status_code == 400
            assert (await admin.post(f"/admin/invoices/{inv_a['id']}/sync")).json()["error"]["code"] == "stripe_not_configured"

        async with app.as_key(key_a) as customer:
            mine = (await customer.get("/v1/invoices")).json()["data"]
            assert [i["id"] for i in mine] == [inv_a["id"]] and "stripe" not in mine[0]
            assert (await customer.get(f"/v1/invoices/{inv_a['id']}/pdf")).content.startswith(b"%PDF")
            others = [i for i in await list_invoices(db) if i["account_id"] == ids["b"]][0]
            r = await customer.get(f"/v1/invoices/{others['id']}")
            assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
            assert (await customer.get("/admin/invoices")).status_code == 403
        async with app.as_key(key_b) as customer:
            assert [i["total"] for i in (await customer.get("/v1/invoices")).json()["data"]] == ["0.51"]


async def test_price_override_api(db_url: str, db: Any, tmp_path: Path) -> None:
    book = PriceBook(db)
    await price_history(book)
    account = await new_account(db)
    with serve(db_url, tmp_path) as app:
        async with app.admin() as admin:
            url = f"/admin/accounts/{account}/prices"
            r = await admin.post(url, json={"model": "*", "multiplier": "0.9"})
            assert r.status_code == 201, r.text
            assert r.json()["kind"] == "multiplier" and r.json()["multiplier"] == "0.900000"
            future = "2030-01-01T00:00:00Z"
            r = await admin.post(url, json={"model": "beta", "input_per_million": "0.5", "output_per_million": 2, "effective_from": future})
            assert r.status_code == 201 and r.json()["kind"] == "price"
            assert (await admin.post(url, json={"model": "beta", "clear": True, "effective_from": future})).status_code == 409
            listed = (await admin.get(url)).json()
            assert [o["model"] for o in listed["data"]] == ["*", "beta"]
            effective = {p["model"]: (p["input_per_million"], p["output_per_million"]) for p in listed["effective"]}
            assert effective == {"alpha": ("0.180", "0.720"), "beta": ("0.900", "1.800")}
            for body in ({"model": "*", "multiplier": 0.9}, {"model": "*", "multiplier": "-1"},
                         {"model": "*", "input_per_million": "1", "output_per_million": "1"},
                         {"model": "beta", "multiplier": "1", "input_per_million": "1", "output_per_million": "1"},
                         {"model": "beta"}, {"model": "beta", "input_per_million": "0.0001", "output_per_million": "1"},
                         {"model": "beta", "multiplier": "1e30"}, {"model": "beta", "multiplier": "2", "effective_from": "2020-01-01T00:00:00Z"},
                         {"model": "", "multiplier": "2"}, ["not", "an", "object"]):
                r = await admin.post(url, json=body)
                assert r.status_code == 400, (body, r.text)
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert (await admin.post("/admin/accounts/999999/prices", json={"model": "*", "multiplier": "2"})).status_code == 404
            assert (await admin.get(f"/admin/accounts/{account}/billing")).json()["state"] == "active"
    # The price book answers the same as the API: what the account pays now, and in the future.
    await book.refresh(force=True)
    # "Now" is the clock's now: the multiplier took effect when it was posted (a fixed date here
    # would be before it on the day of that date).
    from billing.models import utcnow

    now_price = book.price_for(account, "alpha", utcnow())
    assert now_price is not None and now_price.cost_nanos(1_000, 1_000) == 1_000 * 180 + 1_000 * 720
    later = book.price_for(account, "beta", at(1, 2, year=2030))
    assert later is not None and (later.input_per_million, later.override.kind) == (Decimal("0.5"), "price")  # type: ignore[union-attr]


def tollgate(data_dir: Path, *args: str) -> Any:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "TOLLGATE_SECRET") and not k.startswith("TOLLGATE_STRIPE")}
    env["TOLLGATE_DATA_DIR"] = str(data_dir)
    return cli_runner.tollgate(args, env)


async def test_cli_close_with_progress_on_sqlite(tmp_path: Path) -> None:
    """The embedded default: the CLI on a SQLite file, from prices to a PDF."""
    assert tollgate(tmp_path, "migrate").returncode == 0
    assert tollgate(tmp_path, "accounts", "create", "acme").returncode == 0
    added = tollgate(tmp_path, "prices", "add", "alpha", "--input", "0.150", "--output", "0.600",
                     "--effective-from", "2026-08-01T00:00:00Z", "--backdate")
    assert added.returncode == 0, added.stderr
    override = tollgate(tmp_path, "prices", "override", "--account", "acme", "--model", "*", "--multiplier", "0.5",
                        "--effective-from", "2026-08-01", "--backdate")
    assert override.returncode == 0 and json.loads(override.stdout)["kind"] == "multiplier", override.stderr
    db = create_engine(f"sqlite:///{tmp_path / 'tollgate.db'}")
    try:
        account = await new_account(db, "other")  # no usage: no invoice
        acme = account - 1
        # 2,000,000 x 0.075 = 15c; 1,000,000 x 0.300 = 30c
        await usage(db, acme, "alpha", 2_000_000, 1_000_000, at(10, 5))
        await usage(db, acme, "alpha", 1, 1, at(11, 1, 0))  # November: not in this invoice
    finally:
        await db.dispose()

    closed = tollgate(tmp_path, "invoices", "close", "--period", "2026-10")
    assert closed.returncode == 0, closed.stderr
    assert json.loads(closed.stdout)["invoices_created"] == 1 and json.loads(closed.stdout)["total"] == "0.45"
    assert "closing 2026-10" in closed.stderr and "100%" in closed.stderr and "2/2" in closed.stderr
    again = tollgate(tmp_path, "invoices", "close", "--period", "2026-10", "--no-progress")
    assert json.loads(again.stdout)["invoices_existing"] == 1 and json.loads(again.stdout)["invoices_created"] == 0
    assert "closing" not in again.stderr

    listed = json.loads(tollgate(tmp_path, "invoices", "list", "--account", "acme").stdout)
    assert [(i["period"], i["total"]) for i in listed] == [("2026-10", "0.45")]
    shown = json.loads(tollgate(tmp_path, "invoices", "show", str(listed[0]["id"])).stdout)
    assert [(l["unit_price_per_million"], l["amount_cents"]) for l in shown["lines"]] == [("0.075", 15), ("0.300", 30)]
    pdf = tmp_path / "invoice.pdf"
    assert tollgate(tmp_path, "invoices", "show", str(listed[0]["id"]), "--format", "pdf", "--output", str(pdf)).returncode == 0
    assert pdf.read_bytes().startswith(b"%PDF")

    for args, message in ((("invoices", "close", "--period", "2026-13"), "period"),
                          (("invoices", "close", "--period", "2099-01"), "has not ended"),
                          (("prices", "add", "alpha", "--input", "1", "--output", "1", "--effective-from", "2026-10-20", "--backdate"), "closed"),
                          (("prices", "override", "--account", "nobody", "--model", "*", "--multiplier", "2"), "no account"),
                          (("invoices", "sync", str(listed[0]["id"])), "Stripe is not configured"),
                          (("invoices", "show", "999"), "no invoice")):
        result = tollgate(tmp_path, *args)
        assert result.returncode == 1 and message in result.stderr, (args, result.stderr)


@pytest.mark.solo  # /healthz's slowest answer during the close is held to 1 s
async def test_close_in_background_while_serving(db_url: str, db: Any, tmp_path: Path) -> None:
    """A long run (here 200 accounts) reports progress and never holds up other requests."""
    await price_history(PriceBook(db))
    async with db.begin() as conn:
        await conn.execute(sa.text("INSERT INTO accounts (name, created_at) SELECT 'bulk-' || g, now() FROM generate_series(1, 200) g"))
        bulk = (await conn.execute(sa.text("SELECT id FROM accounts WHERE name LIKE 'bulk-%'"))).scalars().all()
    await write_records(db, [UsageRecord(request_id=f"bulk-{a}", account_id=a, key_id=1, model="alpha", prompt_tokens=1_000_000,
                                         completion_tokens=0, status="completed", finish_reason="stop", total_ms=1.0,
                                         created_at=at(9, 2)) for a in bulk])
    with serve(db_url, tmp_path) as app:
        async with app.admin() as admin:
            r = await admin.post("/admin/invoices/close", json={"period": "2026-09", "wait": False})
            assert r.status_code == 202, r.text
            seen_progress, served_while_closing, slowest = set(), 0, 0.0
            for _ in range(600):
                started = time.monotonic()
                assert (await admin.get("/healthz")).status_code == 200
                took = time.monotonic() - started
                status = await admin.get("/admin/billing/periods/2026-09")
                if status.status_code == 200:
                    seen_progress.add(status.json()["accounts_done"])
                    if status.json()["status"] == "closed":
                        break
                    served_while_closing += 1
                    slowest = max(slowest, took)
                await asyncio.sleep(0.02)
            assert status.json()["status"] == "closed" and status.json()["accounts_total"] == 201  # + the admin account
            assert served_while_closing >= 3 and len(seen_progress) >= 3, (served_while_closing, seen_progress)
            assert slowest < 1.0
            assert len((await admin.get("/admin/invoices", params={"period": "2026-09"})).json()["data"]) == 200
