"""The dashboards served by the gateway: an admin console and a customer view.

    /dashboard/login            log in with an API key -> session cookie (see gateway.dashboard.sessions)
    /dashboard/admin            usage, spend, top keys, errors, latency, quota use, invoices
    /dashboard/admin/accounts   accounts and their keys: create, show a secret once, revoke,
                                allowed models, limits, billing details
    /dashboard/account          a customer's own usage by model and key, quota left, invoices

Pages are rendered on the server from the hourly aggregates (never raw ledger rows); charts are
drawn in the browser by plotly.js (from the `plotly` PyPI package, served from here) with data
from `GET /v1/usage`. Every POST carries the session's CSRF token; HTML errors are pages.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from billing.invoices.billing_details import FIELDS, InvalidBillingDetails, set_details
from billing.keys.store import AccountExists, UnknownAccount
from billing.quota.limits import Limits
from billing.quota import Scope
from billing.prices.cached_costs import cached_input_costs, with_cached_costs
from billing.ledger.aggregates import Period, latency_percentiles, usage_groups
from gateway.dashboard import billing as dashboard_billing
from gateway.dashboard.billing import billing_section, invoices_table, statements_table
from gateway.dashboard.pages import (
    admin_form,
    admin_session,
    form_with_csrf,
    read_form,
    message_page,
    page,
    path_int,
    refused,
    session_or_none,
    to_login,
)
from gateway.dashboard.sessions import (
    LOGIN_CSRF_COOKIE,
    SESSION_COOKIE,
    SESSION_TTL,
    Session,
    clear_cookie,
    read_cookie,
    same_origin,
    set_cookie,
)

log = logging.getLogger("tollgate.dashboard")
HERE = Path(__file__).resolve().parent
PERIODS = (1, 7, 30, 90, 365)
LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "monthly_tokens", "monthly_spend")


def plotly_js_path() -> Path:
    import plotly

    return Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"


# period ---------------------------------------------------------------------------------------
def chosen_period(request: Request) -> tuple[Period, int]:
    try:
        days = int(request.query_params.get("days", "30"))
    except ValueError:
        days = 30
    days = days if days in PERIODS else 30
    return Period.last_days(days), days


def month_period(now: datetime | None = None) -> Period:
    now = now or datetime.now(timezone.utc)
    start = datetime(now.year, now.month, 1, tzinfo=timezone.utc)
    return Period(start, now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1))


# login / logout -------------------------------------------------------------------------------
async def home(request: Request) -> Response:
    session = await session_or_none(request)
    if session is None:
        return to_login()
    return RedirectResponse("/dashboard/admin" if session.principal.is_admin else "/dashboard/account", status_code=303)


def login_form(request: Request, error: str | None = None, status_code: int = 200) -> Response:
    token = secrets.token_urlsafe(32)
    response = page(request, "login.html", {"csrf_token": token, "error": error, "session": None}, status_code)
    set_cookie(response, request, LOGIN_CSRF_COOKIE, token, max_age=3600)
    return response


async def login_page(request: Request) -> Response:
    return login_form(request)


async def login(request: Request) -> Response:
    form = await read_form(request)
    expected = read_cookie(request, LOGIN_CSRF_COOKIE)
    presented = form.get("csrf_token")
    if not same_origin(request) or not expected or not isinstance(presented, str) or not hmac.compare_digest(expected, presented):
        return login_form(request, "Your login form expired; please try again.", 403)
    key = form.get("api_key")
    made = await request.app.state.sessions.login(key.strip()) if isinstance(key, str) else None
    if made is None:
        return login_form(request, "That key is not valid (unknown, revoked or expired).", 401)
    token, session = made
    log.info("dashboard login", extra={"fields": {"key_id": session.principal.key_id, "admin": session.principal.is_admin}})
    response = RedirectResponse("/dashboard", status_code=303)
    set_cookie(response, request, SESSION_COOKIE, token, max_age=int(SESSION_TTL.total_seconds()))
    clear_cookie(response, request, LOGIN_CSRF_COOKIE)
    return response


async def logout(request: Request) -> Response:
    session = await session_or_none(request)
    if session is None:
        return to_login()
    if await form_with_csrf(request, session) is None:
        return refused(request, session)
    await request.app.state.sessions.logout(read_cookie(request, SESSION_COOKIE))
    response = to_login()
    clear_cookie(response, request, SESSION_COOKIE)
    return response


# data for the pages -----------------------------------------------------------------------------
async def quota_rows(request: Request, account_id: int | None = None) -> list[dict[str, Any]]:
    """Accounts and keys that have limits: limits, month-to-date use, and live counters."""
    keys_store = request.app.state.keys
    db = request.app.state.read_db
    month = month_period()
    accounts = [a for a in await keys_store.list_accounts() if account_id is None or a["id"] == account_id]
    keys = await keys_store.list_keys(account_id)
    names = {a["id"]: a["name"] for a in accounts}
    by_account = {g["account_id"]: g for g in await usage_groups(db, month, ("account",), account_id=account_id)}
    by_key = {g["key_id"]: g for g in await usage_groups(db, month, ("key",), account_id=account_id)}
    out = []
    for kind, items, used in (("account", accounts, by_account), ("key", [k for k in keys if not k["revoked_at"]], by_key)):
        for item in items:
            limits = item.get("limits") or {}
            if not limits:
                continue
            mtd = used.get(item["id"], {"total_tokens": 0, "cost_nanos": 0})
            label = item["name"] if kind == "account" else f"{item['prefix']}… {item['name'] or ''}".strip()
            row = {
                "kind": kind, "id": item["id"], "label": label,
                "account": names.get(item["id"] if kind == "account" else item["account_id"], ""),
                "limits": limits, "month_tokens": mtd["total_tokens"], "month_cost_nanos": mtd["cost_nanos"],
                "live": await live_counters(request, kind, item["id"], limits),
            }
            if "monthly_tokens" in limits:
                row["tokens_left"] = max(0, int(limits["monthly_tokens"]) - mtd["total_tokens"])
            if "monthly_spend" in limits:
                cap = int(Decimal(str(limits["monthly_spend"])) * 10**9)
                row["spend_left_nanos"] = max(0, cap - mtd["cost_nanos"])
            out.append(row)
    return out


async def live_counters(request: Request, kind: str, scope_id: int, limits: dict[str, Any]) -> dict[str, int]:
    """This minute's requests/tokens and requests in flight, from the quota limiter."""
    limiter = request.app.state.limiter
    if limiter is None or not hasattr(limiter, "counters"):
        return {}
    try:
        scope = Scope(kind, scope_id, Limits().patched(limits))
        return dict(await limiter.counters(scope))
    except Exception as exc:  # a quota store outage must not take the page down
        log.warning("quota counters unavailable: %s", type(exc).__name__)
        return {}


def chart_context(period: Period, account_id: int | None = None) -> dict[str, Any]:
    return {"chart_start": period.start.isoformat(), "chart_end": period.end.isoformat(), "chart_account": account_id or ""}


# admin pages ------------------------------------------------------------------------------------
async def admin_overview(request: Request) -> Response:
    session = await admin_session(request)
    if isinstance(session, Response):
        return session
    db = request.app.state.read_db
    period, days = chosen_period(request)
    accounts = {a["id"]: a["name"] for a in await request.app.state.keys.list_accounts()}
    keys = {k["id"]: k for k in await request.app.state.keys.list_keys()}
    top = await usage_groups(db, period, ("key",), order_by=("cost_nanos", "total_tokens"), limit=10)
    for row in top:
        key = keys.get(row["key_id"], {})
        row.update(prefix=key.get("prefix", "?"), name=key.get("name"), account=accounts.get(row["account_id"], "?"))
    [totals] = await usage_groups(db, period)
    invoices = await invoices_table(request, None, admin=True)
    context = {
        "session": session, "days": days, "periods": PERIODS, "totals": totals,
        "models": with_cached_costs(await usage_groups(db, period, ("model",)),
                                    await cached_input_costs(db, request.app.state.prices, period.start, period.end)),
        "top_keys": top,
        "latency": await latency_percentiles(db, period),
        "quota": await quota_rows(request),
        "invoices": invoices, "admin_view": True,
        **chart_context(period),
    }
    return page(request, "admin.html", context)


async def admin_accounts(request: Request) -> Response:
    session = await admin_session(request)
    if isinstance(session, Response):
        return session
    return await render_accounts(request, session)


async def render_accounts(request: Request, session: Session, error: str | None = None, status_code: int = 200) -> Response:
    month = month_period()
    usage = {g["account_id"]: g for g in await usage_groups(request.app.state.read_db, month, ("account",))}
    accounts = await request.app.state.keys.list_accounts()
    return page(request, "accounts.html", {"session": session, "accounts": accounts, "usage": usage, "error": error}, status_code)


async def create_account(request: Request) -> Response:
    checked = await admin_form(request)
    if isinstance(checked, Response):
        return checked
    session, form = checked
    name = str(form.get("name") or "").strip()
    if not name or len(name) > 200:
        return await render_accounts(request, session, "An account needs a name of 1 to 200 characters.", 400)
    try:
        account = await request.app.state.keys.create_account(name)
    except AccountExists:
        return await render_accounts(request, session, f"An account named {name!r} already exists.", 409)
    return RedirectResponse(f"/dashboard/admin/accounts/{account['id']}", status_code=303)


async def account_page(request: Request) -> Response:
    session = await admin_session(request)
    if isinstance(session, Response):
        return session
    account_id = path_int(request, "account_id")
    return await render_account(request, session, account_id)


async def render_account(
    request: Request, session: Session, account_id: int | None, *, new_key: dict[str, Any] | None = None,
    error: str | None = None, status_code: int = 200,
) -> Response:
    store = request.app.state.keys
    account = await store.get_account(account_id=account_id) if account_id else None
    if account is None:
        return message_page(request, "Not found", "No such account.", 404, session)
    period, days = chosen_period(request)
    keys = await store.list_keys(account_id)
    usage = {g["key_id"]: g for g in await usage_groups(request.app.state.read_db, period, ("key",), account_id=account_id)}
    context = {
        "session": session, "account": account, "keys": keys, "usage": usage, "days": days, "periods": PERIODS,
        "new_key": new_key, "error": error, "served_models": sorted(request.app.state.service.engines),
        "quota": await quota_rows(request, account_id), "limit_fields": LIMIT_FIELDS,
        **chart_context(period, account_id),
        "billing": await billing_section(request, account_id) if request.app.state.billing else None,
        "admin_view": True,
        # the prepaid balance, its latest credit rows, and the spend alerts that fired
        "credit": await request.app.state.credits.balance(account_id),
        "credit_entries": await request.app.state.credits.entries(account_id, 20),
        "alerts": await request.app.state.alerts.events(account_id, 20),
    }
    return page(request, "account_admin.html", context, status_code)


def _models_field(form: FormData) -> list[str] | None:
    raw = str(form.get("models") or "").strip()
    if not raw:
        return None
    return sorted({m.strip() for m in raw.split(",") if m.strip()})


async def create_key(request: Request) -> Response:
    checked = await admin_form(request)
    if isinstance(checked, Response):
        return checked
    session, form = checked
    account_id = path_int(request, "account_id")
    name = str(form.get("name") or "").strip()[:200] or None
    try:
        created = await request.app.state.keys.create_key(account_id or 0, name=name, models=_models_field(form))
    except UnknownAccount:
        return message_page(request, "Not found", "No such account.", 404, session)
    log.info("dashboard created key", extra={"fields": {"key_id": created["id"], "account_id": account_id}})
    # The only time the secret is shown: in this response, which is never cached.
    return await render_account(request, session, account_id, new_key=created, status_code=201)


async def _key_in_path(request: Request, session: Session) -> dict[str, Any] | Response:
    key_id = path_int(request, "key_id")
    key = await request.app.state.keys.get_key(key_id) if key_id else None
    if key is None:
        return message_page(request, "Not found", "No such key.", 404, session)
    return key


async def revoke_key(request: Request) -> Response:
    checked = await admin_form(request)
    if isinstance(checked, Response):
        return checked
    session, _ = checked
    key = await _key_in_path(request, session)
    if isinstance(key, Response):
        return key
    await request.app.state.keys.revoke_key(key["id"])
    return RedirectResponse(f"/dashboard/admin/accounts/{key['account_id']}", status_code=303)


async def set_key_models(request: Request) -> Response:
    checked = await admin_form(request)
    if isinstance(checked, Response):
        return checked
    session, form = checked
    key = await _key_in_path(request, session)
    if isinstance(key, Response):
        return key
    await request.app.state.keys.set_key_models(key["id"], _models_field(form))
    return RedirectResponse(f"/dashboard/admin/accounts/{key['account_id']}", status_code=303)




def _limits_from_form(form: FormData) -> dict[str, Any]:
    """Form fields to a PATCH of limits: a blank field removes that limit."""
    changes: dict[str, Any] = {}
    for name in LIMIT_FIELDS:
        raw = str(form.get(name) or "").strip()
        if not raw:
            changes[name] = None
        elif name == "monthly_spend":
            changes[name] = raw
        else:
            try:
                changes[name] = int(raw)
            except ValueError:
                changes[name] = raw  # the limits parser refuses it with a clear message
    return changes


async def set_limits(request: Request) -> Response:
    checked = await admin_form(request)
    if isinstance(checked, Response):
        return checked
    session, form = checked
    store = request.app.state.keys
    if "key_id" in request.path_params:
        key = await _key_in_path(request, session)
        if isinstance(key, Response):
            return key
        kind, scope_id, account_id, apply = "key", key["id"], key["account_id"], getattr(store, "set_key_limits", None)
    else:
        account_id = path_int(request, "account_id")
        kind, scope_id, apply = "account", account_id, getattr(store, "set_account_limits", None)
    if apply is None:
        return message_page(request, "Not available", "Limits are not supported by this gateway version.", 501, session)
    try:
        updated = await apply(scope_id, _limits_from_form(form))
    except ValueError as exc:  # billing.quota.limits.InvalidLimits
        return await render_account(request, session, account_id, error=str(exc), status_code=400)
    if updated is None:
        return message_page(request, "Not found", f"No such {kind}.", 404, session)
    limiter = request.app.state.limiter
    if limiter is not None:
        await limiter.invalidate(Scope(kind, scope_id, Limits()))
    return RedirectResponse(f"/dashboard/admin/accounts/{account_id}", status_code=303)


# customer page ----------------------------------------------------------------------------------
async def save_billing_details(request: Request) -> Response:
    checked = await admin_form(request)
    if isinstance(checked, Response):
        return checked
    session, form = checked
    account_id = path_int(request, "account_id")
    if account_id is None or await request.app.state.keys.get_account(account_id=account_id) is None:
        return message_page(request, "Not found", "No such account.", 404, session)
    body = {name: str(form.get(name) or "").strip() or None for name in FIELDS}
    try:
        await set_details(request.app.state.billing.db, account_id, body, replace=True)
    except InvalidBillingDetails as exc:
        return await render_account(request, session, account_id, error=f"Billing details: {exc}", status_code=400)
    return RedirectResponse(f"/dashboard/admin/accounts/{account_id}#billing", status_code=303)


async def customer_view(request: Request) -> Response:
    session = await session_or_none(request)
    if session is None:
        return to_login()
    if session.principal.is_admin:
        return RedirectResponse("/dashboard/admin", status_code=303)
    account_id = session.principal.account_id
    store = request.app.state.keys
    period, days = chosen_period(request)
    usage = {g["key_id"]: g for g in await usage_groups(request.app.state.read_db, period, ("key",), account_id=account_id)}
    [totals] = await usage_groups(request.app.state.read_db, period, (), account_id=account_id)
    invoices = await invoices_table(request, account_id, admin=False)
    context = {
        "session": session, "account": await store.get_account(account_id=account_id), "days": days, "periods": PERIODS,
        "keys": await store.list_keys(account_id), "usage": usage, "totals": totals,
        "models": with_cached_costs(
            await usage_groups(request.app.state.read_db, period, ("model",), account_id=account_id),
            await cached_input_costs(request.app.state.read_db, request.app.state.prices, period.start, period.end, account_id)),
        "quota": await quota_rows(request, account_id), "invoices": invoices,
        **chart_context(period, account_id),
        # the prepaid balance and the spend alerts that fired
        "credit": await request.app.state.credits.balance(account_id), "alerts": await request.app.state.alerts.events(account_id, 20),
        "statements": await statements_table(request, account_id),
        "checkout_enabled": request.app.state.checkout is not None,
        "checkout_said": CHECKOUT_SAID.get(request.query_params.get("checkout", "")),
    }
    return page(request, "customer.html", context)


# Where the "Add credit" form came back to (gateway/dashboard/billing.py and Stripe's return URLs).
CHECKOUT_SAID = {
    "done": "Payment made: the credit shows here once Stripe confirms it.",
    "cancelled": "Payment cancelled: nothing was charged.",
    "invalid": "That amount cannot be bought: give dollars and cents, at least the minimum.",
    "unavailable": "Buying credit is not available for this account.",
    "failed": "Stripe could not start the payment: nothing was charged; try again shortly.",
}


async def plotly_js(request: Request) -> Response:
    return FileResponse(plotly_js_path(), media_type="text/javascript", headers={"cache-control": "public, max-age=86400"})


routes = [
    Route("/dashboard", home, methods=["GET"]),
    Route("/dashboard/login", login_page, methods=["GET"]),
    Route("/dashboard/login", login, methods=["POST"]),
    Route("/dashboard/logout", logout, methods=["POST"]),
    Route("/dashboard/admin", admin_overview, methods=["GET"]),
    Route("/dashboard/admin/accounts", admin_accounts, methods=["GET"]),
    Route("/dashboard/admin/accounts", create_account, methods=["POST"]),
    Route("/dashboard/admin/accounts/{account_id}", account_page, methods=["GET"]),
    Route("/dashboard/admin/accounts/{account_id}/keys", create_key, methods=["POST"]),
    Route("/dashboard/admin/accounts/{account_id}/limits", set_limits, methods=["POST"]),
    Route("/dashboard/admin/accounts/{account_id}/billing", save_billing_details, methods=["POST"]),
    Route("/dashboard/admin/keys/{key_id}/revoke", revoke_key, methods=["POST"]),
    Route("/dashboard/admin/keys/{key_id}/models", set_key_models, methods=["POST"]),
    Route("/dashboard/admin/keys/{key_id}/limits", set_limits, methods=["POST"]),
    Route("/dashboard/account", customer_view, methods=["GET"]),
    Route("/static/vendor/plotly.min.js", plotly_js, methods=["GET"]),
    *dashboard_billing.routes,
    Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
]
