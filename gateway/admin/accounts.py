"""Admin API under /admin/: accounts, keys, prices, usage. Every route needs an admin key (the one
check, gateway/admin/guard.py, in front of each route of gateway/admin/routes.py); customer keys get 403."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import AfterValidator, Field
from starlette.requests import Request
from starlette.responses import Response

from billing.keys.store import AccountExists, PastExpiry, UnknownAccount
from billing.ledger.writer import usage_rows, usage_totals
from billing.quota.limits import InvalidLimits, Limits
from billing.prices.book import InvalidPrice
from billing.quota import Scope
from billing.models import given_instant
from gateway.api.account.usage import parse_time
from gateway.http.errors import Conflict, InvalidRequest, NotFound
from gateway.http.requests import MAX_ID, path_id, read_json
from gateway.api.openai.protocol import StrictInt, _StrictModel, parse
from gateway.http.json_response import json_response

StrictStr = Annotated[str, Field(strict=True)]


# A time of the admin API: in UTC (SQLite keeps a time's clock reading and drops its offset), within
# what the database and datetime both hold.
Instant = Annotated[datetime, AfterValidator(given_instant)]




class CreateAccount(_StrictModel):
    name: str = Field(min_length=1, max_length=200)

    def check_supported(self) -> None:
        if self.name.strip() != self.name:
            raise InvalidRequest("name must not start or end with whitespace", param="name")


class CreateKey(_StrictModel):
    account_id: int = Field(strict=True, ge=1, le=MAX_ID)
    name: str | None = Field(default=None, max_length=200)
    models: list[str] | None = None
    expires_at: Instant | None = None

    def check_supported(self) -> None:
        return None


class PatchLimits(_StrictModel):
    limits: dict[str, Any]

    def check_supported(self) -> None:
        return None


class PatchAccount(_StrictModel):
    limits: dict[str, Any] | None = None
    priority: str | None = Field(default=None, max_length=32)  # the scheduling class; null: the top class

    def check_supported(self) -> None:
        if not self.model_fields_set & {"limits", "priority"}:
            raise InvalidRequest("give limits, priority or both", param="limits")
        if "limits" in self.model_fields_set and self.limits is None:
            raise InvalidRequest("limits must be an object", param="limits", code="invalid_value")


class AddPrice(_StrictModel):
    model: str = Field(min_length=1, max_length=128)
    input_per_million: StrictStr | StrictInt  # strict: JSON true is no price
    output_per_million: StrictStr | StrictInt
    cached_input_per_million: StrictStr | StrictInt | None = None  # prompt tokens served from the engine's prefix cache
    batch_input_per_million: StrictStr | StrictInt | None = None  # a batch line's price; absent: the normal one
    batch_output_per_million: StrictStr | StrictInt | None = None
    effective_from: Instant | None = None

    def check_supported(self) -> None:
        return None


def _int_param(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer", param=name) from None
    if value < 1 or value > MAX_ID:
        raise InvalidRequest(f"{name} must be between 1 and {MAX_ID}", param=name)
    return value


def _time_param(request: Request, name: str) -> datetime | None:
    """As GET /v1/usage reads its times: within the range the database and datetime both hold."""
    return parse_time(request.query_params.get(name), name)


def _path_id(request: Request, name: str = "key_id", what: str = "key") -> int:
    return path_id(request, name, what)


async def _patched_limits(
    request: Request, apply: Any, scope_kind: str, scope_id: int, what: str, body: Any = None
) -> Response:
    state = request.app.state
    if body is None:
        body = parse(PatchLimits, await read_json(request, state.settings.http.max_body_bytes))
    try:
        updated = await apply(scope_id, body.limits)
    except InvalidLimits as exc:
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None
    if updated is None:
        raise NotFound(f"No such {what}.", param="id")
    # Counters for this scope are rebuilt from the ledger at its next request.
    await state.limiter.invalidate(Scope(scope_kind, scope_id, Limits()))
    return json_response(updated)


async def patch_key(request: Request) -> Response:
    state = request.app.state
    return await _patched_limits(request, state.keys.set_key_limits, "key", _path_id(request), "key")


async def patch_account(request: Request) -> Response:
    state = request.app.state
    account_id = _path_id(request, "account_id", "account")
    body = parse(PatchAccount, await read_json(request, state.settings.http.max_body_bytes))
    classes = [c.name for c in state.settings.scheduler.priority_classes]
    if body.priority is not None and body.priority not in classes:
        raise InvalidRequest(f"priority must be one of {', '.join(classes)} (or null)", param="priority", code="invalid_value")
    if body.limits is not None:
        limited = await _patched_limits(request, state.keys.set_account_limits, "account", account_id, "account", body)
        if "priority" not in body.model_fields_set:
            return limited
    updated = await state.keys.set_account_priority(account_id, body.priority)
    if updated is None:
        raise NotFound("No such account.", param="id")
    return json_response(updated)


async def get_account(request: Request) -> Response:
    state = request.app.state
    account = await state.keys.get_account(account_id=_path_id(request, "account_id", "account"))
    if account is None:
        raise NotFound("No such account.", param="id")
    return json_response(account)


async def list_prices(request: Request) -> Response:
    state = request.app.state
    versions = await state.prices.list(request.query_params.get("model") or None)
    return json_response({"object": "list", "data": [v.view() for v in versions]})


async def add_price(request: Request) -> Response:
    state = request.app.state
    body = parse(AddPrice, await read_json(request, state.settings.http.max_body_bytes))
    try:
        version = await state.prices.add(body.model, body.input_per_million, body.output_per_million, body.effective_from,
                                         cached_input_per_million=body.cached_input_per_million,
                                         batch_input_per_million=body.batch_input_per_million,
                                         batch_output_per_million=body.batch_output_per_million)
    except InvalidPrice as exc:
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None
    return json_response(version.view(), 201)


async def create_account(request: Request) -> Response:
    state = request.app.state
    body = parse(CreateAccount, await read_json(request, state.settings.http.max_body_bytes))
    try:
        account = await state.keys.create_account(body.name)
    except AccountExists:
        raise Conflict(f"An account named {body.name!r} already exists.", param="name") from None
    return json_response(account, 201)


async def list_accounts(request: Request) -> Response:
    state = request.app.state
    return json_response({"object": "list", "data": await state.keys.list_accounts()})


async def create_key(request: Request) -> Response:
    state = request.app.state
    body = parse(CreateKey, await read_json(request, state.settings.http.max_body_bytes))
    try:
        key = await state.keys.create_key(body.account_id, name=body.name, models=body.models, expires_at=body.expires_at)
    except PastExpiry as exc:
        raise InvalidRequest(str(exc), param="expires_at", code="invalid_value") from None
    except UnknownAccount:
        raise NotFound(f"No account with id {body.account_id}.", param="account_id") from None
    return json_response(key, 201)


async def list_keys(request: Request) -> Response:
    state = request.app.state
    keys = await state.keys.list_keys(_int_param(request, "account_id"))
    return json_response({"object": "list", "data": keys})


async def get_key(request: Request) -> Response:
    state = request.app.state
    key = await state.keys.get_key(_path_id(request))
    if key is None:
        raise NotFound("No such key.", param="id")
    return json_response(key)


async def revoke_key(request: Request) -> Response:
    state = request.app.state
    key = await state.keys.revoke_key(_path_id(request))
    if key is None:
        raise NotFound("No such key.", param="id")
    return json_response(key)


async def usage(request: Request) -> Response:
    state = request.app.state
    account_id = _int_param(request, "account_id")
    start, end = _time_param(request, "start"), _time_param(request, "end")
    limit = _int_param(request, "limit") or 1000
    totals = await usage_totals(state.read_db, account_id=account_id, start=start, end=end)  # the replica, when set
    entries = await usage_rows(state.read_db, account_id=account_id, start=start, end=end, limit=min(limit, 10_000))
    for entry in entries:
        created = entry["created_at"]
        entry["created_at"] = (created if created.tzinfo else created.replace(tzinfo=timezone.utc)).isoformat()
    return json_response({"object": "usage", "account_id": account_id, "totals": totals, "entries": entries})


ENDPOINTS = [
    ("/admin/accounts", create_account, ["POST"]),
    ("/admin/accounts", list_accounts, ["GET"]),
    ("/admin/accounts/{account_id}", get_account, ["GET"]),
    ("/admin/accounts/{account_id}", patch_account, ["PATCH"]),
    ("/admin/prices", list_prices, ["GET"]),
    ("/admin/prices", add_price, ["POST"]),
    ("/admin/keys", create_key, ["POST"]),
    ("/admin/keys", list_keys, ["GET"]),
    ("/admin/keys/{key_id}", get_key, ["GET"]),
    ("/admin/keys/{key_id}", revoke_key, ["DELETE"]),
    ("/admin/keys/{key_id}", patch_key, ["PATCH"]),
    ("/admin/usage", usage, ["GET"]),
]
