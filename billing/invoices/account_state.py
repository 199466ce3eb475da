"""An account's billing state, derived from facts rather than from the order events came in:

    delinquent_since = earliest of: a failed payment on an invoice still open, a chargeback of a
                       paid invoice's payment (not won), a subscription past_due/unpaid, and
                       (invoices sent for payment, collection method send_invoice) the due date of
                       an invoice still open on Stripe (NULL when none)
    state            = active     when delinquent_since is NULL or still ahead
                       past_due   while now < delinquent_since + grace (keys keep working)
                       suspended  afterwards (keys get 403 naming the unpaid invoices)

A sent invoice gets no payment attempt that could fail: without its due date, a customer who never
pays it would never be suspended. Its due date is known when it reaches Stripe, so it is stored
ahead of time and the state turns by the clock alone (the monthly job stores it each round).
Paying (invoice.paid) clears the invoice's failure and its due date, so the state returns to
active by itself. A chargeback is a payment that failed after the fact: the invoice stays paid
(as on Stripe) and what its disputes took back (chargeback_cents, exact cents: a partial dispute owes
its part, not the invoice's total) is owed again from the earliest dispute's creation until each is
won or settled (billing/stripe/invoice_disputes.py).
`AccountStates` keeps the delinquent accounts in memory (refreshed every second or so), so the
request path checks a key without any I/O.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from billing.invoices.models import BillingAccount, Invoice
from billing.invoices.close import format_cents
from billing.keys.store import Principal
from billing.models import utcnow
from billing.periodic import Periodic
from billing.stripe.sync import upsert

log = logging.getLogger("tollgate.billing_state")

INVOICES = Invoice.__table__
BILLING = BillingAccount.__table__
ACTIVE, PAST_DUE, SUSPENDED = "active", "past_due", "suspended"
DELINQUENT_SUBSCRIPTION = ("past_due", "unpaid")


def _aware(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def derive_state(delinquent_since: datetime | None, now: datetime, grace_seconds: float) -> str:
    since = _aware(delinquent_since)
    if since is None or now < since:
        return ACTIVE
    return PAST_DUE if now < since + timedelta(seconds=grace_seconds) else SUSPENDED


def on_stripe_unpaid() -> Any:
    """Invoices the customer was asked to pay through Stripe and has not: open on both sides."""
    return sa.and_(INVOICES.c.status == "open", INVOICES.c.stripe_status == "open", INVOICES.c.due_at.is_not(None))


def still_owed() -> Any:
    """Invoices the customer owes: open, or paid and then charged back (the bank took money back)."""
    return sa.or_(INVOICES.c.status == "open", sa.and_(INVOICES.c.status == "paid", INVOICES.c.chargeback_cents > 0))


def owed_cents() -> Any:
    """What the customer owes of an invoice still owed: an open one's total, a charged-back paid one's
    chargebacks (what the disputes took back, not the whole invoice)."""
    return sa.case((INVOICES.c.status == "paid", INVOICES.c.chargeback_cents), else_=INVOICES.c.total_cents)


async def recompute(conn: AsyncConnection, account_id: int, *, now: datetime, grace_seconds: float, overdue: bool = False) -> str:
    """Re-derives and stores one account's state from its invoices and subscription; `overdue`:
    invoices are sent for payment by a due date (collection method send_invoice), which counts."""
    failed = (
        await conn.execute(
            sa.select(sa.func.min(INVOICES.c.payment_failed_at)).where(
                INVOICES.c.account_id == account_id, INVOICES.c.status == "open", INVOICES.c.payment_failed_at.is_not(None)
            )
        )
    ).scalar_one_or_none()
    charged_back = (
        await conn.execute(
            sa.select(sa.func.min(INVOICES.c.charged_back_at)).where(
                INVOICES.c.account_id == account_id, INVOICES.c.status == "paid", INVOICES.c.chargeback_cents > 0
            )
        )
    ).scalar_one_or_none()
    subscription = (
        await conn.execute(sa.select(BILLING.c.subscription_delinquent_since).where(BILLING.c.account_id == account_id))
    ).scalar_one_or_none()
    due = None
    if overdue:
        due = (
            await conn.execute(sa.select(sa.func.min(INVOICES.c.due_at)).where(INVOICES.c.account_id == account_id, on_stripe_unpaid()))
        ).scalar_one_or_none()
    candidates = [t for t in (_aware(failed), _aware(charged_back), _aware(subscription), _aware(due)) if t is not None]
    since = min(candidates) if candidates else None
    state = derive_state(since, now, grace_seconds)
    values = dict(state=state, delinquent_since=since, updated_at=now)
    stmt = upsert(conn.engine, BILLING).values(account_id=account_id, **values)
    await conn.execute(stmt.on_conflict_do_update(index_elements=["account_id"], set_=values))
    return state


async def account_standing(db: AsyncEngine, account_id: int, *, grace_seconds: float, now: datetime | None = None) -> dict[str, Any]:
    now = now or utcnow()
    async with db.connect() as conn:
        row = (await conn.execute(sa.select(BILLING).where(BILLING.c.account_id == account_id))).first()
        unpaid = (
            await conn.execute(
                sa.select(INVOICES.c.id, INVOICES.c.number, INVOICES.c.total_cents, INVOICES.c.payment_failed_at, INVOICES.c.due_at,
                          INVOICES.c.charged_back_at, owed_cents().label("owed"))
                .where(INVOICES.c.account_id == account_id, still_owed())
                .order_by(INVOICES.c.period)
            )
        ).all()
    since = _aware(row.delinquent_since) if row else None
    if since is not None and now < since:  # an unpaid invoice's due date still ahead: not delinquent yet
        since = None
    return {
        "object": "billing_account",
        "account_id": account_id,
        "state": derive_state(since, now, grace_seconds),
        "delinquent_since": since.isoformat() if since else None,
        "suspends_at": (since + timedelta(seconds=grace_seconds)).isoformat() if since else None,
        "stripe_customer_id": row.stripe_customer_id if row else None,
        "subscription_status": row.subscription_status if row else None,
        "unpaid_invoices": [
            {"id": u.id, "number": u.number, "total_cents": int(u.total_cents), "total": format_cents(int(u.total_cents)),
             "amount_owed_cents": int(u.owed), "amount_owed": format_cents(int(u.owed)),  # a charged-back one: what was taken back
             "payment_failed": u.payment_failed_at is not None,
             "charged_back_at": _aware(u.charged_back_at).isoformat() if u.charged_back_at else None,  # type: ignore[union-attr]
             "due_at": _aware(u.due_at).isoformat() if u.due_at else None,  # type: ignore[union-attr]
             "overdue": u.due_at is not None and now >= _aware(u.due_at)}  # type: ignore[operator]
            for u in unpaid
        ],
    }


@dataclass(frozen=True)
class Delinquency:
    since: datetime
    unpaid: tuple[tuple[str, int], ...]  # (invoice number, cents owed: owed_cents), oldest first


class AccountStates:
    """The delinquent accounts, in memory; `suspension` answers without any I/O."""

    def __init__(self, db: AsyncEngine, *, grace_seconds: float, refresh_seconds: float = 1.0) -> None:
        self._db = db
        self._grace = timedelta(seconds=grace_seconds)
        self._refresh_seconds = refresh_seconds
        self._delinquent: dict[int, Delinquency] = {}
        self._failing = False  # the last refresh failed (said once, and once when it works again)
        self._loop = Periodic("billing-states", refresh_seconds, self._refresh_round, on_error=self._refresh_failed, first=True)
        # One refresh at a time: a periodic read that began before a webhook's change committed
        # must not finish after the webhook's own refresh and put the old list back.
        self._refreshing = asyncio.Lock()

    def suspension(self, principal: Principal, now: datetime | None = None) -> str | None:
        """Why this key's account is suspended (naming its unpaid invoices), or None."""
        found = self._delinquent.get(principal.account_id)
        if found is None or principal.is_admin or (now or utcnow()) < found.since + self._grace:
            return None
        owed = ", ".join(f"{number} ({format_cents(cents)} USD)" for number, cents in found.unpaid) or "see your invoices"
        return (
            f"This account is suspended for unpaid invoices: {owed}. Pay them to restore access; "
            "GET /v1/invoices lists them."
        )

    async def refresh(self) -> None:
        async with self._refreshing:
            await self._load()

    async def _load(self) -> None:
        async with self._db.connect() as conn:
            rows = (
                await conn.execute(
                    sa.select(BILLING.c.account_id, BILLING.c.delinquent_since).where(BILLING.c.delinquent_since.is_not(None))
                )
            ).all()
            ids = [r.account_id for r in rows]
            unpaid = (
                await conn.execute(
                    sa.select(INVOICES.c.account_id, INVOICES.c.number, owed_cents().label("owed"))
                    .where(INVOICES.c.account_id.in_(ids), still_owed())
                    .order_by(INVOICES.c.period)
                )
            ).all() if ids else []
        owed: dict[int, list[tuple[str, int]]] = {}
        for u in unpaid:
            owed.setdefault(u.account_id, []).append((u.number, int(u.owed)))
        self._delinquent = {
            r.account_id: Delinquency(_aware(r.delinquent_since), tuple(owed.get(r.account_id, [])))  # type: ignore[arg-type]
            for r in rows
        }

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def _refresh_round(self) -> None:
        await self.refresh()
        if self._failing:
            log.info("billing states refresh works again")
        self._failing = False

    def _refresh_failed(self, exc: Exception) -> None:  # keep serving with the last known list; say so once
        if not self._failing:
            log.error("billing states refresh failed (keeping the last list): %s", type(exc).__name__)
        self._failing = True
