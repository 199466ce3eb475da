"""Prepaid statements: the monthly close's document for a prepaid account.

A prepaid account's usage is paid from its balance, so its month is not an invoice but a statement:

    opening balance                 the previous statement's closing balance (the first: the balance at the month's start)
  + credits of the month            top-ups, grants, refunds, expiries, adjustments (credit rows created in the month)
  + recorded late                   earlier months' usage (or credits) that reached the ledger after their statement
  - usage of the month              ledger cost of rows admitted in the month (since the account became prepaid)
  = closing balance                 the balance at the month's end, as the ledger has it at the close
    amount due                      none

Numbered without gaps like invoices (`document_sequences`, one sequence, `ST-000001`), the
seller and the buyer snapshotted at issue, one per account and period (unique: a second close
returns it), never edited, and never sent to Stripe (Stripe only ever sees the `invoices` table).
Rows are split as the rest of prepaid credit splits them: a ledger row is the balance's when it
was admitted at or after `prepaid_since` (`spends_balance`), and its month is its `admitted_at`'s.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from billing.invoices.billing_details import get_details, next_number
from billing.config import BillingConfig
from billing.credits.models import CreditEntry, PrepaidStatement
from billing.ledger.records import spends_balance
from billing.credits.views import entry_view, usd
from billing.invoices.documents import buyer_snapshot
from billing.models import Account, LedgerEntry
from billing.invoices.periods import Period

STATEMENTS = PrepaidStatement.__table__
CREDITS = CreditEntry.__table__
ACCOUNTS = Account.__table__
LEDGER = LedgerEntry.__table__
STATEMENT_PREFIX = "ST"
SEQUENCE = "prepaid-statements"  # one sequence whatever the seller: a statement is not a tax document
NO_AMOUNT_DUE = "No amount due: this account is prepaid, and its usage was paid from its balance."


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


async def _credits_before(conn: AsyncConnection, account_id: int, t: datetime) -> int:
    query = sa.select(sa.func.coalesce(sa.func.sum(CREDITS.c.amount_nanos), 0)).where(
        CREDITS.c.account_id == account_id, CREDITS.c.kind != "usage", CREDITS.c.created_at < t)
    return int((await conn.execute(query)).scalar_one())


async def _usage_before(conn: AsyncConnection, account_id: int, since: datetime, t: datetime) -> int:
    query = sa.select(sa.func.coalesce(sa.func.sum(LEDGER.c.cost_nanos), 0)).where(
        LEDGER.c.account_id == account_id, spends_balance(since), LEDGER.c.admitted_at < t)
    return int((await conn.execute(query)).scalar_one())


async def _usage_by_model(conn: AsyncConnection, account_id: int, since: datetime, period: Period) -> list[dict[str, Any]]:
    cached = sa.case((LEDGER.c.cached_tokens > LEDGER.c.prompt_tokens, LEDGER.c.prompt_tokens),
                     else_=sa.func.coalesce(LEDGER.c.cached_tokens, 0))
    query = sa.select(
        LEDGER.c.model, sa.func.count().label("requests"), sa.func.sum(LEDGER.c.prompt_tokens).label("prompt"),
        sa.func.sum(cached).label("cached"), sa.func.sum(LEDGER.c.completion_tokens).label("completion"),
        sa.func.coalesce(sa.func.sum(LEDGER.c.cost_nanos), 0).label("cost"),
    ).where(
        LEDGER.c.account_id == account_id, spends_balance(since),
        LEDGER.c.admitted_at >= period.start, LEDGER.c.admitted_at < period.end,
    ).group_by(LEDGER.c.model).order_by(LEDGER.c.model)
    return [{"model": r.model, "requests": int(r.requests), "prompt_tokens": int(r.prompt or 0), "cached_tokens": int(r.cached or 0),
             "completion_tokens": int(r.completion or 0), "cost_nanos": int(r.cost), "cost": usd(int(r.cost))}
            for r in (await conn.execute(query)).all()]


async def figures(conn: AsyncConnection, account_id: int, since: datetime, period: Period) -> dict[str, Any]:
    previous = (await conn.execute(sa.select(STATEMENTS.c.closing_nanos).where(
        STATEMENTS.c.account_id == account_id, STATEMENTS.c.period < str(period)).order_by(STATEMENTS.c.period.desc()).limit(1))).first()
    at_start = await _credits_before(conn, account_id, period.start) - await _usage_before(conn, account_id, since, period.start)
    opening = at_start if previous is None else int(previous.closing_nanos)
    rows = (await conn.execute(sa.select(CREDITS).where(
        CREDITS.c.account_id == account_id, CREDITS.c.kind != "usage", CREDITS.c.created_at >= period.start,
        CREDITS.c.created_at < period.end).order_by(CREDITS.c.created_at, CREDITS.c.id))).all()
    usage = await _usage_by_model(conn, account_id, since, period)
    credits, used = sum(int(r.amount_nanos) for r in rows), sum(u["cost_nanos"] for u in usage)
    closing = await _credits_before(conn, account_id, period.end) - await _usage_before(conn, account_id, since, period.end)
    late = at_start - opening
    if opening + late + credits - used != closing:  # the figures are one ledger read in one transaction
        raise RuntimeError(f"statement of account {account_id} for {period} does not add up")
    return {"opening": opening, "late": late, "credits": credits, "usage": used, "closing": closing,
            "content": {"credits": [_credit_line(r) for r in rows], "usage": usage}}


def _credit_line(row: Any) -> dict[str, Any]:
    view = entry_view(row)
    return {k: view[k] for k in ("id", "kind", "amount_nanos", "amount", "reason", "external_id", "expires_at", "created_at")}


async def _statement_id(conn: AsyncConnection, account_id: int, period: Period) -> int | None:
    value = (await conn.execute(sa.select(STATEMENTS.c.id).where(
        STATEMENTS.c.account_id == account_id, STATEMENTS.c.period == str(period)))).scalar_one_or_none()
    return None if value is None else int(value)


async def close_statement(
    db: AsyncEngine, account_id: int, period: Period, *, now: datetime, config: BillingConfig | None = None,
) -> tuple[int | None, bool]:
    """The prepaid account's statement for the period: (id, created). (None, False) for an account
    that was not prepaid in the period, or one with nothing to state (no balance, no activity).
    Idempotent: a statement already there is returned unchanged."""
    config = config or BillingConfig()
    try:
        async with db.begin() as conn:
            existing = await _statement_id(conn, account_id, period)
            if existing is not None:
                return existing, False
            account = (await conn.execute(sa.select(ACCOUNTS.c.name, ACCOUNTS.c.prepaid_since).where(ACCOUNTS.c.id == account_id))).first()
            if account is None or account.prepaid_since is None or _aware(account.prepaid_since) >= period.end:
                return None, False
            month = await figures(conn, account_id, _aware(account.prepaid_since), period)
            if not any((month["opening"], month["late"], month["content"]["credits"], month["content"]["usage"])):
                return None, False
            seller = config.seller
            number = f"{STATEMENT_PREFIX}-{await next_number(conn, SEQUENCE, 'statement'):06d}"
            statement_id = (await conn.execute(STATEMENTS.insert().values(
                number=number, account_id=account_id, period=str(period), period_start=period.start, period_end=period.end,
                opening_nanos=month["opening"], credits_nanos=month["credits"], usage_nanos=month["usage"],
                late_nanos=month["late"], closing_nanos=month["closing"], content=json.dumps(month["content"]),
                seller=json.dumps(seller.snapshot()) if seller.identified else None,
                buyer=json.dumps(buyer_snapshot(await get_details(conn, account_id), account.name)), issued_at=now,
            ).returning(STATEMENTS.c.id))).scalar_one()
            return int(statement_id), True
    except IntegrityError:  # another instance made it first: a repeat is success
        async with db.connect() as conn:
            existing = await _statement_id(conn, account_id, period)
        if existing is None:
            raise
        return existing, False


def statement_view(row: Any) -> dict[str, Any]:
    content = json.loads(row.content)
    return {
        "id": row.id, "object": "prepaid_statement", "document": "prepaid_statement", "number": row.number,
        "account_id": row.account_id, "account_name": row.account_name, "period": row.period,
        "period_start": _aware(row.period_start).isoformat(), "period_end": _aware(row.period_end).isoformat(),
        "issued_at": _aware(row.issued_at).isoformat(), "currency": "usd",
        "seller": json.loads(row.seller) if row.seller else None, "buyer": json.loads(row.buyer) if row.buyer else None,
        "opening_balance_nanos": int(row.opening_nanos), "opening_balance": usd(int(row.opening_nanos)),
        "credits_nanos": int(row.credits_nanos), "credits": content["credits"],
        "late_nanos": int(row.late_nanos),
        "usage_nanos": int(row.usage_nanos), "usage": content["usage"],
        "closing_balance_nanos": int(row.closing_nanos), "closing_balance": usd(int(row.closing_nanos)),
        "amount_due_cents": 0, "amount_due": "0.00", "notice": NO_AMOUNT_DUE,
    }


def _select() -> Any:
    return sa.select(STATEMENTS, ACCOUNTS.c.name.label("account_name")).join(ACCOUNTS, ACCOUNTS.c.id == STATEMENTS.c.account_id)


async def get_statement(db: AsyncEngine, statement_id: int, *, account_id: int | None = None) -> dict[str, Any] | None:
    """One statement; with `account_id`, only if it is that account's."""
    query = _select().where(STATEMENTS.c.id == statement_id)
    if account_id is not None:
        query = query.where(STATEMENTS.c.account_id == account_id)
    async with db.connect() as conn:
        row = (await conn.execute(query)).first()
    return None if row is None else statement_view(row)


async def list_statements(db: AsyncEngine, *, account_id: int | None = None, period: str | None = None,
                          limit: int = 1000) -> list[dict[str, Any]]:
    query = _select().order_by(STATEMENTS.c.period.desc(), STATEMENTS.c.id).limit(limit)
    if account_id is not None:
        query = query.where(STATEMENTS.c.account_id == account_id)
    if period is not None:
        query = query.where(STATEMENTS.c.period == period)
    async with db.connect() as conn:
        return [statement_view(r) for r in (await conn.execute(query)).all()]
