"""Chargebacks on the payments of Tollgate's invoices (postpaid, pushed by billing/stripe/sync.py).

Stripe leaves a paid invoice `paid` (a final status) when the cardholder's bank disputes its payment:
the dispute comes only as charge.dispute.* about the invoice's PaymentIntent, which carries none of
the invoice's metadata. Since API version 2025-03-31 neither the PaymentIntent nor the Charge names
its invoice; the InvoicePayment links them (GET /v1/invoice_payments?payment[type]=payment_intent
&payment[payment_intent]=pi_...), with the amount of the payment that went to that invoice
(`amount_paid`). billing/stripe/checkout.py's dispute handler comes here for a payment that is not a
top-up's, with what the dispute took back (its balance transactions: withdrawn, reinstated).

One row per (invoice, dispute) in invoice_chargebacks: an invoice paid by several payments (Stripe's
partial payments) can have a dispute on each, and a payment can be disputed more than once (partial
disputes, a re-filed one: support.stripe.com, "Receiving multiple disputes per payment FAQ"). Each row
holds what its dispute takes back of the invoice now:

    funds withdrawn  (any status but checkout.NOTHING_WITHDRAWN: needs_response, under_review, lost,
                     ...) -> the withdrawn amount less what was reinstated (a "partially won" dispute
                     is `lost` with part reinstated), in exact cents
    won              -> 0 (reinstated): it takes nothing back
    inquiry, prevented  nothing (the caller returns before)

A payment that paid several invoices (one PaymentIntent attached to more than one) has the amount
split over them oldest InvoicePayment first, each at most its `amount_paid`. The invoice keeps the
sum of its rows not won nor settled (chargeback_cents: what it is owed again) and the earliest of
their disputes' `created` (charged_back_at: when it became owed; billing/invoices/account_state.py),
recomputed from the rows in the same transaction.

A lost dispute leaves the invoice owed: Stripe's invoice is `paid` and final. Once the customer pays
outside it, POST /admin/invoices/{id}/chargeback_settled (chargeback_settled) records it, for one
dispute or all of the invoice's: the row's settled_at is set, with what it covered (settled_cents:
its amount_cents then), and it counts no more, whatever its dispute's later events say (they still
update its status and amounts, for the record).

Settled, then won (or part reinstated): the bank returns the money too, and the customer has paid
twice. The refund due is settled_cents less what the dispute still takes back, less what was
refunded (models.chargeback_refund_due); the views and documents show it, and the event that makes
it grow logs a warning (once: a later or repeated event finds it already due). A person refunds it
(Stripe, or a credit note) and records that: POST /admin/invoices/{id}/chargeback_refunded
(chargeback_refunded), which adds the refund due to refunded_cents.

The Dispute is re-read for every event and only it decides, so events in any order, or repeated,
end at the same rows; the change is applied in the transaction that records the event.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from stripe import StripeClient

from billing.invoices.account_state import recompute
from billing.invoices.models import Invoice, InvoiceChargeback, chargeback_refund_due
from billing.models import utcnow
from billing.stripe.sync import _plain, upsert

log = logging.getLogger("tollgate.invoice_disputes")

INVOICES = Invoice.__table__
CHARGEBACKS = InvoiceChargeback.__table__

Apply = Callable[[AsyncConnection], Awaitable["int | None"]]


@dataclass(frozen=True)
class InvoicePayment:
    """What one payment paid of one Stripe invoice (an InvoicePayment `paid`)."""

    invoice: str  # in_...
    amount_paid: int  # minor units of `currency`
    currency: str


def owed_again() -> Any:
    """A chargeback row that counts: it takes money back (not won) and nobody recorded it settled."""
    return sa.and_(CHARGEBACKS.c.settled_at.is_(None), CHARGEBACKS.c.amount_cents > 0)


SETTLED = "settled:"  # chargeback_dispute_id's prefix for a settled dispute, as the code before 0026 kept it


async def refresh_invoice(conn: AsyncConnection, invoice_id: int) -> None:
    """The invoice's charged_back_at and chargeback_cents from its chargeback rows, and
    chargeback_dispute_id as the code before migration 0026 kept it (it still reads it while a
    rolling update replaces it): the earliest dispute owed again, else `settled:<id>` of the last
    one settled (so it leaves that dispute's later events alone), else NULL. The caller holds the
    invoice's row lock: two events' sums made at once would each miss the other's row (READ
    COMMITTED) and the later write would win."""
    rows = (await conn.execute(
        sa.select(CHARGEBACKS.c.disputed_at, CHARGEBACKS.c.amount_cents, CHARGEBACKS.c.dispute_id, CHARGEBACKS.c.settled_at)
        .where(CHARGEBACKS.c.invoice_id == invoice_id)
        .order_by(CHARGEBACKS.c.disputed_at, CHARGEBACKS.c.id))).all()
    owed = [r for r in rows if r.settled_at is None and r.amount_cents > 0]
    settled = sorted((r for r in rows if r.settled_at is not None), key=lambda r: r.settled_at)
    marker = owed[0].dispute_id if owed else SETTLED + settled[-1].dispute_id if settled else None
    await conn.execute(INVOICES.update().where(INVOICES.c.id == invoice_id).values(
        charged_back_at=owed[0].disputed_at if owed else None, chargeback_cents=sum(int(r.amount_cents) for r in owed),
        chargeback_dispute_id=marker))


class UnknownDispute(LookupError):
    """chargeback_settled named a dispute that is not one of the invoice's chargebacks."""


async def chargeback_settled(db: AsyncEngine, invoice_id: int, *, now: datetime, grace_seconds: float, overdue: bool,
                             dispute_id: str | None = None) -> bool | None:
    """A person records that a charged-back invoice was paid again outside Stripe (a lost dispute
    leaves Stripe's invoice `paid`, a final status, so it cannot be paid there): the chargebacks that
    still count (or only `dispute_id`'s) are settled, and the account's state follows. None: no such
    invoice; False: nothing of it (or of that dispute) is owed again; UnknownDispute: the invoice has
    no chargeback of `dispute_id`."""
    async with db.begin() as conn:
        row = (await conn.execute(sa.select(INVOICES.c.account_id).where(INVOICES.c.id == invoice_id).with_for_update())).first()
        if row is None:
            return None
        which = CHARGEBACKS.c.invoice_id == invoice_id
        if dispute_id is not None:
            which = sa.and_(which, CHARGEBACKS.c.dispute_id == dispute_id)
            if (await conn.execute(sa.select(CHARGEBACKS.c.id).where(which))).first() is None:
                raise UnknownDispute(dispute_id)
        done = await conn.execute(CHARGEBACKS.update().where(which, owed_again()).values(
            settled_at=now, settled_cents=CHARGEBACKS.c.amount_cents, updated_at=now))
        if not done.rowcount:
            return False
        await refresh_invoice(conn, invoice_id)
        await recompute(conn, int(row.account_id), now=now, grace_seconds=grace_seconds, overdue=overdue)
    return True


async def chargeback_refunded(db: AsyncEngine, invoice_id: int, *, now: datetime, dispute_id: str | None = None) -> bool | None:
    """A person records that the refund due of a chargeback paid twice (settled, then its dispute won)
    was made (a Stripe refund, a credit note): each such chargeback (or only `dispute_id`'s) adds its
    refund due to refunded_cents, which leaves nothing due. None: no such invoice; False: no refund is
    due (of that dispute); UnknownDispute: the invoice has no chargeback of `dispute_id`."""
    async with db.begin() as conn:
        if (await conn.execute(sa.select(INVOICES.c.id).where(INVOICES.c.id == invoice_id).with_for_update())).first() is None:
            return None
        which = CHARGEBACKS.c.invoice_id == invoice_id
        if dispute_id is not None:
            which = sa.and_(which, CHARGEBACKS.c.dispute_id == dispute_id)
        rows = (await conn.execute(sa.select(CHARGEBACKS).where(which))).all()
        if dispute_id is not None and not rows:
            raise UnknownDispute(dispute_id)
        done = False
        for row in rows:
            due = chargeback_refund_due(row)
            if due:
                await conn.execute(CHARGEBACKS.update().where(CHARGEBACKS.c.id == row.id).values(
                    refunded_cents=int(row.refunded_cents or 0) + due, refunded_at=now, updated_at=now))
                log.info("invoice %s: refund of %d %s recorded for dispute %s (paid twice)", invoice_id, due, row.currency, row.dispute_id)
                done = True
    return done


async def invoices_paid_by(client: StripeClient, intent_id: str) -> list[InvoicePayment]:
    """What this PaymentIntent paid of each Stripe invoice (one, unless it paid several), oldest first."""
    found = _plain(await client.v1.invoice_payments.list_async(
        {"payment": {"type": "payment_intent", "payment_intent": intent_id}, "status": "paid", "limit": 100}))
    payments = []
    for payment in reversed(found.get("data") or []):  # the list is newest first
        invoice = payment.get("invoice")
        invoice_id = invoice.get("id") if isinstance(invoice, dict) else invoice  # expanded or not
        paid = payment.get("amount_paid")
        if isinstance(invoice_id, str) and type(paid) is int:
            payments.append(InvoicePayment(invoice_id, paid, str(payment.get("currency") or "")))
    return payments


def _split(amount: int, currency: str, payments: list[InvoicePayment], dispute_id: str) -> dict[str, int]:
    """`amount` (minor units of the dispute's currency) over the invoices the payment paid, oldest
    first, each at most what the payment paid of it. A payment in another currency than the dispute's
    (Stripe disputes in the charge's currency, which is the invoice's: not expected) counts in full."""
    left, out = amount, {}
    for p in payments:
        if p.currency != currency:
            log.error("dispute %s in %s of a payment of invoice %s in %s: counted as the whole %d paid",
                      dispute_id, currency, p.invoice, p.currency, p.amount_paid)
            share = p.amount_paid
        else:
            share = min(left, p.amount_paid)
            left -= share
        out[p.invoice] = out.get(p.invoice, 0) + share
    return out


def chargeback(dispute: dict[str, Any], payments: list[InvoicePayment], withdrawn: int, reinstated: int) -> Apply | None:
    """What the dispute (re-read; funds withdrawn, or won) takes back of the invoices its payment
    paid, `withdrawn` and `reinstated` in minor units of its currency: the account changed, or None
    when none of them is ours."""
    if not payments:
        return None
    currency = str(dispute.get("currency") or "")
    status = str(dispute.get("status"))
    taken = _split(max(0, withdrawn - reinstated), currency, payments, dispute["id"])
    disputed = _split(int(dispute.get("amount") or 0), currency, payments, dispute["id"])
    created = dispute.get("created")
    since = datetime.fromtimestamp(created, tz=timezone.utc) if type(created) is int else utcnow()
    intent = dispute.get("payment_intent") if isinstance(dispute.get("payment_intent"), str) else None

    async def apply(conn: AsyncConnection) -> int | None:
        # Locked, in one order: another event of the same invoice (a second dispute, a settle) waits,
        # then reads this one's row (refresh_invoice).
        ours = (await conn.execute(sa.select(INVOICES.c.id, INVOICES.c.account_id, INVOICES.c.stripe_invoice_id, INVOICES.c.currency)
                                   .where(INVOICES.c.stripe_invoice_id.in_(list(taken))).order_by(INVOICES.c.id)
                                   .with_for_update())).all()
        now = utcnow()
        for row in ours:
            found = (await conn.execute(sa.select(CHARGEBACKS).where(
                CHARGEBACKS.c.invoice_id == row.id, CHARGEBACKS.c.dispute_id == dispute["id"]))).first()
            before = None if found is None else SimpleNamespace(**found._mapping)
            if before is not None and before.settled_at is not None and before.settled_cents is None:
                # Settled by a process of the code before 0027 (a rolling update), which kept no
                # settled_cents: what it covered is what the row took back then, as 0027 fills it in.
                won = before.status == "won" and int(before.amount_cents) == 0
                before.settled_cents = int(before.disputed_cents) if won else int(before.amount_cents)
                await conn.execute(CHARGEBACKS.update().where(CHARGEBACKS.c.id == before.id).values(settled_cents=before.settled_cents))
            values = dict(status=status, currency=currency or row.currency, disputed_cents=disputed[row.stripe_invoice_id],
                          amount_cents=taken[row.stripe_invoice_id], disputed_at=since, payment_intent=intent, updated_at=now)
            stmt = upsert(conn.engine, CHARGEBACKS).values(invoice_id=row.id, dispute_id=dispute["id"], **values)
            await conn.execute(stmt.on_conflict_do_update(index_elements=["invoice_id", "dispute_id"], set_=values))
            if before is not None and before.settled_at is not None:
                due = chargeback_refund_due(SimpleNamespace(**{**vars(before), "amount_cents": values["amount_cents"]}))
                if due > chargeback_refund_due(before):  # this event gave money back: once, not on every later event
                    log.warning("invoice %s paid twice: its chargeback of dispute %s was settled outside Stripe (%d %s) and the "
                                "dispute is now %s (%d taken back): refund %d %s to the customer, then record it with "
                                "POST /admin/invoices/%s/chargeback_refunded", row.id, dispute["id"], before.settled_cents or 0,
                                values["currency"], status, values["amount_cents"], due, values["currency"], row.id)
            await refresh_invoice(conn, int(row.id))
        return int(ours[0].account_id) if ours else None

    return apply

