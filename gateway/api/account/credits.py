"""A customer's own prepaid credit (billing/credits/ holds the rules).

    GET  /v1/billing/balance                      the caller's account: balance, grants, billing mode
    GET  /v1/billing/statement?period=YYYY-MM     a prepaid month: opening balance, top-ups, usage, closing (no amount due)
    GET  /v1/statements                           the caller's monthly statements (made by the monthly close)
    GET  /v1/statements/{id}[/html|/pdf]          one of them (the account's own only)
    POST /v1/billing/checkout                     {"amount": "10.00"}: a Stripe Checkout Session to top up (its url)
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from billing.credits.balance import CreditBook, CreditError, parse_usd
from billing.invoices.periods import InvalidPeriod, Period
from billing.invoices.render import render_statement_html, render_statement_pdf
from billing.invoices.statements import get_statement, list_statements
from billing.models import utcnow
from billing.stripe.checkout import CheckoutService, NANOS_PER_CENT
from stripe import StripeError
from gateway.admin.accounts import StrictStr
from gateway.api.account.documents import document_response
from gateway.api.openai.protocol import StrictInt, _Model, parse
from gateway.billing import StripeFailed
from gateway.http.errors import InvalidRequest, NotFound
from gateway.http.json_response import json_response
from gateway.http.requests import authenticate, path_id, public_origin, read_json

log = logging.getLogger("tollgate.billing")


def credit_book(request: Request) -> CreditBook:
    book: CreditBook = request.app.state.credits
    return book


async def my_balance(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    balance = await credit_book(request).balance(principal.account_id)
    checkout: CheckoutService | None = request.app.state.checkout
    if checkout is not None and balance is not None:  # a declined auto-recharge is the customer's to see
        recharge = await checkout.settings(principal.account_id)
        balance["recharge"] = {k: recharge.get(k) for k in ("recharge_below_nanos", "recharge_amount_cents", "recharge_state", "recharge_error")}
    return json_response(balance)


async def statement_for(request: Request, account_id: int) -> Response:
    try:
        period = Period.parse(request.query_params.get("period") or str(Period.containing(utcnow())))
    except InvalidPeriod as exc:
        raise InvalidRequest(str(exc), param="period", code="invalid_value") from None
    statement = await credit_book(request).statement(account_id, period.start, period.end)
    if statement is None:
        raise InvalidRequest("This account is postpaid: its months are invoices (/v1/invoices).", param="period", code="not_prepaid")
    return json_response({**statement, "period": str(period)})


async def my_statement(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    return await statement_for(request, principal.account_id)


def statement_response(doc: dict[str, Any] | None, request: Request) -> Response:
    fmt = request.path_params.get("fmt", "json")
    if fmt not in ("json", "html", "pdf"):
        raise NotFound(f"Unknown path {request.url.path}: statements come as /html or /pdf.")
    if doc is None:
        raise NotFound("No such statement.", param="id")
    return document_response(doc, fmt, render_statement_html, render_statement_pdf)


def statement_id(request: Request) -> int:
    return path_id(request, "statement_id", "statement")


async def my_statements(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    return json_response({"object": "list", "data": await list_statements(request.app.state.db, account_id=principal.account_id)})


async def my_statement_document(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    doc = await get_statement(request.app.state.db, statement_id(request), account_id=principal.account_id)
    return statement_response(doc, request)


class Checkout(_Model):
    amount: StrictStr | StrictInt  # USD, whole cents

    def check_supported(self, passthrough: bool = False) -> None:
        return None


def cents(value: Any, field: str) -> int:
    nanos = parse_usd(value, field)
    if nanos % NANOS_PER_CENT:
        raise CreditError(f"{field} must be whole cents", field)
    return nanos // NANOS_PER_CENT


def checkout_service(request: Request) -> CheckoutService:
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
    base = public_origin(request)  # TOLLGATE_PUBLIC_URL behind a proxy, never a Host the proxy passed on
    try:
        session = await checkout_service(request).create_session(
            principal.account_id, cents(body.amount, "amount"),
            success_url=f"{base}/dashboard/account?checkout=done", cancel_url=f"{base}/dashboard/account?checkout=cancelled")
    except CreditError as exc:
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None
    except StripeError as exc:  # Stripe refused or could not be reached: nothing was charged
        log.error("Checkout Session for account %s failed: %s", principal.account_id, type(exc).__name__)
        raise StripeFailed("Stripe could not start the payment; retry shortly.", headers={"Retry-After": "5"}) from None
    return json_response(session)


routes = [
    Route("/v1/billing/balance", my_balance, methods=["GET"]),
    Route("/v1/billing/checkout", create_checkout, methods=["POST"]),
    Route("/v1/billing/statement", my_statement, methods=["GET"]),
    Route("/v1/statements", my_statements, methods=["GET"]),
    Route("/v1/statements/{statement_id}", my_statement_document, methods=["GET"]),
    Route("/v1/statements/{statement_id}/{fmt:str}", my_statement_document, methods=["GET"]),
]
