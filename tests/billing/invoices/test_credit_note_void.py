"""Credit notes that together credit all of an open invoice void it, as one note for all of it does:
nothing is left to collect, on Stripe either (its pre-payment notes take amount_remaining to 0), so
ours must not stay open and owed (docs/invoices.md, Credit notes)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from billing.invoices.account_state import account_standing
from billing.invoices.credit_notes import CreditRequest, issue_credit_note
from billing.invoices.views import get_invoice
from tests.billing.stripe.test_stripe import closed_september


async def test_partial_notes_that_credit_all_of_an_open_invoice_void_it(db: Any) -> None:
    ids, invoices = await closed_september(db)
    invoice = invoices[ids["a"]]
    total = invoice["total_cents"]
    assert invoice["status"] == "open" and total > 1
    await issue_credit_note(db, invoice["id"], CreditRequest(1, "order_change"))
    assert (await get_invoice(db, invoice["id"]))["status"] == "open"  # type: ignore[index]
    last = await issue_credit_note(db, invoice["id"], CreditRequest(total - 1, "order_change"))  # the rest
    assert last["total_cents"] == total - 1
    after = await get_invoice(db, invoice["id"])
    assert after is not None and (after["status"], after["total_cents"]) == ("void", total)  # lines and totals unchanged
    standing = await account_standing(db, ids["a"], grace_seconds=0)
    assert [u["id"] for u in standing["unpaid_invoices"]] == []


async def test_a_credit_notes_tax_is_the_invoices_in_proportion_rounded_half_up(db: Any) -> None:
    """$0.10 + 19% tax ($0.02) = $0.12; a $0.03 note's tax is 3 x 2 / 12 = 0.5 cent: 1 cent (half up,
    not to even), its subtotal 2 cents (docs/invoices.md: the invoice's tax in proportion, half up, once)."""
    ids, invoices = await closed_september(db)
    invoice = invoices[ids["a"]]
    async with db.begin() as conn:
        await conn.execute(sa.text("UPDATE invoices SET subtotal_cents = 10, tax_rate = 19, tax_cents = 2, total_cents = 12 WHERE id = :i"),
                           {"i": invoice["id"]})
    note = await issue_credit_note(db, invoice["id"], CreditRequest(3, "order_change"))
    assert (note["subtotal_cents"], note["tax_cents"], note["total_cents"]) == (2, 1, 3)
