"""Invoices and prepaid statements against the ledger's `cost_nanos`, the figure limits, balances
and dashboards use: rows are priced as the gateway prices them (PriceBook.current_for at
admission, EffectivePrice.cost_nanos), summed in SQL for the account and month, and compared with
the documents the monthly close issues, exactly (integers and Decimal):

- invoice: its usage lines hold exactly the billable rows' cost (sum over lines of tokens x unit
  price == sum of cost_nanos, to the nano where each price is a whole number of nano-USD per token;
  with a multiplier each row's cost is rounded half up to the nano, so within half a nano a row);
  each line is its exact cost rounded half up to the cent once (docs/invoices.md), and the subtotal
  is their sum, so within half a cent a line of the ledger's sum; response-cache hits (cached rows,
  costed at a hit price times the normal cost, as gateway/serving/completions.py does) are on cached_response
  lines of their own, each exactly its rows' cost_nanos rounded half up to the cent once, also when
  the hit price differed from hit to hit (the setting changed), and a late hit is billed once as the
  rest of that rounding;
- statement: usage == the month's cost_nanos (rows admitted since prepaid_since, by
  admission month), each model's cost too, and closing == credits - cost_nanos up to the month's
  end == the account's balance (docs/prepaid.md); the account's postpaid part of the month is on an
  invoice that matches the ledger the same way."""

from __future__ import annotations

import io
import uuid
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import sqlalchemy as sa
from pypdf import PdfReader

from billing.credits.balance import CreditBook
from billing.invoices.views import list_invoices
from billing.invoices.close import close_period
from billing.ledger.records import BILLED_STATUSES
from billing.ledger.writer import UsageRecord, write_records
from billing.invoices.periods import Period
from billing.prices.book import PriceBook
from billing.invoices.render import render_html, render_pdf
from billing.invoices.statements import list_statements
from gateway.serving.admission import share_of
from tests.billing.invoice_helpers import at, new_account, price_history

SEPT = Period.month(2026, 9)
CENT = 10_000_000
NANOS_PER_UNIT_PER_MILLION = 1000  # $1 per 1M tokens = 1,000 nano-USD per token


async def priced(db: Any, book: PriceBook, account: int, model: str, prompt: int, completion: int, admitted: datetime,
                 finished: datetime | None = None, *, cached: int = 0, status: str = "completed", hit: str | None = None) -> None:
    """A ledger row costed the way the gateway costs it: the price in force at admission; `hit`: a
    response-cache hit at that hit price (Service.admit_hit: share_of the cost without cached tokens)."""
    price = await book.current_for(account, model, admitted)
    cost = None if price is None else price.cost_nanos(prompt, completion, cached)
    if hit is not None and price is not None:
        cost = share_of(price.cost_nanos(prompt, completion), Decimal(hit))
    await write_records(db, [UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account, key_id=1, model=model, prompt_tokens=prompt,
        completion_tokens=completion, status=status, finish_reason="stop", total_ms=1.0,
        cost_nanos=cost, cached_tokens=cached, cached=hit is not None,
        created_at=finished or admitted + timedelta(milliseconds=3), admitted_at=admitted)])


async def month_of_usage(db: Any, book: PriceBook, account: int) -> None:
    """Price changes, a row admitted before one and finished after, the month's edges, cached
    prompt tokens at a cached-input price, odd token counts, and rows that are not billed."""
    await priced(db, book, account, "alpha", 1_000_001, 250_003, at(9, 5, 10))
    await priced(db, book, account, "alpha", 33_333, 7_777, at(9, 15, 23, 59, 59, 999_000), at(9, 16, 0, 0, 2))  # old price
    await priced(db, book, account, "alpha", 25_000, 10_001, at(9, 16, 0))
    await priced(db, book, account, "alpha", 2_500_000, 67_776, at(9, 20), status="cancelled")
    await priced(db, book, account, "alpha", 999_999, 999_999, at(9, 21), status="error")  # not billed
    await priced(db, book, account, "beta", 12_345, 6_789, at(9, 25))
    await priced(db, book, account, "delta", 40_001, 1_003, at(9, 26), cached=30_007)
    await priced(db, book, account, "delta", 9_999, 333, at(9, 27), cached=9_999)
    await priced(db, book, account, "alpha", 5_000_000, 0, at(8, 31, 23, 59, 59), at(9, 1, 0, 0, 1))  # August's
    await priced(db, book, account, "beta", 77_777, 0, at(9, 30, 23, 59, 59, 900_000), at(10, 1, 0, 0, 3))  # September's
    await priced(db, book, account, "alpha", 5_000_000, 0, at(10, 1, 0))  # October's
    # response-cache hits: free (the default), and at other hit prices the setting had later
    await priced(db, book, account, "beta", 1_000_000, 500_000, at(9, 6), hit="0")
    await priced(db, book, account, "alpha", 123_457, 9_871, at(9, 17), hit="0.3")
    await priced(db, book, account, "alpha", 70_001, 3_333, at(9, 18), cached=70_001, hit="0.25")
    await priced(db, book, account, "alpha", 333_333, 77_777, at(9, 10), hit="0.125")
    await priced(db, book, account, "alpha", 0, 0, at(9, 19), status="cancelled", hit="0.3")  # not delivered whole


async def ledger_cost(db: Any, account: int, period: Period, *, billable: bool, since: datetime | None = None,
                      before_since: bool = False) -> tuple[int, int]:
    """(sum of cost_nanos, rows) of the account's rows admitted in the period, in SQL."""
    where = ["account_id = :a", "admitted_at >= :start", "admitted_at < :end"]
    if billable:
        where.append("status IN (" + ", ".join(f"'{s}'" for s in BILLED_STATUSES) + ")")
    if since is not None:
        where.append("admitted_at < :since" if before_since else "admitted_at >= :since")
    async with db.connect() as conn:
        row = (await conn.execute(sa.text(
            f"SELECT coalesce(sum(cost_nanos), 0) AS cost, count(*) AS n FROM ledger_entries WHERE {' AND '.join(where)}"),
            {"a": account, "start": period.start, "end": period.end, "since": since})).one()
    return int(row.cost), int(row.n)


def line_nanos(line: dict[str, Any]) -> Decimal:
    return Decimal(line["tokens"]) * Decimal(line["unit_price_per_million"] or 0) * NANOS_PER_UNIT_PER_MILLION


def pdf_text(data: bytes) -> str:
    return "\n".join(page.extract_text() for page in PdfReader(io.BytesIO(data)).pages)


def cents(nanos: int | Decimal) -> int:
    return int((Decimal(nanos) / CENT).quantize(Decimal(1), ROUND_HALF_UP))


async def hits_by_line(db: Any, book: PriceBook, account: int, period: Period, *, since: datetime | None = None,
                       before_since: bool = False) -> dict[tuple[str, Any, Any], list[int]]:
    """The account's billable cache hits admitted in the period: [tokens, cost_nanos] per (model,
    price version, override) in force at each one's admission."""
    where = "cached AND account_id = :a AND admitted_at >= :s AND admitted_at < :e AND status IN ('completed', 'cancelled')"
    if since is not None:
        where += " AND admitted_at < :since" if before_since else " AND admitted_at >= :since"
    async with db.connect() as conn:
        rows = (await conn.execute(sa.text(
            f"SELECT model, admitted_at, prompt_tokens + completion_tokens AS tokens, cost_nanos FROM ledger_entries WHERE {where}"),
            {"a": account, "s": period.start, "e": period.end, "since": since})).all()
    out: dict[tuple[str, Any, Any], list[int]] = {}
    for row in rows:
        price = await book.current_for(account, row.model, row.admitted_at)
        assert price is not None
        slot = out.setdefault((row.model, price.price_version_id, price.override_id), [0, 0])
        slot[0] += int(row.tokens)
        slot[1] += int(row.cost_nanos)
    return {k: v for k, v in out.items() if v != [0, 0]}


def check_invoice(invoice: dict[str, Any], cost: int, rows: int, *, whole_nanos: bool,
                  hits: dict[tuple[str, Any, Any], list[int]] | None = None) -> None:
    """`cost`, `rows`: the billable rows, hits included; `hits`: hits_by_line of the same rows."""
    hits = hits or {}
    usage = [line for line in invoice["lines"] if line["kind"] == "usage"]
    priced = [line for line in usage if line["direction"] != "cached_response"]
    hit_lines = {(line["model"], line["price_version_id"], line["override_id"]): line
                 for line in usage if line["direction"] == "cached_response"}
    hit_nanos = sum(nanos for _, nanos in hits.values())
    exact = sum((line_nanos(line) for line in priced), Decimal(0))
    if whole_nanos:
        assert exact == cost - hit_nanos, (exact, cost, hit_nanos)
    else:  # each row's cost was rounded half up to the nano once
        assert abs(exact - (cost - hit_nanos)) <= Decimal(rows) / 2, (exact, cost, hit_nanos, rows)
    for line in priced:  # once per line, half up, from the line's exact cost
        assert line["amount_cents"] == cents(line_nanos(line)), line
    # a hit line: its rows' tokens, and their cost_nanos (the hit price applied) rounded half up once
    assert {k: [line["tokens"], line["amount_cents"]] for k, line in hit_lines.items()} == {
        k: [tokens, cents(nanos)] for k, (tokens, nanos) in hits.items()}
    exact += hit_nanos
    assert invoice["subtotal_cents"] == sum(line["amount_cents"] for line in usage)
    assert abs(Decimal(invoice["subtotal_cents"] * CENT) - exact) <= Decimal(len(usage) * CENT) / 2
    assert invoice["total_cents"] == invoice["subtotal_cents"] + ((invoice.get("tax") or {}).get("amount_cents") or 0)


async def prices(db: Any) -> PriceBook:
    book = PriceBook(db)
    await price_history(book)
    await book.add("delta", "0.400", "1.600", at(8, 1, 0), backdate=True, cached_input_per_million="0.100")
    return book


async def test_invoices_hold_exactly_the_ledgers_cost(db: Any) -> None:
    book = await prices(db)
    plain, scaled = await new_account(db, "plain"), await new_account(db, "scaled")
    await book.add_override(scaled, "*", multiplier="0.85", effective_from=at(8, 1, 0), backdate=True)
    await book.refresh(force=True)
    for account in (plain, scaled):
        await month_of_usage(db, book, account)
    result = await close_period(db, book, SEPT, now=at(11, 1, 2))
    assert len(result.created) == 2
    invoices = {i["account_id"]: i for i in await list_invoices(db, period=str(SEPT))}

    cost, rows = await ledger_cost(db, plain, SEPT, billable=True)
    everything, _ = await ledger_cost(db, plain, SEPT, billable=False)
    assert rows == 8 + 5 and everything > cost  # the error row has a cost the invoice does not bill
    hits = await hits_by_line(db, book, plain, SEPT)
    assert len(hits) == 3 and hits[("beta", 3, None)] == [1_500_000, 0]  # the free hit's line: listed, at $0
    check_invoice(invoices[plain], cost, rows, whole_nanos=True, hits=hits)
    cost, rows = await ledger_cost(db, scaled, SEPT, billable=True)
    check_invoice(invoices[scaled], cost, rows, whole_nanos=False, hits=await hits_by_line(db, book, scaled, SEPT))
    assert cost % NANOS_PER_UNIT_PER_MILLION != 0  # the multiplier did leave fractions to round
    free = hit_lines_of(invoices[plain])[("beta", 3, None)]  # what the customer reads, in HTML and PDF
    assert "cached responses" in free["description"] and "(free)" in free["description"] and free["amount"] == "0.00"
    html, pdf = render_html(invoices[plain]), pdf_text(render_pdf(invoices[plain]))
    assert html.count("<td class=n>cache-hit price</td>") == 3 and "1,000,000 prompt + 500,000 completion" in html
    assert "cache-hit price" in pdf and "cached responses" in pdf

    # a hit of September recorded after it closed: October's invoice bills it once, as what the
    # line's hits cost now less what September's line billed (never rounded twice)
    await priced(db, book, plain, "alpha", 55_555, 4_321, at(9, 29), at(11, 1, 3), hit="0.3")
    await close_period(db, book, SEPT.next(), now=at(12, 1, 2))
    [october] = await list_invoices(db, account_id=plain, period=str(SEPT.next()))
    [late] = [line for line in october["lines"] if line["kind"] == "adjustment"]
    key = (late["model"], late["price_version_id"], late["override_id"])
    tokens, nanos = (await hits_by_line(db, book, plain, SEPT))[key]
    before = hit_lines_of(invoices[plain])[key]
    assert late["direction"] == "cached_response" and late["usage_period"] == str(SEPT)
    assert [late["tokens"], late["amount_cents"]] == [tokens - before["tokens"], cents(nanos) - before["amount_cents"]]
    assert late["amount_cents"] > 0


def hit_lines_of(invoice: dict[str, Any]) -> dict[tuple[str, Any, Any], dict[str, Any]]:
    return {(line["model"], line["price_version_id"], line["override_id"]): line
            for line in invoice["lines"] if line["direction"] == "cached_response"}


async def test_statements_hold_exactly_the_ledgers_cost_and_end_at_the_balance(db: Any) -> None:
    book = await prices(db)
    await book.refresh(force=True)
    credits = CreditBook(db)
    account = await new_account(db, "prepaid")
    since = at(9, 10)
    await priced(db, book, account, "alpha", 400_001, 20_001, at(9, 3))  # postpaid then: invoiced
    await priced(db, book, account, "beta", 10_000, 1, at(9, 10, 11, 59, 59, 999_000), at(9, 10, 12, 0, 1))  # admitted postpaid, finished prepaid: invoiced
    await credits.set_mode(account, "prepaid")
    async with db.begin() as conn:
        await conn.execute(sa.text("UPDATE accounts SET prepaid_since = :t WHERE id = :a"), {"t": since, "a": account})
    await credits.add(account, "topup", 500 * CENT, now=at(9, 10, 13), external_id=f"cs_{uuid.uuid4().hex}")
    await credits.add(account, "grant", 50 * CENT, now=at(9, 12), reason="welcome")
    await month_of_usage(db, book, account)
    await credits.add(account, "refund", -30 * CENT, now=at(9, 28), external_id=f"re_{uuid.uuid4().hex}")
    await close_period(db, book, SEPT, now=at(11, 1, 2))

    [statement] = await list_statements(db, account_id=account, period=str(SEPT))
    cost, rows = await ledger_cost(db, account, SEPT, billable=False, since=since)
    assert rows == 8 + 4  # September's admitted after Sep 10 12:00 (the error row too: it spent the balance; hits too)
    assert statement["usage_nanos"] == cost == sum(u["cost_nanos"] for u in statement["usage"])
    async with db.connect() as conn:
        per_model = dict((await conn.execute(sa.text(
            "SELECT model, sum(cost_nanos) FROM ledger_entries WHERE account_id = :a AND admitted_at >= :since AND admitted_at >= :s "
            "AND admitted_at < :e GROUP BY model"), {"a": account, "since": since, "s": SEPT.start, "e": SEPT.end})).all())
        credited = int((await conn.execute(sa.text(
            "SELECT coalesce(sum(amount_nanos), 0) FROM credit_entries WHERE account_id = :a AND kind <> 'usage' AND created_at < :e"),
            {"a": account, "e": SEPT.end})).scalar_one())
        spent = int((await conn.execute(sa.text(
            "SELECT coalesce(sum(cost_nanos), 0) FROM ledger_entries WHERE account_id = :a AND admitted_at >= :since AND admitted_at < :e"),
            {"a": account, "since": since, "e": SEPT.end})).scalar_one())
    assert {u["model"]: u["cost_nanos"] for u in statement["usage"]} == {m: int(c) for m, c in per_model.items()}
    assert statement["opening_balance_nanos"] == 0 and statement["late_nanos"] == 0
    assert statement["credits_nanos"] == credited == 520 * CENT
    assert statement["closing_balance_nanos"] == credited - spent == credited - cost
    october, _ = await ledger_cost(db, account, SEPT.next(), billable=False, since=since)
    balance = await credits.balance(account)  # what admission and the dashboards read: September's end less October's row
    assert october > 0 and balance is not None and balance["balance_nanos"] == statement["closing_balance_nanos"] - october

    # the month's postpaid part: rows admitted before prepaid_since, on an invoice
    [invoice] = await list_invoices(db, account_id=account, period=str(SEPT))
    cost, rows = await ledger_cost(db, account, SEPT, billable=True, since=since, before_since=True)
    assert rows == 4  # with the free hit of Sep 6 and the row admitted just before the switch
    check_invoice(invoice, cost, rows, whole_nanos=True, hits=await hits_by_line(db, book, account, SEPT, since=since, before_since=True))
