"""Chargebacks on the payments of Tollgate's invoices (postpaid, pushed by billing/stripe/sync.py).

Stripe leaves a paid invoice `paid` (a final status) when the cardholder's bank disputes its payment:
the dispute comes only as charge.dispute.* about the invoice's PaymentIntent, which carries none of
the invoice's metadata. Since API version 2025-03-31 neither the PaymentIntent nor the Charge names
its invoice; the InvoicePayment links them (GET /v1/invoice_payments?payment[type]=payment_intent
&payment[payment_intent]=pi_...). billing/stripe/checkout.py's dispute handler comes here for a
payment that is not a top-up's:

    funds withdrawn  (any status but checkout.NOTHING_WITHDRAWN and `won`: needs_response,
                     under_review, lost, ...) -> each of our invoices it paid is charged back:
                     charged_back_at = the dispute's `created`, chargeback_dispute_id = its id; the
                     account owes it again (billing/invoices/account_state.py: still_owed)
    won              -> cleared: paid again
    lost             stays owed: Stripe's invoice is `paid` and final; once the customer pays outside
                     it, POST /admin/invoices/{id}/chargeback_settled (chargeback_settled) clears it
    inquiry, prevented  nothing (the caller returns before)

The Dispute is re-read for every event and only its status decides, so events in any order, or
repeated, end at the same row; the change is applied in the transaction that records the event.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from stripe import StripeClient

from billing.invoices.account_state import recompute
from billing.invoices.models import Invoice
from billing.models import utcnow
from billing.stripe.sync import _plain

INVOICES = Invoice.__table__

Apply = Callable[[AsyncConnection], Awaitable["int | None"]]


SETTLED = "settled:"  # chargeback_dispute_id's prefix once a person recorded the invoice paid again


async def chargeback_settled(db: AsyncEngine, invoice_id: int, *, now: datetime, grace_seconds: float, overdue: bool) -> bool | None:
    """A person records that a charged-back invoice was paid again outside Stripe (a lost dispute
    leaves Stripe's invoice `paid`, a final status, so it cannot be paid there): it is paid again and
    the account's state follows. Its dispute's later events change it no more (the dispute id is
    kept as `settled:<id>`). None: no such invoice; False: it is not charged back."""
    async with db.begin() as conn:
        row = (await conn.execute(sa.select(INVOICES.c.account_id, INVOICES.c.charged_back_at, INVOICES.c.chargeback_dispute_id)
                                  .where(INVOICES.c.id == invoice_id).with_for_update())).first()
        if row is None:
            return None
        if row.charged_back_at is None:
            return False
        await conn.execute(INVOICES.update().where(INVOICES.c.id == invoice_id)
                           .values(charged_back_at=None, chargeback_dispute_id=SETTLED + str(row.chargeback_dispute_id)))
        await recompute(conn, int(row.account_id), now=now, grace_seconds=grace_seconds, overdue=overdue)
    return True


async def invoices_paid_by(client: StripeClient, intent_id: str) -> list[str]:
    """The Stripe invoices this PaymentIntent paid (one, unless it paid several at once)."""
    found = _plain(await client.v1.invoice_payments.list_async(
        {"payment": {"type": "payment_intent", "payment_intent": intent_id}, "status": "paid", "limit": 100}))
    ids = []
    for payment in found.get("data") or []:
        invoice = payment.get("invoice")
        invoice_id = invoice.get("id") if isinstance(invoice, dict) else invoice  # expanded or not
        if isinstance(invoice_id, str) and invoice_id not in ids:
            ids.append(invoice_id)
    return ids


def chargeback(dispute: dict[str, Any], stripe_invoice_ids: list[str]) -> Apply | None:
    """What the dispute (re-read, funds withdrawn or won) says of the invoices its payment paid:
    the account changed, or None when none of them is ours."""
    if not stripe_invoice_ids:
        return None
    won = dispute.get("status") == "won"
    created = dispute.get("created")
    since = datetime.fromtimestamp(created, tz=timezone.utc) if type(created) is int else utcnow()

    async def apply(conn: AsyncConnection) -> int | None:
        ours = (await conn.execute(sa.select(INVOICES.c.id, INVOICES.c.account_id, INVOICES.c.chargeback_dispute_id)
                                   .where(INVOICES.c.stripe_invoice_id.in_(stripe_invoice_ids)).order_by(INVOICES.c.id))).all()
        for row in ours:
            # another dispute of the same invoice (a second payment of it) keeps its own mark
            if row.chargeback_dispute_id not in (None, dispute["id"]):
                continue
            values = (dict(charged_back_at=None, chargeback_dispute_id=None) if won
                      else dict(charged_back_at=since, chargeback_dispute_id=dispute["id"]))
            await conn.execute(INVOICES.update().where(INVOICES.c.id == row.id).values(**values))
        return int(ours[0].account_id) if ours else None

    return apply
