"""Reading invoices: JSON views for the admin API, the customer's own API and the renderers."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.invoice_models import Invoice, InvoiceLine
from billing.invoicing import format_cents
from billing.models import Account

INVOICES = Invoice.__table__
LINES = InvoiceLine.__table__
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


def invoice_view(row: Any, lines: list[Any], *, admin: bool) -> dict[str, Any]:
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
        "total_cents": int(row.total_cents),
        "total": format_cents(int(row.total_cents)),
        "lines": [line_view(line) for line in lines],
        "price_versions": json.loads(row.price_versions),
        "created_at": _iso(row.created_at),
        "paid_at": _iso(row.paid_at),
    }
    if admin:
        view["stripe"] = {
            "invoice_id": row.stripe_invoice_id,
            "status": row.stripe_status,
            "total_cents": row.stripe_total_cents,
            "synced_at": _iso(row.stripe_synced_at),
            "error": row.stripe_error,
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
    return invoice_view(row, lines, admin=admin)


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
    by_invoice: dict[int, list[Any]] = {}
    for line in lines:
        by_invoice.setdefault(line.invoice_id, []).append(line)
    return [invoice_view(r, by_invoice.get(r.id, []), admin=admin) for r in rows]
