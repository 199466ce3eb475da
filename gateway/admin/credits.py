"""Prepaid credit for the admin: an account's credit ledger and billing mode, its statements,
its auto-recharge, and the periodic credit work run now.

    GET  /admin/accounts/{id}/credits             balance and the latest credit-ledger rows
    POST /admin/accounts/{id}/credits             {"kind": topup|grant|refund|adjustment, "amount": "10.00",
                                                   "reason": ..., "expires_at": ...}  (the admin key is recorded)
    PUT  /admin/accounts/{id}/billing_mode        {"billing_mode": "prepaid" | "postpaid"}
    GET  /admin/accounts/{id}/statement?period=   a prepaid month, as the customer's /v1/billing/statement
    GET  /admin/statements                        ?account_id=&period=
    GET  /admin/statements/{id}[/html|/pdf]
    POST /admin/credits/housekeeping              billing/credits/housekeeping.py now
    PUT  /admin/accounts/{id}/recharge            {"recharge_below": "5.00", "recharge_amount": "20.00"} (or nulls: off)
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from billing.credits.balance import CreditError, parse_usd
from billing.credits.housekeeping import housekeeping
from billing.invoices.periods import InvalidPeriod, Period
from billing.invoices.statements import get_statement, list_statements
from billing.quota import Scope
from billing.stripe.checkout import CheckoutService
from gateway.admin.accounts import Instant, StrictStr
from gateway.admin.guard import admin_principal
from gateway.api.account.credits import cents, checkout_service, credit_book, statement_for, statement_id, statement_response
from gateway.api.openai.protocol import StrictInt, _StrictModel, parse
from gateway.http.errors import Conflict, InvalidRequest, NotFound
from gateway.http.json_response import json_response
from gateway.http.requests import id_value, path_id, read_json


class AddCredit(_StrictModel):
    kind: str = Field(min_length=1, max_length=16)
    amount: StrictStr | StrictInt  # USD; a refund may be given positive (it is debited)
    reason: str | None = Field(default=None, max_length=2000)
    expires_at: Instant | None = None

    def check_supported(self, passthrough: bool = False) -> None:
        return None


class BillingMode(_StrictModel):
    billing_mode: str = Field(min_length=1, max_length=16)

    def check_supported(self, passthrough: bool = False) -> None:
        return None


def account_id_param(request: Request) -> int:
    return path_id(request, "account_id", "account", param="account_id")


async def admin_statement(request: Request) -> Response:
    return await statement_for(request, account_id_param(request))


async def admin_statements(request: Request) -> Response:
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
    return statement_response(await get_statement(request.app.state.db, statement_id(request)), request)


async def admin_credits(request: Request) -> Response:
    account_id = account_id_param(request)
    balance = await credit_book(request).balance(account_id)
    if balance is None:
        raise NotFound(f"No account with id {account_id}.", param="account_id")
    checkout: CheckoutService | None = request.app.state.checkout
    recharge = await checkout.settings(account_id) if checkout is not None else None
    return json_response({**balance, "recharge": recharge, "entries": await credit_book(request).entries(account_id)})


async def admin_add_credit(request: Request) -> Response:
    state = request.app.state
    principal = admin_principal(request)
    account_id = account_id_param(request)
    body = parse(AddCredit, await read_json(request, state.settings.http.max_body_bytes))
    external_id = idempotency_id(request)
    book = credit_book(request)
    try:
        nanos = parse_usd(body.amount, "amount", signed=body.kind == "adjustment")
        if body.kind == "refund":
            nanos = -abs(nanos)
        row = await book.add(account_id, body.kind, nanos, reason=body.reason, admin_key_id=principal.key_id,
                             expires_at=body.expires_at, external_id=external_id)
    except CreditError as exc:
        if exc.param == "account_id":
            raise NotFound(str(exc), param="account_id") from None
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None
    if row is None:  # a retry of a credit made already under this key: that one, made once
        assert external_id is not None
        made = await book.entry_by_external_id(external_id)
        if (made is None or (made["account_id"], made["kind"], made["amount_nanos"], made["reason"]) != (account_id, body.kind, nanos, body.reason)
                or not _same_instant(made["expires_at"], body.expires_at)):
            raise Conflict("This Idempotency-Key was used for another credit.", param="Idempotency-Key", code="idempotency_key_reused")
        return json_response(made, 200, headers={"Idempotent-Replayed": "true"})
    return json_response(row, 201)


def _same_instant(stored: str | None, asked: datetime | None) -> bool:
    """Whether a stored credit's expiry (ISO 8601) is the one a request gives."""
    return stored is None if asked is None else stored is not None and datetime.fromisoformat(stored) == asked


def idempotency_id(request: Request) -> str | None:
    """The credit's external_id from the request's Idempotency-Key (a retried POST makes it once)."""
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not 1 <= len(key) <= 200 or not key.isprintable() or not key.isascii():
        raise InvalidRequest("Idempotency-Key must be 1 to 200 printable ASCII characters.", param="Idempotency-Key",
                             code="invalid_value")
    return f"idempotency:{key}"


async def admin_billing_mode(request: Request) -> Response:
    state = request.app.state
    account_id = account_id_param(request)
    body = parse(BillingMode, await read_json(request, state.settings.http.max_body_bytes))
    try:
        result = await credit_book(request).set_mode(account_id, body.billing_mode)
    except CreditError as exc:
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None
    if result is None:
        raise NotFound(f"No account with id {account_id}.", param="account_id")
    state.keys.invalidate()  # the next request of its keys sees the new mode
    await state.limiter.invalidate(Scope("account", account_id, None))  # type: ignore[arg-type]
    return json_response(result)


class Recharge(_StrictModel):
    recharge_below: StrictStr | StrictInt | None = None
    recharge_amount: StrictStr | StrictInt | None = None

    def check_supported(self, passthrough: bool = False) -> None:
        return None


async def admin_recharge(request: Request) -> Response:
    state = request.app.state
    account_id = account_id_param(request)
    body = parse(Recharge, await read_json(request, state.settings.http.max_body_bytes))
    if await state.keys.get_account(account_id=account_id) is None:
        raise NotFound(f"No account with id {account_id}.", param="account_id")
    try:
        below = None if body.recharge_below is None else parse_usd(body.recharge_below, "recharge_below")
        amount = None if body.recharge_amount is None else cents(body.recharge_amount, "recharge_amount")
        return json_response(await checkout_service(request).set_recharge(account_id, below, amount))
    except CreditError as exc:
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None


async def admin_housekeeping(request: Request) -> Response:
    """Runs the periodic credit work now (operators, tests)."""
    state = request.app.state
    return json_response(await housekeeping(state.credits, state.db, state.alerts, state.checkout))


ENDPOINTS = [
    ("/admin/accounts/{account_id}/credits", admin_credits, ["GET"]),
    ("/admin/accounts/{account_id}/credits", admin_add_credit, ["POST"]),
    ("/admin/accounts/{account_id}/billing_mode", admin_billing_mode, ["PUT"]),
    ("/admin/accounts/{account_id}/statement", admin_statement, ["GET"]),
    ("/admin/statements", admin_statements, ["GET"]),
    ("/admin/statements/{statement_id}", admin_statement_document, ["GET"]),
    ("/admin/statements/{statement_id}/{fmt:str}", admin_statement_document, ["GET"]),
    ("/admin/credits/housekeeping", admin_housekeeping, ["POST"]),
    ("/admin/accounts/{account_id}/recharge", admin_recharge, ["PUT"]),
]
