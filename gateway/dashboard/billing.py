"""The dashboards' billing parts: invoices tables as people read them, downloads that the
logged-in session authorises, and the admin account page's billing section (its form is saved by
gateway/dashboard/views.py, with the account page's other forms).

    GET  /dashboard/invoices/{id}/{html|pdf}       an invoice; a customer's session: its own account's only
    GET  /dashboard/credit_notes/{id}/{html|pdf}   the same for credit notes
    GET  /dashboard/statements/{id}/{html|pdf}     the same for prepaid statements
    POST /dashboard/checkout                        "Add credit": a Stripe Checkout Session, then its hosted page

A session is the cookie the dashboard login set (gateway.dashboard.sessions); an invoice of another account
is a 404 page, never a hint that it exists. Every read here goes to the read database (a replica
when DATABASE_READ_URL is set, `app.state.read_db`), as the usage dashboards' do.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from billing.credits.balance import CreditError
from billing.stripe.checkout import CheckoutService
from stripe import StripeError
from gateway.api.account.credits import cents, credit_book
from starlette.routing import Route

from billing.invoices.account_state import account_standing
from billing.invoices.billing_details import COUNTRIES, get_details
from billing.invoices.credit_notes import get_credit_note
from billing.invoices.views import get_invoice, list_invoices
from billing.invoices.render import (
    money, money_nanos, render_credit_note_html, render_credit_note_pdf, render_html, render_pdf, render_statement_html,
    render_statement_pdf,
)
from billing.invoices.statements import get_statement, list_statements
from gateway.dashboard.pages import SECURITY_HEADERS, form_with_csrf, message_page, refused, session_or_none, to_login
from gateway.http.requests import id_value, public_origin

log = logging.getLogger("tollgate.billing")

STATE_LABELS = {"active": "Active", "past_due": "Past due", "suspended": "Suspended"}


def _date(iso: str | None) -> str:
    return iso[:10] if iso else "-"


def invoice_rows(invoices: list[dict[str, Any]], *, admin: bool) -> list[dict[str, Any]]:
    """What an invoices table shows: number, period, status, formatted money, dates, Stripe state, link."""
    rows = []
    for inv in invoices:
        stripe = inv.get("stripe") or {}
        rows.append({
            "id": inv["id"], "number": inv["number"], "account": inv["account_name"], "period": inv["period"],
            "status": (f"paid, charged back {money(inv['chargeback_cents'])}" if inv.get("chargeback_cents") and inv["status"] == "paid"
                       else f"paid, nothing charged: {money(inv['carried_to_next_cents'])} carried to the next invoice"
                       if inv.get("carried_to_next_cents") and inv["status"] == "paid" else inv["status"].replace("_", " "))
            + (f", paid twice: refund {money(inv['refund_due_cents'])}" if inv.get("refund_due_cents") else ""),
            "total": money(inv["total_cents"]),
            "amount_due": money(max(0, inv["amount_due_cents"] - inv.get("credited_cents", 0))),
            "issued": _date(inv.get("issued_at")), "due": _date(inv.get("due_at")),
            "stripe": (stripe.get("status") or ("error" if stripe.get("error") else "not sent")) if admin else None,
            "kind": "Invoice" if inv.get("document") == "invoice" else "Usage statement",
            "pdf": f"/dashboard/invoices/{inv['id']}/pdf", "html": f"/dashboard/invoices/{inv['id']}/html",
            "credit_notes": [{"number": c["number"], "total": money(-c["total_cents"]), "pdf": f"/dashboard/credit_notes/{c['id']}/pdf"}
                             for c in inv.get("credit_notes", [])],
        })
    return rows


async def invoices_table(request: Request, account_id: int | None, *, admin: bool, limit: int = 50) -> list[dict[str, Any]] | None:
    billing = request.app.state.billing
    if billing is None:
        return None
    return invoice_rows(await list_invoices(request.app.state.read_db, account_id=account_id, admin=admin, limit=limit), admin=admin)


async def statements_table(request: Request, account_id: int, limit: int = 24) -> list[dict[str, Any]]:
    """A prepaid account's monthly statements as the dashboards list them."""
    return [{"id": s["id"], "number": s["number"], "period": s["period"], "opening": money_nanos(s["opening_balance_nanos"]),
             "credits": money_nanos(s["credits_nanos"]), "usage": money_nanos(s["usage_nanos"]),
             "closing": money_nanos(s["closing_balance_nanos"]), "issued": _date(s["issued_at"]),
             "pdf": f"/dashboard/statements/{s['id']}/pdf", "html": f"/dashboard/statements/{s['id']}/html"}
            for s in await list_statements(request.app.state.db, account_id=account_id, limit=limit)]


async def billing_section(request: Request, account_id: int) -> dict[str, Any]:
    """The admin account page's billing: state (since when, why), invoices, price overrides, details."""
    billing = request.app.state.billing
    standing = await account_standing(request.app.state.read_db, account_id, grace_seconds=billing.config.grace_seconds)
    reasons = [f"invoice {u['number']} (${u['amount_owed']}) unpaid" + (", payment failed" if u["payment_failed"] else "")
               + (f", charged back {_date(u['charged_back_at'])} (of ${u['total']})" if u.get("charged_back_at") else "")
               + (f", due {_date(u['due_at'])}" if u["overdue"] else "") for u in standing["unpaid_invoices"]]
    return {
        "state": STATE_LABELS.get(standing["state"], standing["state"]),
        "state_code": standing["state"],
        "since": _date(standing["delinquent_since"]) if standing["delinquent_since"] else None,
        "suspends_at": _date(standing["suspends_at"]) if standing["suspends_at"] else None,
        "reasons": reasons,
        "invoices": await invoices_table(request, account_id, admin=True),
        "statements": await statements_table(request, account_id),
        "overrides": [o.view() for o in await billing.book.overrides(account_id)],
        "details": await get_details(request.app.state.read_db, account_id) or {},
        "countries": sorted(COUNTRIES),
    }


async def _session(request: Request) -> Any:
    return await session_or_none(request)


def _not_found(request: Request, session: Any, what: str) -> HTMLResponse:
    return message_page(request, "Not found", f"No such {what}.", 404, session)


async def _document(request: Request, kind: str) -> Response:
    session = await _session(request)
    if session is None:
        return to_login()
    fmt = request.path_params["fmt"]
    doc_id = id_value(request.path_params["doc_id"])
    if fmt not in ("html", "pdf") or doc_id is None:
        return _not_found(request, session, kind.replace("_", " "))
    own = None if session.principal.is_admin else session.principal.account_id
    db = request.app.state.read_db
    if kind == "invoice":
        doc = await get_invoice(db, doc_id, account_id=own, admin=False)
        renderers = (render_html, render_pdf)
    elif kind == "statement":  # a prepaid account's monthly statement
        doc = await get_statement(db, doc_id, account_id=own)
        renderers = (render_statement_html, render_statement_pdf)
    else:
        doc = await get_credit_note(db, doc_id, account_id=own)
        renderers = (render_credit_note_html, render_credit_note_pdf)
    if doc is None:
        return _not_found(request, session, kind.replace("_", " "))
    if fmt == "html":
        response: Response = HTMLResponse(renderers[0](doc))
        # The document's own inline style and its logo as a data: image; nothing else loads.
        response.headers.update({**SECURITY_HEADERS, "content-security-policy":
                                 "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'none'"})
        return response
    headers = {"Content-Disposition": f'attachment; filename="{doc["number"]}.pdf"', "cache-control": "no-store",
               "x-content-type-options": "nosniff"}
    return Response(renderers[1](doc), media_type="application/pdf", headers=headers)


async def session_invoice(request: Request) -> Response:
    return await _document(request, "invoice")


async def session_credit_note(request: Request) -> Response:
    return await _document(request, "credit_note")


async def session_statement(request: Request) -> Response:
    return await _document(request, "statement")


async def dashboard_checkout(request: Request) -> Response:
    """The customer dashboard's "Add credit" form: a Checkout Session, then Stripe's hosted page."""
    session = await session_or_none(request)
    if session is None:
        return to_login()
    form = await form_with_csrf(request, session)
    if form is None:
        return refused(request, session)
    checkout: CheckoutService | None = request.app.state.checkout
    balance = await credit_book(request).balance(session.principal.account_id)  # a session's principal does not carry the mode
    if checkout is None or balance is None or balance["billing_mode"] != "prepaid":
        return RedirectResponse("/dashboard/account?checkout=unavailable", status_code=303)
    base = public_origin(request)  # TOLLGATE_PUBLIC_URL behind a proxy, never a Host the proxy passed on
    try:
        created = await checkout.create_session(
            session.principal.account_id, cents(str(form.get("amount") or "").strip(), "amount"),  # a pasted " 10.00"
            success_url=f"{base}/dashboard/account?checkout=done", cancel_url=f"{base}/dashboard/account?checkout=cancelled")
    except CreditError:
        return RedirectResponse("/dashboard/account?checkout=invalid", status_code=303)
    except StripeError as exc:  # Stripe refused or could not be reached: nothing was charged
        log.error("Checkout Session for account %s failed: %s", session.principal.account_id, type(exc).__name__)
        return RedirectResponse("/dashboard/account?checkout=failed", status_code=303)
    return RedirectResponse(created["url"], status_code=303)


routes = [
    Route("/dashboard/invoices/{doc_id}/{fmt}", session_invoice, methods=["GET"]),
    Route("/dashboard/credit_notes/{doc_id}/{fmt}", session_credit_note, methods=["GET"]),
    Route("/dashboard/statements/{doc_id}/{fmt}", session_statement, methods=["GET"]),
    Route("/dashboard/checkout", dashboard_checkout, methods=["POST"]),
]
