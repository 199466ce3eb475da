"""What every dashboard page stands on: the templates and their filters, the security headers
of every page, the login redirect and message pages, the session and CSRF checks of the forms.

Apart from the pages themselves (gateway/dashboard/views.py, gateway/dashboard/billing.py) so that
both can use it without importing each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.templating import Jinja2Templates

from billing.ledger.aggregates import usd
from gateway.http.errors import PayloadTooLarge
from gateway.http.requests import id_value, read_body
from gateway.dashboard.sessions import Session, current_session, same_origin

templates = Jinja2Templates(directory=str(Path(__file__).resolve().parent / "templates"))
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",  # "no-referrer" would make browsers send Origin: null on POST
    "cache-control": "no-store",
}


def fmt_int(value: Any) -> str:
    return f"{int(value or 0):,}"


def fmt_ms(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f} ms" if value >= 10 else f"{value:.1f} ms"


def fmt_pct(value: Any) -> str:
    return f"{100.0 * (value or 0):.1f}%"


def fmt_usd(nanos: Any) -> str:
    """Exact dollars from nano-USD, without trailing zeros past the cents: $0.00, $1.50, $0.000123,
    -$0.10 (a refund, an overdrawn balance: the sign is the amount's, also below a dollar)."""
    amount = int(nanos or 0)
    whole, _, frac = usd(abs(amount)).partition(".")
    frac = frac.rstrip("0")
    return f"{'-' if amount < 0 else ''}${int(whole):,}.{frac.ljust(2, '0')}"


templates.env.filters.update(int=fmt_int, ms=fmt_ms, pct=fmt_pct, usd=fmt_usd)


def page(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> HTMLResponse:
    response = templates.TemplateResponse(request, name, context, status_code=status_code)
    response.headers.update(SECURITY_HEADERS)
    return response


def message_page(request: Request, title: str, text: str, status_code: int, session: Session | None = None) -> HTMLResponse:
    return page(request, "message.html", {"title": title, "text": text, "session": session}, status_code)


def to_login() -> RedirectResponse:
    return RedirectResponse("/dashboard/login", status_code=303)


async def session_or_none(request: Request) -> Session | None:
    return await current_session(request)


class UnreadableForm(Exception):
    """A form no page takes: a field with a NUL character (the database refuses it in text), or a
    body past FORM_MAX_BYTES / FORM_MAX_FIELDS or with a file (`field` None). Answered with a 400 or 413 page
    (`unreadable_form`, the app's handler for it)."""

    def __init__(self, field: str | None) -> None:
        super().__init__(field)
        self.field = field


# The largest form a page sends (a key's model list, an account's billing details) is a few KiB.
FORM_MAX_BYTES = 64 * 1024
FORM_MAX_FIELDS = 64


async def read_form(request: Request) -> FormData:
    """A page's POSTed form, read only up to FORM_MAX_BYTES and FORM_MAX_FIELDS (no files):
    UnreadableForm past them, before anything is parsed. Starlette's parser alone takes 1,000
    fields of up to 1 MB each: one login POST, before any check, held ~1 GB of the server's memory."""
    try:
        body = await read_body(request, FORM_MAX_BYTES)
    except PayloadTooLarge:
        raise UnreadableForm(None) from None

    async def replay() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        return await Request(request.scope, replay).form(max_files=0, max_fields=FORM_MAX_FIELDS, max_part_size=FORM_MAX_BYTES)
    except HTTPException:  # past the fields, or a file
        raise UnreadableForm(None) from None


async def form_with_csrf(request: Request, session: Session) -> FormData | None:
    """The POSTed form when its CSRF token (and Origin, when sent) check out; None otherwise.
    UnreadableForm for a field that holds a NUL character, or a form past the limits (read_form)."""
    form = await read_form(request)
    token = form.get("csrf_token")
    if not same_origin(request) or not session.csrf_ok(token if isinstance(token, str) else None):
        return None
    for name, value in form.multi_items():
        if "\x00" in name or (isinstance(value, str) and "\x00" in value):
            raise UnreadableForm(name.replace("\x00", ""))
    return form


async def unreadable_form(request: Request, exc: Exception) -> Response:
    field = exc.field if isinstance(exc, UnreadableForm) else "?"
    if field is None:
        return message_page(request, "Not sent", f"The form is larger than any page sends (at most {FORM_MAX_BYTES // 1024} KiB "
                            f"and {FORM_MAX_FIELDS} fields).", 413, await session_or_none(request))
    return message_page(request, "Not saved", f"The field {field!r} holds a NUL character, which no field takes. Go back, "
                        "correct it and send the form again.", 400, await session_or_none(request))


async def admin_session(request: Request) -> Session | Response:
    session = await session_or_none(request)
    if session is None:
        return to_login()
    if not session.principal.is_admin:
        return message_page(request, "Admins only", "This page needs an admin key. You are logged in with a customer key.", 403, session)
    return session


async def admin_form(request: Request) -> tuple[Session, FormData] | Response:
    """What an admin form's POST needs: an admin's session, then its CSRF-checked form; else the
    page that refuses it (the login redirect, the admins-only page, the expired-form page)."""
    session = await admin_session(request)
    if isinstance(session, Response):
        return session
    form = await form_with_csrf(request, session)
    if form is None:
        return refused(request, session)
    return session, form


def refused(request: Request, session: Session) -> Response:
    return message_page(request, "Refused", "The form's security token is missing or wrong. Reload the page and try again.", 403, session)


def path_int(request: Request, name: str) -> int | None:
    return id_value(request.path_params.get(name, ""))
