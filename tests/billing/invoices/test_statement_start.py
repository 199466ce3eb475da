"""A prepaid statement is made for a month the account was prepaid in: one that became prepaid at the
first instant of November was postpaid all of October, so October has no statement (its credit
bought in advance opens November's)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from billing.credits.balance import CreditBook
from billing.invoices.periods import Period
from billing.invoices.statements import close_statement, list_statements
from tests.billing.invoice_helpers import at, new_account

OCT, NOV = Period.month(2026, 10), Period.month(2026, 11)
CENT = 10_000_000


async def test_prepaid_from_the_first_instant_of_a_month_has_no_statement_for_the_month_before(db: Any) -> None:
    account = await new_account(db)
    book = CreditBook(db)
    await book.set_mode(account, "prepaid")
    async with db.begin() as conn:
        await conn.execute(sa.text("UPDATE accounts SET prepaid_since = :t WHERE id = :a"), {"t": NOV.start, "a": account})
    await book.add(account, "topup", 500 * CENT, now=at(10, 20))  # bought in October, ahead of the switch
    assert await close_statement(db, account, OCT, now=at(11, 1, 2)) == (None, False)
    made, created = await close_statement(db, account, NOV, now=at(12, 1, 2))
    assert created and made is not None
    [statement] = await list_statements(db, account_id=account)
    assert (statement["period"], statement["opening_balance_nanos"], statement["closing_balance_nanos"]) == ("2026-11", 500 * CENT, 500 * CENT)
