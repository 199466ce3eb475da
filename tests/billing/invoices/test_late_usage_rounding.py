"""Late usage is rounded once over all the lines of its key (billing/invoices/close.py `_line`): an
adjustment line bills the rounded total of the key's usage so far less what earlier invoices
already billed for it, as the cache-hit lines do; never each late delta rounded on its own."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from billing.invoices.close import close_period
from billing.invoices.periods import Period
from billing.invoices.views import list_invoices
from billing.ledger.writer import UsageRecord, write_records
from billing.prices.book import PriceBook
from tests.billing.invoice_helpers import at, new_account, usage

SEPT, OCT, NOV = Period.month(2026, 9), Period.month(2026, 10), Period.month(2026, 11)


def amounts(invoice: dict[str, Any]) -> list[tuple[str, str, int, int]]:
    return [(line["kind"], line["usage_period"], line["tokens"], line["amount_cents"]) for line in invoice["lines"]]


async def test_late_usage_bills_the_rounded_total_less_what_was_billed(db: Any) -> None:
    book = PriceBook(db)
    await book.add("omega", "10.000", "10.000", at(8, 1, 0), backdate=True)  # $10 per million tokens
    account = await new_account(db, "late-halves")
    await usage(db, account, "omega", 500, 0, at(9, 10))  # 500 x $10 / 1M = 0.5 cent: 1 cent, half up
    await close_period(db, book, SEPT, now=at(10, 1, 2))
    [september] = await list_invoices(db, account_id=account, period="2026-09")
    assert amounts(september) == [("usage", "2026-09", 500, 1)]

    await usage(db, account, "omega", 500, 0, at(9, 20))  # late: 1,000 tokens in all are worth exactly 1 cent
    await close_period(db, book, OCT, now=at(11, 1, 2))
    [october] = await list_invoices(db, account_id=account, period="2026-10")
    assert amounts(october) == [("adjustment", "2026-09", 500, 0)]  # not a second cent for the same cent of usage
    assert october["total_cents"] == 0

    await usage(db, account, "omega", 500, 0, at(9, 25))  # later still: 1,500 tokens = 1.5 cents -> 2, 1 billed
    await close_period(db, book, NOV, now=at(12, 1, 2))
    [november] = await list_invoices(db, account_id=account, period="2026-11")
    assert amounts(november) == [("adjustment", "2026-09", 500, 1)]
    billed = sum(line["amount_cents"] for inv in (september, october, november) for line in inv["lines"])
    assert billed == 2  # 1,500 tokens x $10 / 1M = 1.5 cents, rounded half up once


async def hit(db: Any, account_id: int, model: str, tokens: int, cost_nanos: int, when: Any) -> None:
    """A response-cache hit as the gateway writes it: its cost (the hit price's share) on the row."""
    await write_records(db, [UsageRecord(
        request_id=uuid.uuid4().hex, account_id=account_id, key_id=1, model=model, prompt_tokens=tokens,
        completion_tokens=0, status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=cost_nanos,
        cached=True, created_at=when + timedelta(milliseconds=1), admitted_at=when,
    )])


async def test_cache_hits_worth_half_a_cent_are_rounded_half_up_once(db: Any) -> None:
    """Cache-hit lines bill the hits' cost_nanos in cents, half up, as usage lines round tokens
    (docs/invoices.md): 0.5 cent is 1 cent, 2.5 cents are 3 (half even would say 0 and 2)."""
    book = PriceBook(db)
    await book.add("omega", "10.000", "10.000", at(8, 1, 0), backdate=True)
    account = await new_account(db, "hit-halves")
    await hit(db, account, "omega", 100, 2_000_000, at(9, 10))
    await hit(db, account, "omega", 100, 3_000_000, at(9, 11))  # 5,000,000 nano-USD in all: half a cent
    await close_period(db, book, SEPT, now=at(10, 1, 2))
    [september] = await list_invoices(db, account_id=account, period="2026-09")
    assert [(line["direction"], line["amount_cents"]) for line in september["lines"]] == [("cached_response", 1)]

    await hit(db, account, "omega", 100, 20_000_000, at(9, 20))  # late: 2.5 cents in all -> 3, 1 billed
    await close_period(db, book, OCT, now=at(11, 1, 2))
    [october] = await list_invoices(db, account_id=account, period="2026-10")
    assert [(line["kind"], line["direction"], line["amount_cents"]) for line in october["lines"]] == [
        ("adjustment", "cached_response", 2)]
