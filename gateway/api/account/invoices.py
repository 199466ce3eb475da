"""Billing routes: invoices (admin and the customer's own), price overrides per account, the
monthly close, Stripe sync and webhooks. `start(app)` builds `app.state.billing` in the lifespan.

    GET  /v1/invoices                          the caller's invoices (JSON)
    GET  /v1/invoices/{id}[/html|/pdf]         one of them
    GET  /admin/invoices                       ?account_id=&period=
    GET  /admin/invoices/{id}[/html|/pdf]
    POST /admin/invoices/close                 {"period": "2026-10", "wait": true}; pushes to Stripe after
                                               (TOLLGATE_STRIPE_SYNC_AFTER_CLOSE), as the CLI close does
    POST /admin/invoices/{id}/sync             push to Stripe
    POST /admin/invoices/{id}/credit_notes     {"amount_cents": 120 | omitted: all that is left, "reason", "memo"}
    GET  /admin/credit_notes/{id}[/html|/pdf]  (and /v1/credit_notes/{id}[...] for the account's own)
    GET  /admin/accounts/{id}/billing_details  PUT (all fields) / PATCH (some): the buyer on invoices
    GET  /admin/tax_rates                      PUT /admin/tax_rates/{country} {"rate": "19.000"}, DELETE
    GET  /admin/billing/periods/{period}       progress of a close
    GET  /admin/accounts/{id}/billing          billing state, unpaid invoices
    GET  /admin/accounts/{id}/prices           overrides and the prices in force now
    POST /admin/accounts/{id}/prices           add an override version
    POST /webhooks/stripe                      Stripe events (signature checked on the raw body)
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone
from collections.abc import Callable
from typing import Any

from pydantic import Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from stripe import StripeError

from billing.invoices.account_state import AccountStates, account_standing
from billing.invoices.billing_details import InvalidBillingDetails, country_rates, delete_country_rate, get_details, set_country_rate, set_details
from billing.invoices.credit_notes import CreditNoteRefused, CreditRequest, get_credit_note, issue_credit_note
from billing.config import BillingConfig
from billing.invoices.views import get_invoice, list_invoices
from billing.invoices.close import CloseResult, PeriodNotEnded, close_period, period_status
from billing.keys.store import Principal
from billing.invoices.periods import InvalidPeriod, Period
from billing.prices.book import InvalidPrice, PriceBook, PriceConflict
from billing.invoices.render import render_credit_note_html, render_credit_note_pdf, render_html, render_pdf
from billing.invoices.scheduler import MonthlyClose
from billing.stripe.sync import StripeSync, StripeSyncError, StripeTotalMismatch, stripe_client
from billing.stripe.webhooks import WebhookHandler, WebhookRejected
from gateway.http.errors import APIError, Conflict, InvalidRequest, NotFound, PayloadTooLarge, PermissionDenied
from gateway.http.requests import MAX_ID, authenticate, authenticate_admin, path_id, read_json
from gateway.admin.accounts import StrictStr
from gateway.api.openai.protocol import StrictInt, _Model, parse
from gateway.http.json_response import json_response

log = logging.getLogger("tollgate.billing")


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
            WebhookHandler(db, client, config.stripe_webhook_secret, grace_seconds=config.grace_seconds, on_change=self._changed)
            if client is not None and config.stripe_webhook_secret
            else None
        )
        self.scheduler = MonthlyClose(db, book, config, stripe=self.stripe) if config.auto_close else None
        self._runs: dict[str, asyncio.Task[CloseResult | None]] = {}

    def guard(self, principal: Principal) -> None:
        """The request-path check: 403 for keys of a suspended account. No I/O."""
        reason = self.states.suspension(principal)
        if reason is not None:
            raise PermissionDenied(reason, code="account_suspended")

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


# helpers ----------------------------------------------------------------------------------------


def _billing(request: Request) -> Billing:
    return request.app.state.billing  # type: ignore[no-any-return]


_id = path_id


def _period(raw: Any, param: str = "period") -> Period:
    try:
        return Period.parse(raw)
    except InvalidPeriod as exc:
        raise InvalidRequest(str(exc), param=param, code="invalid_value") from None


def _query_int(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return None
    try:
        value = int(raw)  # type: ignore[arg-type]
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer", param=name) from None
    if value < 1 or value > MAX_ID:
        raise InvalidRequest(f"{name} must be between 1 and {MAX_ID}", param=name)
    return value


def _format(request: Request) -> str:
    fmt = request.path_params.get("fmt", "json")
    if fmt not in ("json", "html", "pdf"):
        raise NotFound(f"Unknown path {request.url.path}: invoices come as /html or /pdf.")
    return str(fmt)


def document_response(doc: dict[str, Any], fmt: str, html: Callable[[dict[str, Any]], str], pdf: Callable[[dict[str, Any]], bytes]) -> Response:
    """A billing document (invoice, credit note, statement) as JSON, HTML or a PDF download."""
    if fmt == "html":
        return Response(html(doc), media_type="text/html; charset=utf-8")
    if fmt == "pdf":
        headers = {"Content-Disposition": f'attachment; filename="{doc["number"]}.pdf"'}
        return Response(pdf(doc), media_type="application/pdf", headers=headers)
    return json_response(doc)


def _invoice_response(invoice: dict[str, Any], fmt: str) -> Response:
    return document_response(invoice, fmt, render_html, render_pdf)


async def _account(request: Request) -> dict[str, Any]:
    account_id = _id(request, "account_id", "account")
    account = await request.app.state.keys.get_account(account_id=account_id)
    if account is None:
        raise NotFound(f"No account with id {account_id}.", param="account_id")
    return account  # type: ignore[no-any-return]


# customer routes --------------------------------------------------------------------------------
async def my_invoices(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    data = await list_invoices(_billing(request).db, account_id=principal.account_id, admin=False)
    return json_response({"object": "list", "data": data})


async def my_invoice(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    fmt = _format(request)
    invoice = await get_invoice(
        _billing(request).db, _id(request, "invoice_id", "invoice"), account_id=principal.account_id, admin=False
    )
    if invoice is None:
        raise NotFound("No such invoice.", param="id")
    return _invoice_response(invoice, fmt)


# admin routes -----------------------------------------------------------------------------------
async def admin_invoices(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    raw_period = request.query_params.get("period")
    period = str(_period(raw_period)) if raw_period else None
    data = await list_invoices(_billing(request).db, account_id=_query_int(request, "account_id"), period=period)
    return json_response({"object": "list", "data": data})


async def admin_invoice(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    fmt = _format(request)
    invoice = await get_invoice(_billing(request).db, _id(request, "invoice_id", "invoice"))
    if invoice is None:
        raise NotFound("No such invoice.", param="id")
    return _invoice_response(invoice, fmt)


class CloseRequest(_Model):
    period: str
    wait: bool = True

    def check_supported(self, passthrough: bool = False) -> None:
        return None


async def admin_close(request: Request) -> Response:
    state = request.app.state
    await authenticate_admin(request, state.keys)
    body = parse(CloseRequest, await read_json(request, state.settings.http.max_body_bytes))
    period = _period(body.period)
    billing = _billing(request)
    if period.end > datetime.now(timezone.utc):
        raise InvalidRequest(f"period {period} has not ended yet", param="period", code="period_not_ended")
    if not body.wait:
        billing.close_in_background(period)
        status = await period_status(billing.db, period)
        return json_response(status or {"object": "billing_period", "period": str(period), "status": "queued"}, 202)
    try:
        result = await close_period(billing.db, billing.book, period, lookback_months=billing.config.lookback_months, config=billing.config)
    except PeriodNotEnded as exc:
        raise InvalidRequest(str(exc), param="period", code="period_not_ended") from None
    payload = result.view()
    synced = await billing.push_after_close()  # errors are recorded per invoice and listed here
    if synced is not None:
        payload["stripe"] = synced
    return json_response(payload)


async def admin_period(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    period = _period(request.path_params["period"])
    status = await period_status(_billing(request).db, period)
    if status is None:
        raise NotFound(f"Period {period} has not been closed.", param="period")
    return json_response(status)


async def admin_sync(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    billing = _billing(request)
    invoice_id = _id(request, "invoice_id", "invoice")
    if await get_invoice(billing.db, invoice_id) is None:
        raise NotFound("No such invoice.", param="id")
    if billing.stripe is None:
        raise InvalidRequest("Stripe is not configured (TOLLGATE_STRIPE_API_KEY).", code="stripe_not_configured")
    try:
        result = await billing.stripe.push(invoice_id)
    except StripeTotalMismatch as exc:
        raise StripeFailed(str(exc), code="stripe_total_mismatch") from None
    except (StripeError, StripeSyncError) as exc:
        raise StripeFailed(f"Stripe sync failed: {exc}") from None
    return json_response(result)


async def admin_account_billing(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    account = await _account(request)
    billing = _billing(request)
    return json_response(await account_standing(billing.db, account["id"], grace_seconds=billing.config.grace_seconds))


async def admin_account_prices(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    account = await _account(request)
    book = _billing(request).book
    overrides = await book.overrides(account["id"])
    now = datetime.now(timezone.utc)
    effective = [p.view() for m in book.models() if (p := book.price_for(account["id"], m, now)) is not None]
    effective += [
        p.view()
        for o in overrides
        if o.kind == "price" and o.model not in book.models() and (p := book.price_for(account["id"], o.model, now)) is not None
    ]
    return json_response({"object": "list", "account_id": account["id"], "data": [o.view() for o in overrides], "effective": effective})


class AddOverride(_Model):
    model: str = Field(min_length=1, max_length=128)
    input_per_million: StrictStr | StrictInt | None = None  # strict: JSON true is no price
    output_per_million: StrictStr | StrictInt | None = None
    cached_input_per_million: StrictStr | StrictInt | None = None  # with a custom price only
    multiplier: StrictStr | StrictInt | None = None
    clear: bool = False
    effective_from: datetime | None = None

    def check_supported(self, passthrough: bool = False) -> None:
        if self.effective_from is not None and self.effective_from.tzinfo is None:
            self.effective_from = self.effective_from.replace(tzinfo=timezone.utc)


async def admin_add_override(request: Request) -> Response:
    state = request.app.state
    await authenticate_admin(request, state.keys)
    account = await _account(request)
    body = parse(AddOverride, await read_json(request, state.settings.http.max_body_bytes))
    try:
        version = await _billing(request).book.add_override(
            account["id"],
            body.model,
            input_per_million=body.input_per_million,
            output_per_million=body.output_per_million,
            multiplier=body.multiplier,
            clear=body.clear,
            effective_from=body.effective_from,
            cached_input_per_million=body.cached_input_per_million,
        )
    except PriceConflict as exc:
        raise Conflict(str(exc), param="effective_from") from None
    except InvalidPrice as exc:
        raise InvalidRequest(str(exc), code="invalid_value") from None
    return json_response(version.view(), 201)


# billing details, tax rates, credit notes ----------------------------------------------------------
def _details_error(exc: InvalidBillingDetails) -> InvalidRequest:
    return InvalidRequest(str(exc), param=exc.field, code="invalid_value")


async def admin_get_details(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    account = await _account(request)
    details = await get_details(_billing(request).db, account["id"])
    if details is None:
        raise NotFound(f"Account {account['id']} has no billing details yet; PUT them.", param="account_id", code="no_billing_details")
    return json_response(details)


async def admin_set_details(request: Request) -> Response:
    state = request.app.state
    await authenticate_admin(request, state.keys)
    account = await _account(request)
    body = await read_json(request, state.settings.http.max_body_bytes)
    try:
        details = await set_details(_billing(request).db, account["id"], body, replace=request.method == "PUT")
    except InvalidBillingDetails as exc:
        raise _details_error(exc) from None
    return json_response(details)


async def admin_tax_rates(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    return json_response({"object": "list", "data": await country_rates(_billing(request).db)})


async def admin_set_tax_rate(request: Request) -> Response:
    state = request.app.state
    await authenticate_admin(request, state.keys)
    body = await read_json(request, state.settings.http.max_body_bytes)
    if not isinstance(body, dict) or set(body) != {"rate"}:
        raise InvalidRequest('the body must be {"rate": "19.000"} (percent)', param="rate")
    try:
        return json_response(await set_country_rate(_billing(request).db, request.path_params["country"], body["rate"]))
    except InvalidBillingDetails as exc:
        raise _details_error(exc) from None


async def admin_delete_tax_rate(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    try:
        deleted = await delete_country_rate(_billing(request).db, request.path_params["country"])
    except InvalidBillingDetails as exc:
        raise _details_error(exc) from None
    if not deleted:
        raise NotFound("No tax rate for that country.", param="country")
    return json_response({"object": "tax_rate", "country": request.path_params["country"].upper(), "deleted": True})


class CreditNoteBody(_Model):
    amount_cents: StrictInt | None = None
    reason: str | None = None
    memo: str | None = Field(default=None, max_length=500)

    def check_supported(self, passthrough: bool = False) -> None:
        return None


async def admin_credit_note(request: Request) -> Response:
    state = request.app.state
    await authenticate_admin(request, state.keys)
    billing = _billing(request)
    invoice_id = _id(request, "invoice_id", "invoice")
    body = parse(CreditNoteBody, await read_json(request, state.settings.http.max_body_bytes))
    try:
        note = await issue_credit_note(billing.db, invoice_id, CreditRequest(body.amount_cents, body.reason, body.memo), billing.config)
    except CreditNoteRefused as exc:
        if exc.code == "not_found":
            raise NotFound(str(exc), param="id") from None
        raise InvalidRequest(str(exc), param=exc.param, code=exc.code) from None
    if billing.stripe is not None:
        try:
            note["stripe"] = await billing.stripe.push_credit_note(note["id"])
        except StripeError as exc:  # the note stands; a later sync retries
            note["stripe"] = {"result": f"error: {exc.user_message or exc}"}
    return json_response(note, 201)


def _credit_note_response(note: dict[str, Any], fmt: str) -> Response:
    return document_response(note, fmt, render_credit_note_html, render_credit_note_pdf)


async def admin_get_credit_note(request: Request) -> Response:
    await authenticate_admin(request, request.app.state.keys)
    fmt = _format(request)
    note = await get_credit_note(_billing(request).db, _id(request, "note_id", "credit note"))
    if note is None:
        raise NotFound("No such credit note.", param="id")
    return _credit_note_response(note, fmt)


async def my_credit_note(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    fmt = _format(request)
    note = await get_credit_note(_billing(request).db, _id(request, "note_id", "credit note"), account_id=principal.account_id)
    if note is None:
        raise NotFound("No such credit note.", param="id")
    return _credit_note_response(note, fmt)


# webhooks ---------------------------------------------------------------------------------------
async def _raw_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


async def stripe_webhook(request: Request) -> Response:
    billing = _billing(request)
    if billing.webhooks is None:
        raise NotFound("Stripe webhooks are not configured on this server.")
    payload = await _raw_body(request, request.app.state.settings.http.max_body_bytes)  # the signature covers these bytes
    try:
        result = await billing.webhooks.handle(payload, request.headers.get("stripe-signature"))
    except WebhookRejected as exc:
        raise InvalidRequest(str(exc), code="invalid_signature") from None
    except StripeError as exc:  # could not re-read the object: Stripe delivers again later
        log.error("webhook: Stripe re-read failed: %s", exc)
        raise StripeFailed("Could not read the object from Stripe; retry later.") from None
    return json_response(result)


routes = [
    Route("/v1/invoices", my_invoices, methods=["GET"]),
    Route("/v1/invoices/{invoice_id}", my_invoice, methods=["GET"]),
    Route("/v1/invoices/{invoice_id}/{fmt:str}", my_invoice, methods=["GET"]),
    Route("/admin/invoices", admin_invoices, methods=["GET"]),
    Route("/admin/invoices/close", admin_close, methods=["POST"]),
    Route("/admin/invoices/{invoice_id}", admin_invoice, methods=["GET"]),
    Route("/admin/invoices/{invoice_id}/sync", admin_sync, methods=["POST"]),
    Route("/admin/invoices/{invoice_id}/{fmt:str}", admin_invoice, methods=["GET"]),
    Route("/admin/billing/periods/{period}", admin_period, methods=["GET"]),
    Route("/admin/accounts/{account_id}/billing", admin_account_billing, methods=["GET"]),
    Route("/admin/accounts/{account_id}/prices", admin_account_prices, methods=["GET"]),
    Route("/admin/accounts/{account_id}/prices", admin_add_override, methods=["POST"]),
    Route("/admin/invoices/{invoice_id}/credit_notes", admin_credit_note, methods=["POST"]),
    Route("/admin/credit_notes/{note_id}", admin_get_credit_note, methods=["GET"]),
    Route("/admin/credit_notes/{note_id}/{fmt:str}", admin_get_credit_note, methods=["GET"]),
    Route("/v1/credit_notes/{note_id}", my_credit_note, methods=["GET"]),
    Route("/v1/credit_notes/{note_id}/{fmt:str}", my_credit_note, methods=["GET"]),
    Route("/admin/accounts/{account_id}/billing_details", admin_get_details, methods=["GET"]),
    Route("/admin/accounts/{account_id}/billing_details", admin_set_details, methods=["PUT", "PATCH"]),
    Route("/admin/tax_rates", admin_tax_rates, methods=["GET"]),
    Route("/admin/tax_rates/{country}", admin_set_tax_rate, methods=["PUT"]),
    Route("/admin/tax_rates/{country}", admin_delete_tax_rate, methods=["DELETE"]),
    Route("/webhooks/stripe", stripe_webhook, methods=["POST"]),
]
