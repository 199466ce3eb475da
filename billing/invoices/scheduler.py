"""The server's monthly job: after a month ends (plus a delay for late ledger batches), close it,
push unfinished invoices to Stripe, and store time-driven state changes (past_due -> suspended).

Safe on several instances: each tick takes the close lock without waiting (a Postgres advisory
lock); whoever gets it does the work, the others skip this tick. The unique (account, period)
and the `billing_periods` row make any overlap harmless anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.invoices.account_state import on_stripe_unpaid, recompute
from billing.config import BillingConfig
from billing.invoices.models import BillingAccount, Invoice
from billing.invoices.close import CloseInProgress, CloseResult, close_lock, close_period_locked, period_status
from billing.models import utcnow
from billing.periodic import Periodic
from billing.invoices.periods import Period
from billing.prices.book import PriceBook
from billing.stripe.sync import StripeSync
from billing.stripe.webhooks import apply_stripe_invoice

log = logging.getLogger("tollgate.billing_scheduler")
BILLING = BillingAccount.__table__
INVOICES = Invoice.__table__


def due_period(now: datetime, close_delay_seconds: float) -> Period:
    """The latest month that has ended at least `close_delay_seconds` ago."""
    return Period.containing(now - timedelta(seconds=close_delay_seconds)).prev()


async def store_states(db: AsyncEngine, *, now: datetime, grace_seconds: float, overdue: bool = False) -> None:
    """Stores the states that time changes: delinquent accounts', and (`overdue`) those of accounts
    with invoices open on Stripe, whose due dates count without any event."""
    query = sa.select(BILLING.c.account_id).where(BILLING.c.delinquent_since.is_not(None))
    if overdue:
        query = query.union(sa.select(INVOICES.c.account_id).where(on_stripe_unpaid()))
    async with db.connect() as conn:
        ids = [int(i) for i in (await conn.execute(query)).scalars()]
    for account_id in ids:
        async with db.begin() as conn:
            await recompute(conn, account_id, now=now, grace_seconds=grace_seconds, overdue=overdue)


class MonthlyClose:
    def __init__(
        self,
        db: AsyncEngine,
        book: PriceBook,
        config: BillingConfig,
        *,
        stripe: StripeSync | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._db = db
        self._book = book
        self._config = config
        self._stripe = stripe
        self._clock = clock
        self._loop = Periodic("billing-monthly-close", config.check_seconds, self.tick, on_error=_tick_failed)

    async def tick(self) -> CloseResult | None:
        """One round of work; returns the close result when this instance closed a period."""
        now = self._clock()
        period = due_period(now, self._config.close_delay_seconds)
        result = None
        try:
            async with close_lock(self._db, wait=False):
                status = await period_status(self._db, period)
                if status is None or status["status"] != "closed":
                    result = await close_period_locked(
                        self._db, self._book, period, now=now, lookback_months=self._config.lookback_months, config=self._config
                    )
                if self._stripe is not None and self._config.sync_after_close:
                    await self._stripe.push_pending()
                if self._stripe is not None and self._config.sends_for_payment:  # one instance asks Stripe
                    await self._reread_overdue(now)
        except CloseInProgress:
            log.debug("another instance holds the close lock; skipping this tick")
        await store_states(self._db, now=now, grace_seconds=self._config.grace_seconds, overdue=self._config.sends_for_payment)
        return result

    async def _reread_overdue(self, now: datetime) -> None:
        """Invoices past their due date that Stripe still had open when we last heard: asked again
        before their due dates count, so a payment whose webhook never came (an endpoint down past
        Stripe's retries) suspends nobody. One that cannot be read now counts as it stands."""
        query = sa.select(INVOICES.c.id, INVOICES.c.stripe_invoice_id).where(on_stripe_unpaid(), INVOICES.c.due_at <= now)
        async with self._db.connect() as conn:
            rows = (await conn.execute(query)).all()
        for row in rows:
            try:
                remote = await self._stripe.remote_invoice(row.stripe_invoice_id)  # type: ignore[union-attr]
                carried = await self._stripe.carried_too_small(remote)  # type: ignore[union-attr]
                async with self._db.begin() as conn:
                    await apply_stripe_invoice(conn, remote, now, carried=carried)
            except Exception as exc:
                log.warning("could not read overdue invoice %s from Stripe: %s", row.id, type(exc).__name__)

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()


def _tick_failed(exc: Exception) -> None:  # logged loudly; the next tick retries (every step is idempotent)
    log.error("monthly billing job failed", exc_info=exc)
