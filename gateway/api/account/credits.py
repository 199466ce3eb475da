"""Prepaid credit over HTTP (billing/credits/balance.py holds the rules).

    GET  /v1/billing/balance                      the caller's account: balance, grants, billing mode
    GET  /v1/billing/statement?period=YYYY-MM     a prepaid month: opening balance, top-ups, usage, closing (no amount due)
    GET  /admin/accounts/{id}/statement?period=   the same for an admin
    GET  /v1/statements                           the caller's monthly statements (made by the monthly close)
    GET  /v1/statements/{id}[/html|/pdf]          one of them (the account's own only)
    GET  /admin/statements                        ?account_id=&period=
    GET  /admin/statements/{id}[/html|/pdf]
    GET  /admin/accounts/{id}/credits             balance and the latest credit-ledger rows
    POST /admin/accounts/{id}/credits             {"kind": topup|grant|refund|adjustment, "amount": "10.00",
                                                   "reason": ..., "expires_at": ...}  (the admin key is recorded)
    PUT  /admin/accounts/{id}/billing_mode        {"billing_mode": "prepaid" | "postpaid"}
    POST /v1/billing/checkout                     {"amount": "10.00"}: a Stripe Checkout Session to top up (its url)
    POST /admin/credits/housekeeping              run the periodic work below now
    PUT  /admin/accounts/{id}/recharge            {"recharge_below": "5.00", "recharge_amount": "20.00"} (or nulls: off)
    GET  /v1/billing/alerts                       the caller's account: alert rules and the crossings seen
    GET  /admin/accounts/{id}/alerts              the same for an admin
    POST /admin/accounts/{id}/alerts              {"metric": monthly_spend|monthly_tokens|balance_below, "threshold":
                                                   "5.00" (USD) or tokens, or "percent": 80; "key_id"; "url"} -> the secret, once

A background task (every TOLLGATE_CREDITS_CHECK_SECONDS, default 30) applies credit rows written
elsewhere to this instance's limiter, removes expired grants, posts prepaid usage (incrementally, up
to the ledger ids seen TOLLGATE_CREDITS_SETTLE_SECONDS before: billing/credits/models.py
CreditUsageMark) and checks the spend alerts (billing/alerts/spend.py), and charges auto-recharges that
are due (billing/stripe/checkout.py).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from pydantic import Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from billing.alerts.spend import AlertService
from billing.stripe.checkout import NANOS_PER_CENT, CheckoutService
from billing.credits.balance import ACCOUNTS, CreditBook, CreditError, parse_usd
from billing.models import utcnow
from billing.invoices.periods import InvalidPeriod, Period
from billing.quota import Scope
from billing.invoices.render import render_statement_html, render_statement_pdf
from billing.invoices.statements import get_statement, list_statements
from gateway.admin.accounts import StrictStr, json_response
from gateway.api.account.invoices import document_response
from gateway.dashboard.pages import form_with_csrf, refused, session_or_none, to_login
from gateway.http.errors import InvalidRequest, NotFound
from gateway.http.requests import authenticate, authenticate_admin, id_value, path_id, read_json
from gateway.api.openai.protocol import StrictInt, _Model, parse

log = logging.getLogger("tollgate.credits")


class AddCredit(_Model):
    kind: str = Field(min_length=1, max_length=16)
    amount: StrictStr | StrictInt  # USD; a refund may be given positive (it is debited)
    reason: str | None = Field(default=None, max_length=2000)
    expires_at: datetime | None = None

    def check_supported(self, passthrough: bool = False) -> None:
        if self.expires_at is not None and self.expires_at.tzinfo is None:
            self.expires_at = self.expires_at.replace(tzinfo=timezone.utc)


class BillingMode(_Model):
    billing_mode: str = Field(min_length=1, max_length=16)

    def check_supported(self, passthrough: bool = False) -> None:
        return None


def _book(request: Request) -> CreditBook:
    book: CreditBook = request.app.state.credits
    return book


def _account_id(request: Request) -> int:
    return path_id(request, "account_id", "account", param="account_id")


async def my_balance(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    balance = await _book(request).balance(principal.account_id)
    checkout: CheckoutService | None = request.app.state.checkout
    if checkout is not None and balance is not None:  # a declined auto-recharge is the customer's to see
        recharge = await checkout.settings(principal.account_id)
        balance["recharge"] = {k: recharge.get(k) for k in ("recharge_below_nanos", "recharge_amount_cents", "recharge_state", "recharge_error")}
    return json_response(balance)


async def _statement(request: Request, account_id: int) -> Response:
    try:
        period = Period.parse(request.query_params.get("period") or str(Period.containing(utcnow())))
    except InvalidPeriod as exc:
        raise InvalidRequest(str(exc), param="period", code="invalid_value") from None
    statement = await _book(request).statement(account_id, period.start, period.end)
    if statement is None:
        raise InvalidRequest("This account is postpaid: its months are invoices (/v1/invoices).", param="period", code="not_prepaid")
    return json_response({**statement, "period": str(period)})


async def my_statement(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    return await _statement(request, principal.account_id)


async def admin_statement(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    return await _statement(request, _account_id(request))


def _statement_response(doc: dict[str, Any] | None, request: Request) -> Response:
    fmt = request.path_params.get("fmt", "json")
    if fmt not in ("json", "html", "pdf"):
        raise NotFound(f"Unknown path {request.url.path}: statements come as /html or /pdf.")
    if doc is None:
        raise NotFound("No such statement.", param="id")
    return document_response(doc, fmt, render_statement_html, render_statement_pdf)


def _statement_id(request: Request) -> int:
    return path_id(request, "statement_id", "statement")


async def my_statements(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    return json_response({"object": "list", "data": await list_statements(request.app.state.db, account_id=principal.account_id)})


async def my_statement_document(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    doc = await get_statement(request.app.state.db, _statement_id(request), account_id=principal.account_id)
    return _statement_response(doc, request)


async def admin_statements(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    raw_account, raw_period = request.query_params.get("account_id"), request.query_params.get("period")
    account_id = id_value(raw_account) if raw_account else None
    if raw_account and account_id is None:
        raise InvalidRequest("account_id must be a positive integer", param="account_id", code="invalid_value")
    try:
        period = str(Period.parse(raw_period)) if raw_period else None
    except InvalidPeriod as exc:
        raise InvalidRequest(str(exc), param="period", code="invalid_value") from None
    data = await list_statements(request.app.state.db, account_id=account_id, period=period)
    return json_response({"object": "list", "data": data})


async def admin_statement_document(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    return _statement_response(await get_statement(request.app.state.db, _statement_id(request)), request)


async def admin_credits(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    account_id = _account_id(request)
    balance = await _book(request).balance(account_id)
    if balance is None:
        raise NotFound(f"No account with id {account_id}.", param="account_id")
    checkout: CheckoutService | None = request.app.state.checkout
    recharge = await checkout.settings(account_id) if checkout is not None else None
    return json_response({**balance, "recharge": recharge, "entries": await _book(request).entries(account_id)})


async def admin_add_credit(request: Request) -> Response:
    state = request.app.state
    principal = await authenticate_admin(request, state.keys)
    account_id = _account_id(request)
    body = parse(AddCredit, await read_json(request, state.settings.http.max_body_bytes))
    try:
        nanos = parse_usd(body.amount, "amount", signed=body.kind == "adjustment")
        if body.kind == "refund":
            nanos = -abs(nanos)
        row = await _book(request).add(account_id, body.kind, nanos, reason=body.reason, admin_key_id=principal.key_id,
                                       expires_at=body.expires_at)
    except CreditError as exc:
        if exc.param == "account_id":
            raise NotFound(str(exc), param="account_id") from None
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None
    return json_response(row, 201)


async def admin_billing_mode(request: Request) -> Response:
    state = request.app.state
    await authenticate_admin(request, state.keys)
    account_id = _account_id(request)
    body = parse(BillingMode, await read_json(request, state.settings.http.max_body_bytes))
    try:
        result = await _book(request).set_mode(account_id, body.billing_mode)
    except CreditError as exc:
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None
    if result is None:
        raise NotFound(f"No account with id {account_id}.", param="account_id")
    state.keys.invalidate()  # the next request of its keys sees the new mode
    await state.limiter.invalidate(Scope("account", account_id, None))  # type: ignore[arg-type]
    return json_response(result)


class AddAlert(_Model):
    metric: str = Field(min_length=1, max_length=16)
    threshold: StrictStr | StrictInt | None = None  # USD for spend and balance, tokens for monthly_tokens
    percent: StrictInt | None = Field(default=None, ge=1, le=1000)
    key_id: StrictInt | None = Field(default=None, ge=1, le=2**31 - 1)
    url: str = Field(min_length=1, max_length=2000)

    def check_supported(self, passthrough: bool = False) -> None:
        return None


async def my_alerts(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    alerts: AlertService = request.app.state.alerts
    return json_response({"object": "list", "rules": await alerts.rules(principal.account_id), "data": await alerts.events(principal.account_id)})


async def admin_alerts(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    account_id = _account_id(request)
    alerts: AlertService = request.app.state.alerts
    return json_response({"object": "list", "rules": await alerts.rules(account_id), "data": await alerts.events(account_id)})


async def admin_add_alert(request: Request) -> Response:
    state = request.app.state
    await authenticate_admin(request, state.keys)
    account_id = _account_id(request)
    body = parse(AddAlert, await read_json(request, state.settings.http.max_body_bytes))
    if await state.keys.get_account(account_id=account_id) is None:
        raise NotFound(f"No account with id {account_id}.", param="account_id")
    try:
        threshold = body.threshold
        if threshold is not None and body.metric != "monthly_tokens":
            threshold = parse_usd(threshold, "threshold")
        elif threshold is not None and not isinstance(threshold, int):
            raise CreditError("threshold of monthly_tokens is an integer number of tokens", "threshold")
        rule = await state.alerts.add_rule(account_id, body.metric, url=body.url, threshold=threshold, percent=body.percent,
                                           key_id=body.key_id)
    except CreditError as exc:
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None
    return json_response(rule, 201)


class Checkout(_Model):
    amount: StrictStr | StrictInt  # USD, whole cents

    def check_supported(self, passthrough: bool = False) -> None:
        return None


class Recharge(_Model):
    recharge_below: StrictStr | StrictInt | None = None
    recharge_amount: StrictStr | StrictInt | None = None

    def check_supported(self, passthrough: bool = False) -> None:
        return None


def _cents(value: Any, field: str) -> int:
    nanos = parse_usd(value, field)
    if nanos % NANOS_PER_CENT:
        raise CreditError(f"{field} must be whole cents", field)
    return nanos // NANOS_PER_CENT


def _checkout(request: Request) -> CheckoutService:
    service: CheckoutService | None = request.app.state.checkout
    if service is None:
        raise NotFound("Stripe is not configured on this server.")
    return service


async def create_checkout(request: Request) -> Response:
    state = request.app.state
    principal = await authenticate(request, state.keys)
    body = parse(Checkout, await read_json(request, state.settings.http.max_body_bytes))
    if not principal.prepaid:
        raise InvalidRequest("This account is postpaid (billed monthly); it has no prepaid balance to top up.", param="amount",
                             code="not_prepaid")
    base = str(request.base_url).rstrip("/")
    try:
        session = await _checkout(request).create_session(
            principal.account_id, _cents(body.amount, "amount"),
            success_url=f"{base}/dashboard/account?checkout=done", cancel_url=f"{base}/dashboard/account?checkout=cancelled")
    except CreditError as exc:
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None
    return json_response(session)


async def dashboard_checkout(request: Request) -> Response:
    """The customer dashboard's "Add credit" form: a Checkout Session, then Stripe's hosted page."""
    session = await session_or_none(request)
    if session is None:
        return to_login()
    form = await form_with_csrf(request, session)
    if form is None:
        return refused(request, session)
    checkout: CheckoutService | None = request.app.state.checkout
    balance = await _book(request).balance(session.principal.account_id)  # a session's principal does not carry the mode
    if checkout is None or balance is None or balance["billing_mode"] != "prepaid":
        return RedirectResponse("/dashboard/account?checkout=unavailable", status_code=303)
    base = str(request.base_url).rstrip("/")
    try:
        created = await checkout.create_session(
            session.principal.account_id, _cents(str(form.get("amount") or ""), "amount"),
            success_url=f"{base}/dashboard/account?checkout=done", cancel_url=f"{base}/dashboard/account?checkout=cancelled")
    except CreditError:
        return RedirectResponse("/dashboard/account?checkout=invalid", status_code=303)
    return RedirectResponse(created["url"], status_code=303)


async def admin_recharge(request: Request) -> Response:
    state = request.app.state
    await authenticate_admin(request, state.keys)
    account_id = _account_id(request)
    body = parse(Recharge, await read_json(request, state.settings.http.max_body_bytes))
    if await state.keys.get_account(account_id=account_id) is None:
        raise NotFound(f"No account with id {account_id}.", param="account_id")
    try:
        below = None if body.recharge_below is None else parse_usd(body.recharge_below, "recharge_below")
        amount = None if body.recharge_amount is None else _cents(body.recharge_amount, "recharge_amount")
        return json_response(await _checkout(request).set_recharge(account_id, below, amount))
    except CreditError as exc:
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None


async def housekeeping(book: CreditBook, db: Any, alerts: AlertService | None = None,
                       checkout: CheckoutService | None = None) -> dict[str, Any]:
    """Credit rows written elsewhere reach this limiter; expired grants go; prepaid usage is posted;
    due auto-recharges are charged; alerts are checked."""
    done: dict[str, Any] = {"object": "credit_housekeeping", "recharged": [], "alerts": []}
    await book.sync_recent()
    done["expired"] = len(await book.expire_grants())
    async with db.connect() as conn:
        prepaid = [int(a) for a in (await conn.execute(sa.select(ACCOUNTS.c.id).where(ACCOUNTS.c.billing_mode == "prepaid"))).scalars()]
    for account_id in prepaid:
        await book.post_usage(account_id)
    if checkout is not None:
        done["recharged"] = await checkout.recharge_due()
    if alerts is not None:
        done["alerts"] = await alerts.check()
    return done


async def admin_housekeeping(request: Request) -> Response:
    """Runs the periodic credit work now (operators, tests)."""
    state = request.app.state
    await authenticate_admin(request, state.keys)
    return json_response(await housekeeping(state.credits, state.db, state.alerts, state.checkout))


async def _loop(book: CreditBook, db: Any, alerts: AlertService, checkout: CheckoutService | None, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            await housekeeping(book, db, alerts, checkout)
        except Exception as exc:  # the database is down: the next round tries again
            log.warning("credit housekeeping failed: %s", type(exc).__name__)


async def start(app: Starlette) -> None:
    settings = app.state.settings
    every = settings.credits.check_seconds
    app.state.credits = CreditBook(app.state.db, app.state.limiter, settle_seconds=settings.credits.settle_seconds)
    app.state.alerts = AlertService(app.state.db, app.state.credits)
    billing = app.state.billing
    app.state.checkout = None
    if billing.config.stripe_enabled:
        from billing.stripe.sync import stripe_client

        app.state.checkout = CheckoutService(app.state.db, stripe_client(billing.config), app.state.credits)
        if billing.webhooks is not None:  # POST /webhooks/stripe credits top-ups and debits refunds
            billing.webhooks.extra.update(app.state.checkout.webhook_handlers())
            billing.webhooks.after.append(lambda _account: app.state.credits.sync_recent())
    app.state.credits_task = (
        asyncio.create_task(_loop(app.state.credits, app.state.db, app.state.alerts, app.state.checkout, every), name="credits")
        if every > 0 else None)


async def stop(app: Starlette) -> None:
    task = app.state.credits_task
    if task is not None:
        task.cancel()
    await app.state.alerts.close()


routes = [
    Route("/v1/billing/balance", my_balance, methods=["GET"]),
    Route("/admin/accounts/{account_id}/credits", admin_credits, methods=["GET"]),
    Route("/admin/accounts/{account_id}/credits", admin_add_credit, methods=["POST"]),
    Route("/admin/accounts/{account_id}/billing_mode", admin_billing_mode, methods=["PUT"]),
    Route("/v1/billing/checkout", create_checkout, methods=["POST"]),
    Route("/dashboard/checkout", dashboard_checkout, methods=["POST"]),
    Route("/v1/billing/statement", my_statement, methods=["GET"]),
    Route("/admin/accounts/{account_id}/statement", admin_statement, methods=["GET"]),
    Route("/v1/statements", my_statements, methods=["GET"]),
    Route("/v1/statements/{statement_id}", my_statement_document, methods=["GET"]),
    Route("/v1/statements/{statement_id}/{fmt:str}", my_statement_document, methods=["GET"]),
    Route("/admin/statements", admin_statements, methods=["GET"]),
    Route("/admin/statements/{statement_id}", admin_statement_document, methods=["GET"]),
    Route("/admin/statements/{statement_id}/{fmt:str}", admin_statement_document, methods=["GET"]),
    Route("/admin/credits/housekeeping", admin_housekeeping, methods=["POST"]),
    Route("/admin/accounts/{account_id}/recharge", admin_recharge, methods=["PUT"]),
    Route("/v1/billing/alerts", my_alerts, methods=["GET"]),
    Route("/admin/accounts/{account_id}/alerts", admin_alerts, methods=["GET"]),
    Route("/admin/accounts/{account_id}/alerts", admin_add_alert, methods=["POST"]),
]
