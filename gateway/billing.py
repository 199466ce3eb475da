"""Billing at run time, built once in the lifespan: `start(app)` makes `app.state.billing` (the
account states that suspend an account's keys, Stripe sync and webhooks, the monthly close) and
`start_credits(app)` prepaid credit's services (the credit book, spend alerts, Stripe Checkout)
and the loop that runs `billing.credits.housekeeping` every TOLLGATE_CREDITS_CHECK_SECONDS.

Apart from the routes that read them (gateway/api/account/, gateway/admin/, gateway/webhooks/). The
request path's suspension check reads `states` beside authentication (gateway/http/requests.py).
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any

from starlette.applications import Starlette

from billing.alerts.spend import AlertService
from billing.config import BillingConfig
from billing.credits.balance import CreditBook
from billing.credits.housekeeping import housekeeping
from billing.invoices.account_state import AccountStates
from billing.invoices.close import CloseResult, close_period
from billing.invoices.periods import Period
from billing.invoices.scheduler import MonthlyClose
from billing import periodic
from billing.prices.book import PriceBook
from billing.stripe.checkout import CheckoutService
from billing.stripe.sync import StripeSync, stripe_client
from billing.stripe.webhooks import WebhookHandler
from gateway.http.errors import APIError

log = logging.getLogger("tollgate.billing")
credits_log = logging.getLogger("tollgate.credits")


class StripeFailed(APIError):
    status_code = 502
    error_type = "server_error"
    code = "stripe_error"


class Billing:
    """Everything billing needs at run time, built once in the lifespan."""

    def __init__(self, db: Any, book: PriceBook, config: BillingConfig) -> None:
        self.db = db
        self.book = book
        self.config = config
        self.states = AccountStates(db, grace_seconds=config.grace_seconds, refresh_seconds=config.state_refresh_seconds)
        client = stripe_client(config) if config.stripe_enabled else None
        self.stripe = StripeSync(db, client, config) if client is not None else None
        self.webhooks = (
            WebhookHandler(
                db, client, config.stripe_webhook_secret, grace_seconds=config.grace_seconds, overdue=config.sends_for_payment,
                on_change=self._changed,
            )
            if client is not None and config.stripe_webhook_secret
            else None
        )
        self.scheduler = MonthlyClose(db, book, config, stripe=self.stripe) if config.auto_close else None
        self._runs: dict[str, asyncio.Task[CloseResult | None]] = {}

    async def start(self) -> None:
        try:
            await self.states.refresh()
        except Exception as exc:  # the refresher keeps trying; serving does not wait for billing
            log.error("billing states not loaded at start: %s", type(exc).__name__)
        self.states.start()
        if self.scheduler is not None:
            self.scheduler.start()

    async def stop(self) -> None:
        for task in self._runs.values():
            task.cancel()
        if self.scheduler is not None:
            await self.scheduler.stop()
        await self.states.stop()

    async def push_after_close(self) -> list[dict[str, Any]] | None:
        """What a close does next when Stripe is on and TOLLGATE_STRIPE_SYNC_AFTER_CLOSE is set (as the CLI)."""
        if self.stripe is None or not self.config.sync_after_close:
            return None
        return await self.stripe.push_pending()

    async def _changed(self, account_id: int) -> None:
        await self.states.refresh()

    def close_in_background(self, period: Period) -> None:
        running = self._runs.get(str(period))
        if running is None or running.done():
            task = asyncio.get_running_loop().create_task(self._close(period), name=f"close-{period}")
            self._runs[str(period)] = task

    async def _close(self, period: Period) -> CloseResult | None:
        try:
            result = await close_period(self.db, self.book, period, lookback_months=self.config.lookback_months, config=self.config)
            await self.push_after_close()
            return result
        except Exception:  # nobody awaits a background run: report it here (a re-run resumes it)
            log.exception("closing billing period %s failed", period)
            return None


async def start(app: Starlette) -> Billing:
    """Builds billing for the app (after app.state.db and app.state.settings exist)."""
    settings = app.state.settings
    config: BillingConfig = settings.billing  # its group of the one Settings (gateway/config.py)
    book = app.state.prices or PriceBook(app.state.db)
    billing = Billing(app.state.db, book, config)
    await billing.start()
    app.state.billing = billing
    return billing


async def stop(app: Starlette) -> None:
    billing: Billing | None = app.state.billing
    if billing is not None:
        await billing.stop()


def _housekeeping_failed(exc: Exception) -> None:  # the database is down: the next round tries again
    credits_log.warning("credit housekeeping failed: %s", type(exc).__name__)


async def start_credits(app: Starlette) -> None:
    settings = app.state.settings
    every = settings.credits.check_seconds
    app.state.credits = CreditBook(app.state.db, app.state.limiter, settle_seconds=settings.credits.settle_seconds)
    app.state.alerts = AlertService(app.state.db, app.state.credits)
    billing = app.state.billing
    app.state.checkout = None
    if billing.config.stripe_enabled:
        app.state.checkout = CheckoutService(app.state.db, stripe_client(billing.config), app.state.credits)
        if billing.webhooks is not None:  # POST /webhooks/stripe credits top-ups and debits refunds
            billing.webhooks.extra.update(app.state.checkout.webhook_handlers())
            billing.webhooks.after.append(lambda _account: app.state.credits.sync_recent())
    app.state.credits_task = (
        asyncio.create_task(periodic.every(every, partial(housekeeping, app.state.credits, app.state.db, app.state.alerts, app.state.checkout),
                                           on_error=_housekeeping_failed), name="credits")
        if every > 0 else None)


async def stop_credits(app: Starlette) -> None:
    task = app.state.credits_task
    if task is not None:
        task.cancel()
    await app.state.alerts.close()
