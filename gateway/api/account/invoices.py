"""A customer's own invoices and credit notes (billing/invoices/ makes them).

    GET  /v1/invoices                          the caller's invoices (JSON)
    GET  /v1/invoices/{id}[/html|/pdf]         one of them
    GET  /v1/credit_notes/{id}[/html|/pdf]     a credit note on one of them
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from billing.invoices.credit_notes import get_credit_note
from billing.invoices.views import get_invoice, list_invoices
from gateway.api.account.documents import billing_of, credit_note_response, document_format, invoice_response
from gateway.http.errors import NotFound
from gateway.http.json_response import json_response
from gateway.http.requests import authenticate, path_id


async def my_invoices(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    data = await list_invoices(billing_of(request).db, account_id=principal.account_id, admin=False)
    return json_response({"object": "list", "data": data})


async def my_invoice(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    fmt = document_format(request)
    invoice = await get_invoice(
        billing_of(request).db, path_id(request, "invoice_id", "invoice"), account_id=principal.account_id, admin=False
    )
    if invoice is None:
        raise NotFound("No such invoice.", param="id")
    return invoice_response(invoice, fmt)


async def my_credit_note(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    fmt = document_format(request)
    note = await get_credit_note(billing_of(request).db, path_id(request, "note_id", "credit note"), account_id=principal.account_id)
    if note is None:
        raise NotFound("No such credit note.", param="id")
    return credit_note_response(note, fmt)


routes = [
    Route("/v1/invoices", my_invoices, methods=["GET"]),
    Route("/v1/invoices/{invoice_id}", my_invoice, methods=["GET"]),
    Route("/v1/invoices/{invoice_id}/{fmt:str}", my_invoice, methods=["GET"]),
    Route("/v1/credit_notes/{note_id}", my_credit_note, methods=["GET"]),
    Route("/v1/credit_notes/{note_id}/{fmt:str}", my_credit_note, methods=["GET"]),
]
