"""`GET /v1/usage`: usage sums from the hourly aggregates, for the caller's own account.

    ?start=&end=        ISO 8601 or Unix time; whole UTC hours (start floored, end rounded up);
                        default the last 30 days
    ?group_by=          day | model | key, or several joined by commas (default day)
    ?account_id=        admin keys only (absent: every account); a customer key may name only its own

Authorised by `Authorization: Bearer sk-...` or, for the dashboards, their session cookie.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from billing.keys.store import Principal
from billing.ledger.aggregates import GROUPS, Period, usage_groups
from billing.models import given_instant
from gateway.http.errors import InvalidRequest, PermissionDenied
from gateway.http.requests import MAX_ID, authenticate, id_value
from gateway.dashboard.sessions import current_session
from gateway.http.json_response import json_response

DEFAULT_DAYS = 30
MAX_DAYS = 3 * 366
# The instants a usage query may name: from the Unix epoch (no usage is older) to well before the
# end of datetime's range, so the whole hours covering them (and a default start 30 days before an
# end) can always be computed.


async def caller(request: Request) -> Principal:
    """The bearer key's principal, else the dashboard session's; 401 with neither."""
    if "authorization" not in request.headers:
        session = await current_session(request)
        if session is not None:
            return session.principal
    return await authenticate(request, request.app.state.keys)


def parse_time(raw: str | None, name: str) -> datetime | None:
    if not raw:
        return None
    try:
        if raw.isdigit():
            value = datetime.fromtimestamp(int(raw), tz=timezone.utc)
        else:
            value = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except (ValueError, OverflowError, OSError):
        raise InvalidRequest(f"{name} must be an ISO 8601 date or time, or a Unix timestamp", param=name) from None
    value = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    try:
        given_instant(value)
    except ValueError as exc:
        raise InvalidRequest(f"{name} {exc}", param=name, code="invalid_value") from None
    return value


def parse_period(request: Request) -> Period:
    start = parse_time(request.query_params.get("start"), "start")
    end = parse_time(request.query_params.get("end"), "end")
    if start is None and end is None:
        return Period.last_days(DEFAULT_DAYS)
    end = end or datetime.now(timezone.utc)
    start = start or end - timedelta(days=DEFAULT_DAYS)
    if start >= end:
        raise InvalidRequest("start must be before end", param="start")
    if end - start > timedelta(days=MAX_DAYS):
        raise InvalidRequest(f"the period may be at most {MAX_DAYS} days", param="end")
    return Period.covering(start, end)


def parse_groups(raw: str | None) -> tuple[str, ...]:
    groups = tuple(g.strip() for g in (raw or "day").split(",") if g.strip())
    bad = [g for g in groups if g not in GROUPS]
    if bad or not groups or len(set(groups)) != len(groups):
        raise InvalidRequest(f"group_by must be one or more of {', '.join(GROUPS)}, joined by commas", param="group_by")
    return groups


def account_scope(request: Request, principal: Principal) -> int | None:
    raw = request.query_params.get("account_id")
    if raw in (None, ""):
        return None if principal.is_admin else principal.account_id
    account_id = id_value(raw)
    if account_id is None:
        raise InvalidRequest(f"account_id must be an integer between 1 and {MAX_ID}", param="account_id")
    if not principal.is_admin and account_id != principal.account_id:
        raise PermissionDenied("This API key may only read its own account's usage.", param="account_id", code="account_not_allowed")
    return account_id


async def key_labels(request: Request, account_id: int | None) -> dict[int, dict[str, Any]]:
    keys = await request.app.state.keys.list_keys(account_id)
    return {k["id"]: {"key_prefix": k["prefix"], "key_name": k["name"]} for k in keys}


async def get_usage(request: Request) -> Response:
    principal = await caller(request)
    period = parse_period(request)
    groups = parse_groups(request.query_params.get("group_by"))
    account_id = account_scope(request, principal)
    db = request.app.state.read_db  # a replica when DATABASE_READ_URL is set, never the writer then
    rows = await usage_groups(db, period, groups, account_id=account_id)
    if "key" in groups:
        labels = await key_labels(request, account_id)
        for row in rows:
            row.update(labels.get(row["key_id"], {"key_prefix": None, "key_name": None}))
    [totals] = await usage_groups(db, period, (), account_id=account_id)
    return json_response({
        "object": "usage",
        "start": period.start.isoformat(),
        "end": period.end.isoformat(),
        "group_by": list(groups),
        "account_id": account_id,
        "data": rows,
        "totals": totals,
    })
