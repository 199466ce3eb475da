"""What makes a closed month's numbers a document an accounts department accepts: the seller and
the buyer as they were at issue (snapshots), the issue and due dates and terms, a number without
gaps per seller, the tax line, and the credit notes issued since the account's last invoice.

Called inside the close's transaction (`billing.invoices.close._insert_invoice`), so the number, the
invoice and the credit notes it lists commit together or not at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from billing.invoices.billing_details import get_details, next_number, tax_cents, tax_for
from billing.config import BillingConfig
from billing.invoices.models import CreditNote, Invoice

INVOICES = Invoice.__table__
CREDIT_NOTES = CreditNote.__table__
USAGE_STATEMENT = "usage-statement"


def buyer_snapshot(details: dict[str, Any] | None, account_name: str) -> dict[str, Any]:
    if details is None:
        return {"legal_name": account_name, "address": [], "country": None, "email": None, "tax_id": None, "complete": False}
    address = [details.get("address_line1"), details.get("address_line2"),
               " ".join(x for x in (details.get("postal_code"), details.get("city")) if x), details.get("region")]
    return {
        "legal_name": details["legal_name"],
        "address": [line for line in address if line],
        "country": details["country"],
        "email": details.get("email"),
        "tax_id": details.get("tax_id"),
        "tax_id_type": details.get("tax_id_type"),
        "complete": True,
    }


@dataclass
class DocumentFields:
    values: dict[str, Any]
    amount_due_cents: int


async def invoice_fields(
    conn: AsyncConnection, config: BillingConfig | None, account_id: int, account_name: str, line_amounts: list[int],
    now: datetime,
) -> DocumentFields:
    """The invoice row's document columns (number included), computed in the close's transaction."""
    config = config or BillingConfig()
    seller = config.seller
    details = await get_details(conn, account_id)
    tax = await tax_for(conn, details)
    subtotal = sum(line_amounts)
    tax_amount = tax_cents(subtotal, tax.rate)  # once, on the subtotal: never per line
    total = subtotal + tax_amount
    applied = min(total, await balance_credit(conn, account_id))
    if seller.identified:
        number = f"{seller.invoice_prefix}-{await next_number(conn, seller.key, 'invoice'):06d}"
    else:
        number = f"US-{await next_number(conn, USAGE_STATEMENT, 'invoice'):06d}"
    due = now + timedelta(days=config.days_until_due) if config.collection_method == "send_invoice" else now
    values = dict(
        number=number,
        seller=json.dumps(seller.snapshot()) if seller.identified else None,
        buyer=json.dumps(buyer_snapshot(details, account_name)),
        issued_at=now,
        due_at=due,
        payment_terms=config.payment_terms,
        subtotal_cents=subtotal,
        tax_rate=tax.rate,
        tax_cents=tax_amount,
        total_cents=total,
        credit_applied_cents=applied,
        currency="usd",
    )
    return DocumentFields(values, total - applied)


async def balance_credit(conn: AsyncConnection, account_id: int) -> int:
    """The customer's balance credit that earlier invoices have not used yet. Credited to it, as on
    Stripe: credit notes on paid invoices, all of them; credit notes on an open invoice, what
    exceeds what was still due on it (a credit note first reduces the amount due, never below 0;
    the rest is the balance credit that invoice applied, given back). An invoice voided on Stripe
    gives back all the balance credit it applied (Stripe returns it on void since API 2019-12-03),
    and uses none."""
    kept = sa.or_(INVOICES.c.stripe_status.is_(None), INVOICES.c.stripe_status != "void")
    credited = int((await conn.execute(sa.select(sa.func.coalesce(sa.func.sum(CREDIT_NOTES.c.total_cents), 0)).where(
        CREDIT_NOTES.c.account_id == account_id, CREDIT_NOTES.c.applies_to == "balance"))).scalar_one())
    notes = (
        sa.select(CREDIT_NOTES.c.invoice_id, sa.func.sum(CREDIT_NOTES.c.total_cents).label("credited"))
        .where(CREDIT_NOTES.c.account_id == account_id, CREDIT_NOTES.c.applies_to == "invoice")
        .group_by(CREDIT_NOTES.c.invoice_id)
        .subquery()
    )
    returned = (await conn.execute(
        sa.select(INVOICES.c.total_cents, INVOICES.c.credit_applied_cents, notes.c.credited)
        .join(notes, notes.c.invoice_id == INVOICES.c.id)
        .where(INVOICES.c.account_id == account_id, INVOICES.c.credit_applied_cents > 0, kept)
    )).all()
    credited += sum(max(0, int(r.credited) - (int(r.total_cents) - int(r.credit_applied_cents))) for r in returned)
    used = (await conn.execute(sa.select(sa.func.coalesce(sa.func.sum(INVOICES.c.credit_applied_cents), 0)).where(
        INVOICES.c.account_id == account_id, kept))).scalar_one()
    return max(0, credited - int(used))


async def list_credit_notes_on(conn: AsyncConnection, account_id: int, invoice_id: int) -> None:
    """The credit notes issued since the account's last invoice are shown on this one."""
    await conn.execute(
        CREDIT_NOTES.update()
        .where(CREDIT_NOTES.c.account_id == account_id, CREDIT_NOTES.c.shown_on_invoice_id.is_(None),
               CREDIT_NOTES.c.invoice_id != invoice_id)
        .values(shown_on_invoice_id=invoice_id)
    )
