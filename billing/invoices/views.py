"""Reading invoices: JSON views for the admin API, the customer's own API and the renderers."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.invoices.models import CreditNote, Invoice, InvoiceChargeback, InvoiceLine, chargeback_refund_due
from billing.invoices.close import format_cents
from billing.models import Account

INVOICES = Invoice.__table__
LINES = InvoiceLine.__table__
CREDIT_NOTES = CreditNote.__table__
CHARGEBACKS = InvoiceChargeback.__table__
ACCOUNTS = Account.__table__


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).isoformat()


def _unit(value: Any) -> str | None:
    if value is None:
        return None
    text = format(Decimal(value).normalize(), "f")
    whole, _, places = text.partition(".")
    return f"{whole}.{places.ljust(3, '0')}"


def line_view(row: Any) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "invoice_line",
        "position": row.position,
        "kind": row.kind,
        "usage_period": row.usage_period,
        "model": row.model,
        "direction": row.direction,
        "tokens": int(row.tokens),
        "unit_price_per_million": _unit(row.unit_price),
        "amount_cents": int(row.amount_cents),
        "amount": format_cents(int(row.amount_cents)),
        "price_version_id": row.price_version_id,
        "override_id": row.override_id,
        "description": row.description,
    }


def _rate(value: Any) -> str | None:
    return None if value is None else format(Decimal(value).quantize(Decimal("0.001")), "f")


def credit_note_view(row: Any, invoice_number: str | None = None) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "credit_note",
        "number": row.number,
        "invoice_id": row.invoice_id,
        "invoice_number": invoice_number,
        "account_id": row.account_id,
        "kind": row.kind,
        "reason": row.reason,
        "memo": row.memo,
        "subtotal_cents": int(row.subtotal_cents),
        "tax_cents": int(row.tax_cents),
        "total_cents": int(row.total_cents),
        "total": format_cents(int(row.total_cents)),
        "applies_to": row.applies_to,
        "issued_at": _iso(row.issued_at),
        "shown_on_invoice_id": row.shown_on_invoice_id,
        "stripe_credit_note_id": row.stripe_credit_note_id,
    }


def chargeback_view(row: Any, *, admin: bool) -> dict[str, Any]:
    """One chargeback as the invoice views show it (the dispute's Stripe ids to the admin only)."""
    view = {
        "object": "invoice_chargeback",
        "status": "settled" if row.settled_at is not None else row.status,
        "dispute_status": row.status,
        "currency": row.currency,
        "disputed_cents": int(row.disputed_cents),
        "disputed": format_cents(int(row.disputed_cents)),
        "amount_cents": int(row.amount_cents),  # taken back now (0: won)
        "amount": format_cents(int(row.amount_cents)),
        "owed": row.settled_at is None and int(row.amount_cents) > 0,
        "disputed_at": _iso(row.disputed_at),
        "settled_at": _iso(row.settled_at),
        "settled_cents": None if row.settled_cents is None else int(row.settled_cents),  # what the settlement covered
        # settled, then its dispute won (or part reinstated): paid twice, this is owed back to the customer
        "refund_due_cents": chargeback_refund_due(row),
        "refund_due": format_cents(chargeback_refund_due(row)),
        "refunded_cents": int(row.refunded_cents or 0),  # recorded refunded (chargeback_refunded)
        "refunded_at": _iso(row.refunded_at),
    }
    if admin:
        view["dispute_id"] = row.dispute_id
        view["payment_intent"] = row.payment_intent
    return view


async def chargebacks_of(conn: Any, invoice_ids: list[int], *, admin: bool) -> dict[int, list[dict[str, Any]]]:
    """Each invoice's chargebacks, oldest dispute first."""
    if not invoice_ids:
        return {}
    rows = (await conn.execute(sa.select(CHARGEBACKS).where(CHARGEBACKS.c.invoice_id.in_(invoice_ids))
                               .order_by(CHARGEBACKS.c.disputed_at, CHARGEBACKS.c.id))).all()
    out: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(int(row.invoice_id), []).append(chargeback_view(row, admin=admin))
    return out


def invoice_view(row: Any, lines: list[Any], *, admin: bool, credit_notes: list[dict[str, Any]] | None = None,
                 shown_credit_notes: list[dict[str, Any]] | None = None, chargebacks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    subtotal = int(row.subtotal_cents) if row.subtotal_cents is not None else int(row.total_cents)
    # What Stripe collects on it: less what it carried to the next invoice (below its minimum charge),
    # plus what it carried here from earlier ones
    carried_out, carried_in = int(row.carried_to_next_cents or 0), int(row.carried_in_cents or 0)
    due = int(row.total_cents) - int(row.credit_applied_cents or 0) - carried_out + carried_in
    credited = sum(c["total_cents"] for c in credit_notes or [])
    view: dict[str, Any] = {
        "id": row.id,
        "object": "invoice",
        "number": row.number,
        "account_id": row.account_id,
        "account_name": row.account_name,
        "period": row.period,
        "period_start": _iso(row.period_start),
        "period_end": _iso(row.period_end),
        "status": row.status,
        "currency": row.currency,
        # An invoice with a seller identity; without one (or issued before invoices carried one) a usage statement.
        "document": "invoice" if row.seller else "usage_statement",
        "seller": json.loads(row.seller) if row.seller else None,
        "buyer": json.loads(row.buyer) if row.buyer else None,
        "issued_at": _iso(row.issued_at or row.created_at),
        "due_at": _iso(row.due_at),
        "payment_terms": row.payment_terms,
        "subtotal_cents": subtotal,
        "subtotal": format_cents(subtotal),
        "tax": {"rate": _rate(row.tax_rate), "amount_cents": int(row.tax_cents or 0), "amount": format_cents(int(row.tax_cents or 0))}
        if row.tax_rate is not None else None,
        "total_cents": int(row.total_cents),
        "total": format_cents(int(row.total_cents)),
        "credit_applied_cents": int(row.credit_applied_cents or 0),
        # below Stripe's minimum charge (USD $0.50) Stripe charges nothing, marks the invoice paid and
        # collects the amount with the customer's next invoice: carried out of this one, into that one
        "carried_to_next_cents": carried_out,
        "carried_to_next": format_cents(carried_out),
        "carried_in_cents": carried_in,
        "carried_in": format_cents(carried_in),
        "amount_due_cents": due,
        "amount_due": format_cents(due),
        "credited_cents": credited,
        "credit_notes": credit_notes or [],  # issued against this invoice (it is never edited)
        "credit_notes_since_last_invoice": shown_credit_notes or [],
        "lines": [line_view(line) for line in lines],
        "price_versions": json.loads(row.price_versions),
        "created_at": _iso(row.created_at),
        "paid_at": _iso(row.paid_at),
        # its payments taken back by the customer's bank (disputes not won, nor settled): owed again,
        # though paid: since the earliest of them, the sum they took back
        "charged_back_at": _iso(row.charged_back_at),
        "chargeback_cents": int(row.chargeback_cents or 0),
        "chargeback": format_cents(int(row.chargeback_cents or 0)),
        "chargebacks": chargebacks or [],  # every dispute of its payments that took money, won and settled ones too
        # paid twice: chargebacks settled outside Stripe whose disputes were then won; owed back to the customer
        "refund_due_cents": sum(c["refund_due_cents"] for c in chargebacks or []),
        "refund_due": format_cents(sum(c["refund_due_cents"] for c in chargebacks or [])),
    }
    if admin:
        view["stripe"] = {
            "invoice_id": row.stripe_invoice_id,
            "status": row.stripe_status,
            "total_cents": row.stripe_total_cents,
            "synced_at": _iso(row.stripe_synced_at),
            "error": row.stripe_error,
            # the earliest dispute still owed again (None: none); `chargebacks` lists every one
            "chargeback_dispute_id": next((c.get("dispute_id") for c in chargebacks or [] if c["owed"]), None),
        }
        view["payment_failed_at"] = _iso(row.payment_failed_at)
    return view


def _select() -> Any:
    return sa.select(INVOICES, ACCOUNTS.c.name.label("account_name")).join(ACCOUNTS, ACCOUNTS.c.id == INVOICES.c.account_id)


async def get_invoice(db: AsyncEngine, invoice_id: int, *, account_id: int | None = None, admin: bool = True) -> dict[str, Any] | None:
    """One invoice with its lines; with `account_id`, only if it belongs to that account."""
    query = _select().where(INVOICES.c.id == invoice_id)
    if account_id is not None:
        query = query.where(INVOICES.c.account_id == account_id)
    async with db.connect() as conn:
        row = (await conn.execute(query)).first()
        if row is None:
            return None
        lines = (await conn.execute(sa.select(LINES).where(LINES.c.invoice_id == invoice_id).order_by(LINES.c.position))).all()
        notes = await _credit_notes(conn, [invoice_id])
        chargebacks = await chargebacks_of(conn, [invoice_id], admin=admin)
    return invoice_view(row, lines, admin=admin, credit_notes=notes["against"].get(invoice_id), shown_credit_notes=notes["shown"].get(invoice_id),
                        chargebacks=chargebacks.get(invoice_id))


async def _credit_notes(conn: Any, invoice_ids: list[int]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Credit notes against these invoices, and those each of them lists as issued since the last one."""
    out: dict[str, dict[int, list[dict[str, Any]]]] = {"against": {}, "shown": {}}
    if not invoice_ids:
        return out
    query = (
        sa.select(CREDIT_NOTES, INVOICES.c.number.label("invoice_number"))
        .join(INVOICES, INVOICES.c.id == CREDIT_NOTES.c.invoice_id)
        .where(sa.or_(CREDIT_NOTES.c.invoice_id.in_(invoice_ids), CREDIT_NOTES.c.shown_on_invoice_id.in_(invoice_ids)))
        .order_by(CREDIT_NOTES.c.id)
    )
    for row in (await conn.execute(query)).all():
        view = credit_note_view(row, row.invoice_number)
        if row.invoice_id in invoice_ids:
            out["against"].setdefault(row.invoice_id, []).append(view)
        if row.shown_on_invoice_id in invoice_ids:
            out["shown"].setdefault(row.shown_on_invoice_id, []).append(view)
    return out


async def list_invoices(
    db: AsyncEngine, *, account_id: int | None = None, period: str | None = None, admin: bool = True, limit: int = 1000
) -> list[dict[str, Any]]:
    """Invoices newest first, with their lines."""
    query = _select().order_by(INVOICES.c.period.desc(), INVOICES.c.id).limit(limit)
    if account_id is not None:
        query = query.where(INVOICES.c.account_id == account_id)
    if period is not None:
        query = query.where(INVOICES.c.period == period)
    async with db.connect() as conn:
        rows = (await conn.execute(query)).all()
        ids = [r.id for r in rows]
        lines = (await conn.execute(sa.select(LINES).where(LINES.c.invoice_id.in_(ids)).order_by(LINES.c.position))).all() if ids else []
        notes = await _credit_notes(conn, ids)
        chargebacks = await chargebacks_of(conn, ids, admin=admin)
    by_invoice: dict[int, list[Any]] = {}
    for line in lines:
        by_invoice.setdefault(line.invoice_id, []).append(line)
    return [invoice_view(r, by_invoice.get(r.id, []), admin=admin, credit_notes=notes["against"].get(r.id),
                         shown_credit_notes=notes["shown"].get(r.id), chargebacks=chargebacks.get(r.id)) for r in rows]
