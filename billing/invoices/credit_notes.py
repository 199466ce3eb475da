"""Credit notes: voiding or reducing an issued invoice never edits it; a numbered credit note is
issued against it instead (the same seller's sequence, without gaps), and pushed to Stripe.

    open invoice   the credit reduces what is still due on it (Stripe: pre-payment credit note);
                   credited in full, the invoice is void; what exceeds what was due (the balance
                   credit the invoice applied) goes back to the customer's balance, as on Stripe
                   (post-payment: credit_amount)
    paid invoice   the credit goes to the customer's balance (Stripe: credit_amount), and the
                   account's next invoice shows the note and applies the balance to its amount due

Its tax is the invoice's tax in proportion (half up, once): subtotal + tax = the credited total.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.invoices.billing_details import next_number
from billing.config import BillingConfig
from billing.invoices.models import CreditNote, Invoice
from billing.invoices.views import credit_note_view
from billing.models import utcnow

INVOICES = Invoice.__table__
CREDIT_NOTES = CreditNote.__table__
REASONS = ("duplicate", "fraudulent", "order_change", "product_unsatisfactory")  # Stripe's


class CreditNoteRefused(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class CreditRequest:
    amount_cents: int | None  # None: the whole remaining total (a void)
    reason: str | None = None
    memo: str | None = None


def _seller_key(seller: dict[str, Any] | None) -> str:
    if not seller:
        return "usage-statement"
    return str(seller.get("tax_id") or seller.get("legal_name"))


async def issue_credit_note(db: AsyncEngine, invoice_id: int, request: CreditRequest, config: BillingConfig | None = None,
                            *, now: datetime | None = None) -> dict[str, Any]:
    config = config or BillingConfig()
    now = now or utcnow()
    if request.reason is not None and request.reason not in REASONS:
        raise CreditNoteRefused(f"reason must be one of {', '.join(REASONS)}", "reason")
    if request.memo is not None and len(request.memo) > 500:
        raise CreditNoteRefused("memo is longer than 500 characters", "memo")
    async with db.begin() as conn:
        query = sa.select(INVOICES).where(INVOICES.c.id == invoice_id)
        if db.dialect.name == "postgresql":
            query = query.with_for_update()  # two credit notes at once: the second sees what the first took
        invoice = (await conn.execute(query)).first()
        if invoice is None:
            raise CreditNoteRefused("No such invoice.", "id", "not_found")
        credited = int((await conn.execute(sa.select(sa.func.coalesce(sa.func.sum(CREDIT_NOTES.c.total_cents), 0)).where(
            CREDIT_NOTES.c.invoice_id == invoice_id))).scalar_one())
        remaining = int(invoice.total_cents) - credited
        if remaining <= 0:
            raise CreditNoteRefused(f"invoice {invoice.number} has nothing left to credit", "amount_cents", "nothing_to_credit")
        amount = remaining if request.amount_cents is None else request.amount_cents
        if not 1 <= amount <= remaining:
            raise CreditNoteRefused(
                f"amount_cents must be between 1 and {remaining} (what invoice {invoice.number} still holds)", "amount_cents")
        total = int(invoice.total_cents)
        tax = int((Decimal(amount) * int(invoice.tax_cents or 0) / Decimal(total)).quantize(Decimal(1), ROUND_HALF_UP))
        applies_to = "balance" if invoice.status == "paid" else "invoice"
        seller = json.loads(invoice.seller) if invoice.seller else None
        prefix = config.seller.credit_note_prefix if seller else "USC"
        number = f"{prefix}-{await next_number(conn, _seller_key(seller), 'credit_note'):06d}"
        values = dict(
            number=number, invoice_id=invoice_id, account_id=invoice.account_id,
            kind="void" if amount == total and credited == 0 else "partial",
            reason=request.reason, memo=request.memo, subtotal_cents=amount - tax, tax_cents=tax, total_cents=amount,
            applies_to=applies_to, seller=invoice.seller, buyer=invoice.buyer, issued_at=now,
        )
        note_id = int((await conn.execute(CREDIT_NOTES.insert().values(**values).returning(CREDIT_NOTES.c.id))).scalar_one())
        if applies_to == "invoice" and amount == remaining:  # nothing left to collect
            await conn.execute(INVOICES.update().where(INVOICES.c.id == invoice_id).values(status="void"))
        row = (await conn.execute(sa.select(CREDIT_NOTES).where(CREDIT_NOTES.c.id == note_id))).one()
    return credit_note_view(row, invoice.number)


async def get_credit_note(db: AsyncEngine, note_id: int, *, account_id: int | None = None) -> dict[str, Any] | None:
    query = (sa.select(CREDIT_NOTES, INVOICES.c.number.label("invoice_number"), INVOICES.c.currency)
             .join(INVOICES, INVOICES.c.id == CREDIT_NOTES.c.invoice_id).where(CREDIT_NOTES.c.id == note_id))
    if account_id is not None:
        query = query.where(CREDIT_NOTES.c.account_id == account_id)
    async with db.connect() as conn:
        row = (await conn.execute(query)).first()
    if row is None:
        return None
    view = credit_note_view(row, row.invoice_number)
    view["seller"] = json.loads(row.seller) if row.seller else None
    view["buyer"] = json.loads(row.buyer) if row.buyer else None
    view["currency"] = row.currency
    view["document"] = "credit_note" if row.seller else "usage_credit"
    return view
