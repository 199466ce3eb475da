"""Invoices for the admin: the monthly close, Stripe sync, credit notes, the buyer's details, tax
rates, an account's billing state and its price overrides.

    GET  /admin/invoices                       ?account_id=&period=
    GET  /admin/invoices/{id}[/html|/pdf]
    POST /admin/invoices/close                 {"period": "2026-10", "wait": true}; pushes to Stripe after
                                               (TOLLGATE_STRIPE_SYNC_AFTER_CLOSE), as the CLI close does
    POST /admin/invoices/{id}/sync             push to Stripe
    POST /admin/invoices/{id}/chargeback_settled  {"dispute_id": "du_..."} | no body: every chargeback of it
    POST /admin/invoices/{id}/chargeback_refunded {"dispute_id": "du_..."} | no body: every refund due of it
    POST /admin/invoices/{id}/credit_notes     {"amount_cents": 120 | omitted: all that is left, "reason", "memo"}
    GET  /admin/credit_notes/{id}[/html|/pdf]
    GET  /admin/accounts/{id}/billing_details  PUT (all fields) / PATCH (some): the buyer on invoices
    GET  /admin/tax_rates                      PUT /admin/tax_rates/{country} {"rate": "19.000"}, DELETE
    GET  /admin/billing/periods/{period}       progress of a close
    GET  /admin/accounts/{id}/billing          billing state, unpaid invoices
    GET  /admin/accounts/{id}/prices           overrides and the prices in force now
    POST /admin/accounts/{id}/prices           add an override version
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response
from stripe import StripeError

from billing.invoices.account_state import account_standing
from billing.invoices.billing_details import InvalidBillingDetails, country_rates, delete_country_rate, get_details, set_country_rate, set_details
from billing.invoices.close import PeriodNotEnded, close_period, period_status
from billing.invoices.credit_notes import CreditNoteRefused, CreditRequest, get_credit_note, issue_credit_note
from billing.invoices.views import get_invoice, list_invoices
from billing.prices.book import InvalidPrice, PriceConflict
from billing.stripe.invoice_disputes import UnknownDispute, chargeback_refunded, chargeback_settled
from billing.stripe.sync import StripeSyncError, StripeTotalMismatch
from gateway.admin.accounts import Instant, StrictStr
from gateway.api.account.documents import billing_of, credit_note_response, document_format, invoice_response, period_param, query_id
from gateway.api.openai.protocol import StrictBool, StrictInt, _StrictModel, parse
from gateway.billing import StripeFailed
from gateway.http.errors import Conflict, InvalidRequest, NotFound
from gateway.http.json_response import json_response
from gateway.http.requests import path_id, read_json, read_optional_json


async def _account(request: Request) -> dict[str, Any]:
    account_id = path_id(request, "account_id", "account")
    account = await request.app.state.keys.get_account(account_id=account_id)
    if account is None:
        raise NotFound(f"No account with id {account_id}.", param="account_id")
    return account  # type: ignore[no-any-return]


async def admin_invoices(request: Request) -> Response:
    raw_period = request.query_params.get("period")
    period = str(period_param(raw_period)) if raw_period else None
    data = await list_invoices(billing_of(request).db, account_id=query_id(request, "account_id"), period=period)
    return json_response({"object": "list", "data": data})


async def admin_invoice(request: Request) -> Response:
    fmt = document_format(request)
    invoice = await get_invoice(billing_of(request).db, path_id(request, "invoice_id", "invoice"))
    if invoice is None:
        raise NotFound("No such invoice.", param="id")
    return invoice_response(invoice, fmt)


class CloseRequest(_StrictModel):
    period: str
    wait: StrictBool = True

    def check_supported(self, passthrough: bool = False) -> None:
        return None


async def admin_close(request: Request) -> Response:
    state = request.app.state
    body = parse(CloseRequest, await read_json(request, state.settings.http.max_body_bytes))
    period = period_param(body.period)
    billing = billing_of(request)
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
    period = period_param(request.path_params["period"])
    status = await period_status(billing_of(request).db, period)
    if status is None:
        raise NotFound(f"Period {period} has not been closed.", param="period")
    return json_response(status)


async def admin_sync(request: Request) -> Response:
    billing = billing_of(request)
    invoice_id = path_id(request, "invoice_id", "invoice")
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


class SettleChargeback(_StrictModel):
    dispute_id: StrictStr | None = Field(default=None, min_length=1, max_length=255)

    def check_supported(self, passthrough: bool = False) -> None:
        return None


async def _chargeback_action(request: Request, act: Any, refused: Any) -> Response:
    """One of the chargeback actions on an invoice, for one dispute ({"dispute_id": "du_..."}) or,
    without a body, every one of the invoice's: `act(db, invoice_id, now, dispute_id)` returns None
    (no such invoice), False (nothing to do: 409 `refused(dispute_id)` gives) or True; the invoice after."""
    billing = billing_of(request)
    invoice_id = path_id(request, "invoice_id", "invoice")
    raw = await read_optional_json(request, request.app.state.settings.http.max_body_bytes)
    dispute_id = parse(SettleChargeback, raw).dispute_id if raw is not None else None
    try:
        done = await act(billing, invoice_id, datetime.now(timezone.utc), dispute_id)
    except UnknownDispute:
        raise NotFound(f"Invoice {invoice_id} has no chargeback of dispute {dispute_id}.", param="dispute_id") from None
    if done is None:
        raise NotFound("No such invoice.", param="id")
    if not done:
        raise refused(dispute_id)
    return json_response(await get_invoice(billing.db, invoice_id))


async def admin_chargeback_settled(request: Request) -> Response:
    """A charged-back invoice paid again outside Stripe (a lost dispute): owed no more."""
    def act(billing: Any, invoice_id: int, now: datetime, dispute_id: str | None) -> Any:
        return chargeback_settled(billing.db, invoice_id, now=now, grace_seconds=billing.config.grace_seconds,
                                  overdue=billing.config.sends_for_payment, dispute_id=dispute_id)

    def refused(dispute_id: str | None) -> Conflict:
        what = f"The chargeback of dispute {dispute_id} is not owed" if dispute_id else "This invoice is not charged back"
        return Conflict(f"{what} (won, or settled already).", param="dispute_id" if dispute_id else "id", code="not_charged_back")

    return await _chargeback_action(request, act, refused)


async def admin_chargeback_refunded(request: Request) -> Response:
    """A chargeback paid twice (settled outside Stripe, then its dispute won) refunded to the customer
    (a Stripe refund, a credit note): its refund due is recorded made."""
    def act(billing: Any, invoice_id: int, now: datetime, dispute_id: str | None) -> Any:
        return chargeback_refunded(billing.db, invoice_id, now=now, dispute_id=dispute_id)

    def refused(dispute_id: str | None) -> Conflict:
        what = f"the chargeback of dispute {dispute_id}" if dispute_id else "this invoice"
        return Conflict(f"No refund is due for {what} (not settled and then won, or refunded already).",
                        param="dispute_id" if dispute_id else "id", code="no_refund_due")

    return await _chargeback_action(request, act, refused)


async def admin_account_billing(request: Request) -> Response:
    account = await _account(request)
    billing = billing_of(request)
    return json_response(await account_standing(billing.db, account["id"], grace_seconds=billing.config.grace_seconds))


async def admin_account_prices(request: Request) -> Response:
    account = await _account(request)
    book = billing_of(request).book
    overrides = await book.overrides(account["id"])
    now = datetime.now(timezone.utc)
    effective = [p.view() for m in book.models() if (p := book.price_for(account["id"], m, now)) is not None]
    effective += [
        p.view()
        for o in overrides
        if o.kind == "price" and o.model not in book.models() and (p := book.price_for(account["id"], o.model, now)) is not None
    ]
    return json_response({"object": "list", "account_id": account["id"], "data": [o.view() for o in overrides], "effective": effective})


class AddOverride(_StrictModel):
    model: str = Field(min_length=1, max_length=128)
    input_per_million: StrictStr | StrictInt | None = None  # strict: JSON true is no price
    output_per_million: StrictStr | StrictInt | None = None
    cached_input_per_million: StrictStr | StrictInt | None = None  # with a custom price only
    multiplier: StrictStr | StrictInt | None = None
    clear: StrictBool = False
    effective_from: Instant | None = None

    def check_supported(self, passthrough: bool = False) -> None:
        return None


async def admin_add_override(request: Request) -> Response:
    state = request.app.state
    account = await _account(request)
    body = parse(AddOverride, await read_json(request, state.settings.http.max_body_bytes))
    try:
        version = await billing_of(request).book.add_override(
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
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None
    return json_response(version.view(), 201)


def _details_error(exc: InvalidBillingDetails) -> InvalidRequest:
    return InvalidRequest(str(exc), param=exc.field, code="invalid_value")


async def admin_get_details(request: Request) -> Response:
    account = await _account(request)
    details = await get_details(billing_of(request).db, account["id"])
    if details is None:
        raise NotFound(f"Account {account['id']} has no billing details yet; PUT them.", param="account_id", code="no_billing_details")
    return json_response(details)


async def admin_set_details(request: Request) -> Response:
    state = request.app.state
    account = await _account(request)
    body = await read_json(request, state.settings.http.max_body_bytes)
    try:
        details = await set_details(billing_of(request).db, account["id"], body, replace=request.method == "PUT")
    except InvalidBillingDetails as exc:
        raise _details_error(exc) from None
    return json_response(details)


async def admin_tax_rates(request: Request) -> Response:
    return json_response({"object": "list", "data": await country_rates(billing_of(request).db)})


async def admin_set_tax_rate(request: Request) -> Response:
    state = request.app.state
    body = await read_json(request, state.settings.http.max_body_bytes)
    if not isinstance(body, dict) or set(body) != {"rate"}:
        raise InvalidRequest('the body must be {"rate": "19.000"} (percent)', param="rate")
    try:
        return json_response(await set_country_rate(billing_of(request).db, request.path_params["country"], body["rate"]))
    except InvalidBillingDetails as exc:
        raise _details_error(exc) from None


async def admin_delete_tax_rate(request: Request) -> Response:
    try:
        deleted = await delete_country_rate(billing_of(request).db, request.path_params["country"])
    except InvalidBillingDetails as exc:
        raise _details_error(exc) from None
    if not deleted:
        raise NotFound("No tax rate for that country.", param="country")
    return json_response({"object": "tax_rate", "country": request.path_params["country"].upper(), "deleted": True})


class CreditNoteBody(_StrictModel):
    amount_cents: StrictInt | None = None
    reason: str | None = None
    memo: str | None = Field(default=None, max_length=500)

    def check_supported(self, passthrough: bool = False) -> None:
        return None


async def admin_credit_note(request: Request) -> Response:
    state = request.app.state
    billing = billing_of(request)
    invoice_id = path_id(request, "invoice_id", "invoice")
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


async def admin_get_credit_note(request: Request) -> Response:
    fmt = document_format(request)
    note = await get_credit_note(billing_of(request).db, path_id(request, "note_id", "credit note"))
    if note is None:
        raise NotFound("No such credit note.", param="id")
    return credit_note_response(note, fmt)


ENDPOINTS = [
    ("/admin/invoices", admin_invoices, ["GET"]),
    ("/admin/invoices/close", admin_close, ["POST"]),
    ("/admin/invoices/{invoice_id}", admin_invoice, ["GET"]),
    ("/admin/invoices/{invoice_id}/sync", admin_sync, ["POST"]),
    ("/admin/invoices/{invoice_id}/chargeback_settled", admin_chargeback_settled, ["POST"]),
    ("/admin/invoices/{invoice_id}/chargeback_refunded", admin_chargeback_refunded, ["POST"]),
    ("/admin/invoices/{invoice_id}/{fmt:str}", admin_invoice, ["GET"]),
    ("/admin/billing/periods/{period}", admin_period, ["GET"]),
    ("/admin/accounts/{account_id}/billing", admin_account_billing, ["GET"]),
    ("/admin/accounts/{account_id}/prices", admin_account_prices, ["GET"]),
    ("/admin/accounts/{account_id}/prices", admin_add_override, ["POST"]),
    ("/admin/invoices/{invoice_id}/credit_notes", admin_credit_note, ["POST"]),
    ("/admin/credit_notes/{note_id}", admin_get_credit_note, ["GET"]),
    ("/admin/credit_notes/{note_id}/{fmt:str}", admin_get_credit_note, ["GET"]),
    ("/admin/accounts/{account_id}/billing_details", admin_get_details, ["GET"]),
    ("/admin/accounts/{account_id}/billing_details", admin_set_details, ["PUT", "PATCH"]),
    ("/admin/tax_rates", admin_tax_rates, ["GET"]),
    ("/admin/tax_rates/{country}", admin_set_tax_rate, ["PUT"]),
    ("/admin/tax_rates/{country}", admin_delete_tax_rate, ["DELETE"]),
]
