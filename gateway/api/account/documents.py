"""Billing documents over HTTP, for the customer's routes and the admin's alike: invoices, credit
notes and statements as JSON, HTML or a PDF download, and the ids and periods their paths and
queries name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from billing.invoices.periods import InvalidPeriod, Period
from billing.invoices.render import render_credit_note_html, render_credit_note_pdf, render_html, render_pdf
from gateway.billing import Billing
from gateway.http.errors import InvalidRequest, NotFound
from gateway.http.json_response import json_response
from gateway.http.requests import MAX_ID


def billing_of(request: Request) -> Billing:
    return request.app.state.billing  # type: ignore[no-any-return]


def period_param(raw: Any, param: str = "period") -> Period:
    try:
        return Period.parse(raw)
    except InvalidPeriod as exc:
        raise InvalidRequest(str(exc), param=param, code="invalid_value") from None


def query_id(request: Request, name: str) -> int | None:
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


def document_format(request: Request) -> str:
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


def invoice_response(invoice: dict[str, Any], fmt: str) -> Response:
    return document_response(invoice, fmt, render_html, render_pdf)


def credit_note_response(note: dict[str, Any], fmt: str) -> Response:
    return document_response(note, fmt, render_credit_note_html, render_credit_note_pdf)
