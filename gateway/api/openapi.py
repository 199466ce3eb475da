"""`GET /openapi.json`: the OpenAPI 3.1 document of the JSON API.

Request bodies are generated from the same pydantic models the routes validate with; responses
and parameters are written here next to each other, one table per route. The dashboards (HTML
forms behind a session and CSRF token) are not part of it. `tests/gateway/test_openapi.py` runs
schemathesis against it and checks that every route of the app is described here.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import orjson
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admin import accounts as admin
from gateway.admin import alerts as admin_alerts, credits as admin_credits, invoices as admin_invoices
from gateway.api.account import credits as account_credits
from gateway.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.api.openai.responses_protocol import ResponsesRequest
from gateway.api.openai.protocol import ChatCompletionRequest, CompletionRequest

JSON = "application/json"
ERROR_CODES = {
    400: "Invalid request: malformed JSON, wrong types, unsupported parameter, prompt too long",
    401: "Missing, unknown, revoked or expired API key",
    403: "Model not allowed, admin key required, another account's data, account suspended",
    404: "Unknown model, path or object",
    408: "The request did not arrive within the read deadline",
    409: "Conflict (duplicate account name, price version at the same instant)",
    413: "Body over the size limit",
    429: "Rate limit or quota exceeded",
    431: "Request headers over the size limit",
    502: "Stripe failed",
    503: "Engine overloaded or loading, quota store or database unavailable, metering backlog over the limit",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": {**required, **(optional or {})}}


STR, INT, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
NUM = {"type": "number"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


LIMITS = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        **{name: _nullable({"type": "integer", "minimum": 0, "maximum": 2**53 - 1}) for name in ("rpm", "tpm", "max_concurrent", "monthly_tokens")},
        "monthly_spend": _nullable({"anyOf": [
            {"type": "string", "description": "USD as a decimal string, at most 9 places, at most 9007199.254740991"},
            {"type": "integer", "minimum": 0, "maximum": 9_007_199},
        ]}),
    },
}
USAGE = _obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT})
RESPONSES: dict[str, dict[str, Any]] = {
    "Error": _obj({"error": _obj({"message": STR, "type": STR, "param": _nullable(STR), "code": _nullable(STR)})}),
    "AnthropicError": _obj({"type": {"const": "error"}, "error": _obj({"type": STR, "message": STR})}, {"request_id": STR}),
    # What MessageRenderer.body answers: the model's text and tool calls as Anthropic's TextBlock and
    # ToolUseBlock (the SDK's ContentBlock union has more kinds, none of which this gateway produces),
    # and the stop reasons of messages.stop_reason, a part of the SDK's StopReason.
    "Message": _obj({
        "id": STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": STR,
        "content": {"type": "array", "items": {"oneOf": [
            _obj({"type": {"const": "text"}, "text": STR}),
            _obj({"type": {"const": "tool_use"}, "id": STR, "name": STR, "input": {"type": "object"}}),
        ]}},
        "stop_reason": _nullable({"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]}), "stop_sequence": _nullable(STR),
        "usage": _obj({"input_tokens": INT, "output_tokens": INT}, {
            "cache_creation_input_tokens": INT, "cache_read_input_tokens": INT,
            "cache_creation": _obj({"ephemeral_5m_input_tokens": INT, "ephemeral_1h_input_tokens": INT}),
            "service_tier": {"enum": ["standard", "priority", "batch"]}}),
    }),
    "MessageTokens": _obj({"input_tokens": INT}),
    "Response": _obj({
        "id": STR, "object": {"const": "response"}, "created_at": INT, "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
        "model": STR, "output": {"type": "array", "items": _obj({"id": STR, "type": {"const": "message"}, "role": {"const": "assistant"},
                                                                  "content": {"type": "array", "items": _obj({"type": STR, "text": STR})}})},
        "usage": _nullable(_obj({"input_tokens": INT, "output_tokens": INT, "total_tokens": INT})),
    }),
    "ResponseDeleted": _obj({"id": STR, "object": {"const": "response.deleted"}, "deleted": BOOL}),
    "ResponseInputItems": _obj({
        "object": {"const": "list"}, "has_more": BOOL, "first_id": _nullable(STR), "last_id": _nullable(STR),
        "data": {"type": "array", "items": _obj({"id": STR, "type": {"const": "message"}, "role": STR, "content": {"type": "array"}})},
    }),
    "Usage": USAGE,
    "ChatCompletion": _obj({
        "id": STR, "object": {"const": "chat.completion"}, "created": INT, "model": STR,
        "choices": {"type": "array", "items": _obj({"index": INT, "finish_reason": _nullable(STR)}, {"message": _obj({"role": STR})})},
        "usage": USAGE,
    }),
    "Completion": _obj({
        "id": STR, "object": {"const": "text_completion"}, "created": INT, "model": STR,
        "choices": {"type": "array", "items": _obj({"index": INT, "finish_reason": _nullable(STR)}, {"text": STR})},
        "usage": USAGE,
    }),
    "Model": _obj({"id": STR, "object": {"const": "model"}, "created": INT, "owned_by": STR}, {
        "pricing": _obj({"input_per_million": STR, "output_per_million": STR, "currency": STR}),
    }),
    "ModelList": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}),
    "Account": _obj({"id": INT, "object": {"const": "account"}, "name": STR, "limits": {"type": "object"}, "created_at": STR}),
    "Key": _obj({
        "id": INT, "object": {"const": "api_key"}, "account_id": INT, "name": _nullable(STR), "prefix": STR, "is_admin": BOOL,
        "models": _nullable({"type": "array", "items": STR}), "expires_at": _nullable(STR), "revoked_at": _nullable(STR),
        "limits": {"type": "object"}, "created_at": STR,
    }, {"key": STR}),
    "Price": _obj({
        "id": INT, "object": {"const": "price"}, "model": STR, "input_per_million": STR, "output_per_million": STR,
        "currency": STR, "effective_from": STR,
    }, {"cached_input_per_million": _nullable(STR)}),
    "PriceOverride": _obj({
        "id": INT, "object": {"const": "price_override"}, "account_id": INT, "model": STR, "kind": STR,
        "input_per_million": _nullable(STR), "output_per_million": _nullable(STR), "multiplier": _nullable(STR), "effective_from": STR,
    }, {"cached_input_per_million": _nullable(STR)}),
    "Invoice": _obj({
        "id": INT, "object": {"const": "invoice"}, "number": STR, "account_id": INT, "period": STR, "status": STR,
        "currency": STR, "total_cents": INT, "total": STR, "charged_back_at": _nullable(STR),
        "chargeback_cents": {**INT, "description": "what chargebacks of its payments took back and is owed again (0: none)"},
        "chargeback": STR,
        "chargebacks": {"type": "array", "items": _obj({
            "object": {"const": "invoice_chargeback"},
            "status": {**STR, "description": "the dispute's Stripe status, or `settled` once recorded paid outside Stripe"},
            "dispute_status": STR, "currency": STR, "disputed_cents": INT, "disputed": STR,
            "amount_cents": {**INT, "description": "taken back of this invoice now (withdrawn less reinstated; 0 once won)"},
            "amount": STR, "owed": BOOL, "disputed_at": STR, "settled_at": _nullable(STR),
            "settled_cents": {**_nullable(INT), "description": "what the settlement outside Stripe covered"},
            "refund_due_cents": {**INT, "description": "settled, then the dispute won: paid twice, owed back to the customer (0: none)"},
            "refund_due": STR, "refunded_cents": INT, "refunded_at": _nullable(STR),
        }, {"dispute_id": STR, "payment_intent": _nullable(STR)})},
        "refund_due_cents": {**INT, "description": "its chargebacks paid twice (settled, then won): owed back to the customer (0: none)"},
        "refund_due": STR,
        "lines": {"type": "array", "items": _obj({"object": {"const": "invoice_line"}, "tokens": INT, "amount_cents": INT, "amount": STR})},
    }),
    "UsageReport": _obj({
        "object": {"const": "usage"}, "start": STR, "end": STR, "group_by": {"type": "array", "items": STR},
        "account_id": _nullable(INT), "data": {"type": "array", "items": {"type": "object"}}, "totals": {"type": "object"},
    }),
    "AdminUsage": _obj({
        "object": {"const": "usage"}, "account_id": _nullable(INT),
        "totals": {"type": "array", "items": _obj({"account_id": INT, "model": STR, "requests": INT, "total_tokens": INT})},
        "entries": {"type": "array", "items": _obj({"request_id": STR, "account_id": INT, "key_id": INT, "status": STR})},
    }),
    "BillingPeriod": _obj({"object": {"const": "billing_period"}, "period": STR, "status": STR}),
    # documents: billing details, tax rates, credit notes
    "BillingDetails": _obj({"object": {"const": "billing_details"}, "account_id": INT, "legal_name": STR, "country": STR},
                           {"email": _nullable(STR), "tax_id": _nullable(STR), "tax_rate": _nullable(STR)}),
    "TaxRate": _obj({"object": {"const": "tax_rate"}, "country": STR}, {"rate": STR, "deleted": BOOL}),
    "CreditNote": _obj({"id": INT, "object": {"const": "credit_note"}, "number": STR, "invoice_id": INT, "subtotal_cents": INT,
                        "tax_cents": INT, "total_cents": INT, "applies_to": {"enum": ["invoice", "balance"]}}),
    "BillingAccount": _obj({"object": {"const": "billing_account"}, "account_id": INT, "state": STR, "unpaid_invoices": {"type": "array", "items": _obj({
        "id": INT, "number": STR, "total_cents": INT,
        "amount_owed_cents": {**INT, "description": "an open invoice's total; a paid one charged back: what its chargebacks took back"},
        "amount_owed": STR, "charged_back_at": _nullable(STR)})}}),
    "AccountPrices": _obj({"object": {"const": "list"}, "account_id": INT, "data": {"type": "array"}, "effective": {"type": "array"}}),
    # prepaid credit
    "CreditBalance": _obj({"object": {"const": "credit_balance"}, "account_id": INT, "billing_mode": STR, "balance_nanos": INT,
                           "balance": STR, "ledger_sum_nanos": INT}),
    "CreditEntry": _obj({"id": INT, "object": {"const": "credit_entry"}, "account_id": INT, "kind": STR, "amount_nanos": INT, "amount": STR}),
    "CreditStatement": _obj({"object": {"const": "credit_statement"}, "opening_balance_nanos": INT, "closing_balance_nanos": INT,
                             "usage_nanos": INT, "amount_due": STR}),
    "PrepaidStatement": _obj({"id": INT, "object": {"const": "prepaid_statement"}, "number": STR, "account_id": INT, "period": STR,
                              "opening_balance_nanos": INT, "credits_nanos": INT, "late_nanos": INT, "usage_nanos": INT,
                              "closing_balance_nanos": INT, "amount_due_cents": {"const": 0}}),
    "CheckoutSession": _obj({"object": {"const": "checkout_session"}, "id": STR, "url": STR, "amount_cents": INT}),
    "AlertList": _obj({"object": {"const": "list"}, "rules": {"type": "array"}, "data": {"type": "array"}}),
}


def _list_of(name: str) -> dict[str, Any]:
    return _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _ref(name)}})


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): _json(_ref("Error"), ERROR_CODES[c]) for c in codes}


def _path(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema}


def _query(name: str, schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    # An empty value (`?account_id=`) means the parameter is absent.
    return {"name": name, "in": "query", "required": False, "schema": {"anyOf": [schema, {"const": ""}]}, "description": description}


ID = {"type": "integer", "minimum": 1}
FORMAT = _path("fmt", {"type": "string", "enum": ["html", "pdf"]})
PERIOD = {"type": "string", "pattern": r"^\d{4}-\d{2}$"}
WHEN = {"type": "string", "description": "ISO 8601 time or Unix seconds"}
AUTHED = (400, 401, 403, 408, 431, 503)  # any authorised call: bad input, auth, the key store down
WITH_BODY = (*AUTHED, 413)


def _op(summary: str, responses: dict[str, Any], *errors: int, body: str | None = None, params: list[Any] | None = None,
        public: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {**responses, **_errors(*errors)}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {JSON: {"schema": _ref(body)}}}
    if params:
        op["parameters"] = params
    if public:
        op["security"] = []
    return op


def _generation(summary: str, body: str, result: str) -> dict[str, Any]:
    ok = {"description": "The completion (JSON), or SSE chunks ending with `data: [DONE]` when `stream` is true",
          "content": {JSON: {"schema": _ref(result)}, "text/event-stream": {"schema": STR}}}
    return _op(summary, {"200": ok}, *WITH_BODY, 404, 429, body=body)


def _anthropic(summary: str, ok: dict[str, Any], body: str) -> dict[str, Any]:
    """An Anthropic Messages route: Anthropic's error shape; a full engine is 529."""
    codes = {**{c: ERROR_CODES[c] for c in (*WITH_BODY, 404, 429)}, 529: "The engine is at capacity (overloaded_error)"}
    errors = {str(c): _json(_ref("AnthropicError"), text) for c, text in codes.items()}
    return {**_op(summary, {"200": ok}, body=body), "responses": {"200": ok, **errors}}


def _paths() -> dict[str, Any]:
    account = [_path("account_id", ID)]
    key = [_path("key_id", ID)]
    invoice = [_path("invoice_id", ID)]
    invoice_page = {"200": {"description": "The invoice as an HTML page or a PDF file",
                            "content": {"text/html": {"schema": STR}, "application/pdf": {"schema": {"type": "string", "format": "binary"}}}}}
    return {
        "/v1/chat/completions": {"post": _generation("Chat completion", "ChatCompletionRequest", "ChatCompletion")},
        "/v1/completions": {"post": _generation("Text completion", "CompletionRequest", "Completion")},
        "/v1/messages": {"post": _anthropic("Anthropic Messages (key in x-api-key or Authorization: Bearer)", {
            "description": "The Message (JSON), or Anthropic's SSE events (message_start ... message_stop) when `stream` is true",
            "content": {JSON: {"schema": _ref("Message")}, "text/event-stream": {"schema": STR}},
        }, "MessagesRequest")},
        "/v1/messages/count_tokens": {"post": _anthropic("Prompt tokens of an Anthropic Messages request",
                                                         _json(_ref("MessageTokens")), "CountTokensRequest")},
        "/v1/responses": {"post": _op("OpenAI Responses (text, function tools and text.format; `store` keeps it, `previous_response_id` continues)", {"200": {
            "description": "The Response (JSON), or its typed SSE events (response.created ... response.completed) when `stream` is true",
            "content": {JSON: {"schema": _ref("Response")}, "text/event-stream": {"schema": STR}},
        }}, *WITH_BODY, 404, 429, body="ResponsesRequest")},
        "/v1/responses/{response_id}": {
            "get": _op("One of the account's stored responses", {"200": _json(_ref("Response"))}, *AUTHED, 404, params=[_path("response_id", STR)]),
            "delete": _op("Delete a stored response", {"200": _json(_ref("ResponseDeleted"))}, *AUTHED, 404, params=[_path("response_id", STR)]),
        },
        "/v1/responses/{response_id}/input_items": {"get": _op("A stored response's input items", {"200": _json(_ref("ResponseInputItems"))},
                                                               *AUTHED, 404, params=[
            _path("response_id", STR), _query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
            _query("order", {"enum": ["asc", "desc"]}), _query("after", STR),
        ])},
        "/v1/embeddings": {"post": _op("Embeddings (base64: little-endian float32)", {"200": _json(EMBEDDINGS)}, *WITH_BODY, 404, 429,
                                       body="EmbeddingRequest")},
        "/v1/models": {"get": _op("Models this key may use", {"200": _json(_ref("ModelList"))}, *AUTHED)},
        "/v1/models/{model_id}": {"get": _op("One model", {"200": _json(_ref("Model"))}, *AUTHED, 404, params=[_path("model_id", STR)])},
        "/v1/usage": {"get": _op("The caller's usage from the hourly aggregates", {"200": _json(_ref("UsageReport"))}, *AUTHED, params=[
            _query("start", WHEN), _query("end", WHEN), _query("group_by", STR, "day, model, key, joined by commas"),
            _query("account_id", INT, "admin keys: any account; customer keys: only their own"),
        ])},
        "/v1/invoices": {"get": _op("The caller's invoices", {"200": _json(_list_of("Invoice"))}, *AUTHED)},
        "/v1/invoices/{invoice_id}": {"get": _op("One of the caller's invoices", {"200": _json(_ref("Invoice"))}, *AUTHED, 404, params=invoice)},
        "/v1/invoices/{invoice_id}/{fmt}": {"get": _op("One of the caller's invoices as a page or PDF", invoice_page, *AUTHED, 404,
                                                       params=[*invoice, FORMAT])},
        "/healthz": {"get": _op("The process is up", {"200": _json(_obj({"status": STR}))}, public=True)},
        "/readyz": {"get": _op("Every model is loaded", {"200": _json(_obj({"status": STR, "models": {"type": "array", "items": STR}}))}, 503,
                               public=True)},
        "/metrics": {"get": _op("Prometheus metrics", {"200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": STR}}}},
                                public=True)},
        "/openapi.json": {"get": _op("This document", {"200": _json({"type": "object"})}, public=True)},
        "/admin/accounts": {
            "post": _op("Create an account", {"201": _json(_ref("Account"), "Created")}, *WITH_BODY, 409, body="CreateAccount"),
            "get": _op("List accounts", {"200": _json(_list_of("Account"))}, *AUTHED),
        },
        "/admin/accounts/{account_id}": {
            "get": _op("One account", {"200": _json(_ref("Account"))}, *AUTHED, 404, params=account),
            "patch": _op("Set an account's limits and scheduling class", {"200": _json(_ref("Account"))}, *WITH_BODY, 404,
                         body="PatchAccount", params=account),
        },
        "/admin/accounts/{account_id}/billing": {"get": _op("Billing state and unpaid invoices", {"200": _json(_ref("BillingAccount"))},
                                                            *AUTHED, 404, params=account)},
        "/admin/accounts/{account_id}/prices": {
            "get": _op("Price overrides and prices in force", {"200": _json(_ref("AccountPrices"))}, *AUTHED, 404, params=account),
            "post": _op("Add a price override version", {"201": _json(_ref("PriceOverride"), "Created")}, *WITH_BODY, 404, 409,
                        body="AddOverride", params=account),
        },
        "/admin/prices": {
            "get": _op("Price versions", {"200": _json(_list_of("Price"))}, *AUTHED, params=[_query("model", STR)]),
            "post": _op("Add a price version", {"201": _json(_ref("Price"), "Created")}, *WITH_BODY, 409, body="AddPrice"),
        },
        "/admin/keys": {
            "post": _op("Create a key (the secret is in this answer only)", {"201": _json(_ref("Key"), "Created")}, *WITH_BODY, 404,
                        body="CreateKey"),
            "get": _op("List keys (never secrets)", {"200": _json(_list_of("Key"))}, *AUTHED, params=[_query("account_id", ID)]),
        },
        "/admin/keys/{key_id}": {
            "get": _op("One key", {"200": _json(_ref("Key"))}, *AUTHED, 404, params=key),
            "delete": _op("Revoke a key", {"200": _json(_ref("Key"))}, *AUTHED, 404, params=key),
            "patch": _op("Set a key's limits", {"200": _json(_ref("Key"))}, *WITH_BODY, 404, body="PatchLimits", params=key),
        },
        "/admin/usage": {"get": _op("Ledger sums and entries", {"200": _json(_ref("AdminUsage"))}, *AUTHED, params=[
            _query("account_id", ID), _query("start", WHEN), _query("end", WHEN), _query("limit", ID),
        ])},
        "/admin/invoices": {"get": _op("Invoices", {"200": _json(_list_of("Invoice"))}, *AUTHED, params=[
            _query("account_id", ID), _query("period", PERIOD),
        ])},
        "/admin/invoices/close": {"post": _op(
            "Close a month", {"200": _json(_ref("BillingPeriod")), "202": _json(_ref("BillingPeriod"), "Closing in the background")},
            *WITH_BODY, body="CloseRequest")},
        "/admin/invoices/{invoice_id}": {"get": _op("One invoice", {"200": _json(_ref("Invoice"))}, *AUTHED, 404, params=invoice)},
        "/admin/invoices/{invoice_id}/{fmt}": {"get": _op("One invoice as a page or PDF", invoice_page, *AUTHED, 404,
                                                          params=[*invoice, FORMAT])},
        "/admin/invoices/{invoice_id}/sync": {"post": _op("Push an invoice to Stripe", {"200": _json({"type": "object"})}, *AUTHED, 404, 502,
                                                          params=invoice)},
        "/admin/invoices/{invoice_id}/chargeback_settled": {"post": {**_op(
            "Record a charged-back invoice paid outside Stripe (a lost dispute): one dispute's chargeback, or without a body all of them",
            {"200": _json(_ref("Invoice"))}, *WITH_BODY, 404, 409, params=invoice),
            "requestBody": {"required": False, "content": {JSON: {"schema": _ref("SettleChargeback")}}}}},
        "/admin/invoices/{invoice_id}/chargeback_refunded": {"post": {**_op(
            "Record the refund of a chargeback paid twice (settled outside Stripe, then the dispute won): one dispute's, or without a body all",
            {"200": _json(_ref("Invoice"))}, *WITH_BODY, 404, 409, params=invoice),
            "requestBody": {"required": False, "content": {JSON: {"schema": _ref("SettleChargeback")}}}}},
        "/admin/billing/periods/{period}": {"get": _op("Progress of a close", {"200": _json(_ref("BillingPeriod"))}, *AUTHED, 404,
                                                       params=[_path("period", PERIOD)])},
        **_credit_paths(account),  # prepaid credit
        **_batch_paths(),  # the Batch API (docs/batches.md)
        **_document_paths(account, invoice),  # billing details, tax rates, credit notes
        "/webhooks/stripe": {"post": {
            **_op("Stripe events (signed)", {"200": _json(_obj({"received": BOOL}))}, 400, 404, 408, 413, 431, 502, public=True),
            "requestBody": {"required": True, "content": {JSON: {"schema": {"type": "object"}}}},
            "parameters": [{"name": "Stripe-Signature", "in": "header", "required": False, "schema": STR}],
        }},
    }


OBJECT = {"type": "object"}
EXPIRES_AFTER = _obj({"anchor": {"const": "created_at"}, "seconds": {"type": "integer", "minimum": 3600, "maximum": 2_592_000}})
BATCH_REQUEST = _obj({"input_file_id": STR, "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]},
                      "completion_window": {"const": "24h"}}, {"metadata": {"type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                                                                            "additionalProperties": {"type": "string", "maxLength": 512}},
                                                               "output_expires_after": EXPIRES_AFTER})
MESSAGE_BATCH_REQUEST = _obj({"requests": {"type": "array", "minItems": 1, "items": _obj({
    "custom_id": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}, "params": {"type": "object"}})}})


def _batch_paths() -> dict[str, Any]:
    """OpenAI's Files and Batch APIs and Anthropic's Message Batches (gateway/batches/)."""
    file_id, batch_id = [_path("file_id", STR)], [_path("batch_id", STR)]
    # Each list's own bounds (gateway/batches/openai_api.py, anthropic_api.py): files take up to 10,000 as OpenAI's do.
    def listed(most: int, after: str = "after") -> list[Any]:
        return [_query("limit", {"type": "integer", "minimum": 1, "maximum": most}), _query(after, STR)]

    upload = {"required": True, "content": {"multipart/form-data": {"schema": _obj(
        {"file": {"type": "string", "format": "binary"}, "purpose": {"const": "batch"}},
        {"expires_after[anchor]": {"const": "created_at"}, "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2_592_000,
                                                                                       "default": 2_592_000}})}}}  # none asked: 30 days, as OpenAI's
    results = {"200": {"description": "JSONL: one result a line", "content": {"application/binary": {"schema": STR}}}}

    def anthropic(summary: str, ok: dict[str, Any], body: str | None = None, params: list[Any] | None = None) -> dict[str, Any]:
        op = _anthropic(summary, ok, body or "")
        if body is None:
            op.pop("requestBody", None)
        if params:
            op["parameters"] = params
        return op

    return {
        "/v1/files": {
            "post": {**_op("Upload a batch input file (JSONL)", {"200": _json(OBJECT)}, *WITH_BODY), "requestBody": upload},
            "get": _op("The account's files", {"200": _json(OBJECT)}, *AUTHED, params=[*listed(10_000), _query("purpose", STR), _query("order", {"type": "string", "enum": ["asc", "desc"]})]),
        },
        "/v1/files/{file_id}": {
            "get": _op("One of the account's files", {"200": _json(OBJECT)}, *AUTHED, 404, params=file_id),
            "delete": _op("Delete a file", {"200": _json(OBJECT)}, *AUTHED, 404, params=file_id),
        },
        "/v1/files/{file_id}/content": {"get": _op("A file's bytes", {"200": {"description": "The file", "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}, *AUTHED, 404, params=file_id)},
        "/v1/batches": {
            "post": _op("Create a batch from an input file", {"200": _json(OBJECT)}, *WITH_BODY, 404, body="BatchRequest"),
            "get": _op("The account's batches", {"200": _json(OBJECT)}, *AUTHED, params=listed(100)),
        },
        "/v1/batches/{batch_id}": {"get": _op("A batch", {"200": _json(OBJECT)}, *AUTHED, 404, params=batch_id)},
        "/v1/batches/{batch_id}/cancel": {"post": _op("Cancel a batch", {"200": _json(OBJECT)}, *AUTHED, 404, 409, params=batch_id)},
        "/v1/messages/batches": {
            "post": anthropic("Create an Anthropic Message Batch", _json(OBJECT), "MessageBatchRequest"),
            "get": anthropic("The account's Message Batches", _json(OBJECT), params=[*listed(1000, "after_id"), _query("before_id", STR)]),
        },
        "/v1/messages/batches/{batch_id}": {
            "get": anthropic("A Message Batch", _json(OBJECT), params=batch_id),
            "delete": anthropic("Delete an ended Message Batch", _json(OBJECT), params=batch_id),
        },
        "/v1/messages/batches/{batch_id}/cancel": {"post": anthropic("Cancel a Message Batch", _json(OBJECT), params=batch_id)},
        "/v1/messages/batches/{batch_id}/results": {"get": anthropic("A Message Batch's results (JSONL)", results, params=batch_id)},
    }


def _document_paths(account: list[Any], invoice: list[Any]) -> dict[str, Any]:
    """Billing details, tax rates and credit notes (gateway/admin/invoices.py)."""
    note = [_path("note_id", ID)]
    page = {"200": {"description": "The credit note as an HTML page or a PDF file",
                    "content": {"text/html": {"schema": STR}, "application/pdf": {"schema": {"type": "string", "format": "binary"}}}}}
    country = [_path("country", {"type": "string", "minLength": 1})]
    details = _json(_ref("BillingDetails"))
    return {
        "/admin/accounts/{account_id}/billing_details": {
            "get": _op("The buyer on the account's invoices", {"200": details}, *AUTHED, 404, params=account),
            "put": _op("Set the billing details (all fields)", {"200": details}, *WITH_BODY, 404, body="BillingDetailsBody", params=account),
            "patch": _op("Change some billing details", {"200": details}, *WITH_BODY, 404, body="BillingDetailsBody", params=account),
        },
        "/admin/tax_rates": {"get": _op("Tax rates per country", {"200": _json(_list_of("TaxRate"))}, *AUTHED)},
        "/admin/tax_rates/{country}": {
            "put": _op("Set a country's tax rate (percent)", {"200": _json(_ref("TaxRate"))}, *WITH_BODY, body="TaxRateBody", params=country),
            "delete": _op("Remove a country's tax rate", {"200": _json(_ref("TaxRate"))}, *AUTHED, 404, params=country),
        },
        "/admin/invoices/{invoice_id}/credit_notes": {"post": _op(
            "Issue a credit note against an invoice (never edits it)", {"201": _json(_ref("CreditNote"), "Created")}, *WITH_BODY, 404,
            body="CreditNoteBody", params=invoice)},
        "/admin/credit_notes/{note_id}": {"get": _op("One credit note", {"200": _json(_ref("CreditNote"))}, *AUTHED, 404, params=note)},
        "/admin/credit_notes/{note_id}/{fmt}": {"get": _op("A credit note as a page or PDF", page, *AUTHED, 404, params=[*note, FORMAT])},
        "/v1/credit_notes/{note_id}": {"get": _op("One of the caller's credit notes", {"200": _json(_ref("CreditNote"))}, *AUTHED, 404,
                                                  params=note)},
        "/v1/credit_notes/{note_id}/{fmt}": {"get": _op("One of the caller's credit notes as a page or PDF", page, *AUTHED, 404,
                                                        params=[*note, FORMAT])},
    }


DETAIL_TEXT = {"type": "string", "maxLength": 200}
BILLING_DETAILS_BODY = {
    "type": "object", "additionalProperties": False,
    "properties": {
        **{name: _nullable(DETAIL_TEXT) for name in ("legal_name", "address_line1", "address_line2", "city", "postal_code", "region",
                                                    "email", "tax_id", "tax_id_type")},
        "country": {"type": "string", "description": "ISO 3166-1 alpha-2, e.g. DE"},
        "tax_rate": _nullable({"type": "string", "description": "percent, at most 3 decimals, e.g. 19.000"}),
    },
}


def _credit_paths(account: list[Any]) -> dict[str, Any]:
    """Prepaid credit, Stripe top-ups and spend alerts (gateway/api/account/credits.py, gateway/admin/credits.py, gateway/admin/alerts.py)."""
    balance, alerts = _json(_ref("CreditBalance")), _json(_ref("AlertList"))
    statement, stmt = _json(_ref("PrepaidStatement")), [_path("statement_id", ID)]
    doc_page = {"200": {"description": "The statement as an HTML page or a PDF file", "content": {
        "text/html": {"schema": {"type": "string"}}, "application/pdf": {"schema": {"type": "string", "format": "binary"}}}}}
    return {
        "/v1/billing/balance": {"get": _op("The caller's prepaid balance", {"200": balance}, *AUTHED)},
        "/v1/billing/statement": {"get": _op("A prepaid month: opening balance, credits, usage, closing (no amount due)",
                                             {"200": _json(_ref("CreditStatement"))}, *AUTHED, params=[_query("period", PERIOD)])},
        "/v1/billing/checkout": {"post": _op("A Stripe Checkout Session to top up a prepaid balance", {"200": _json(_ref("CheckoutSession"))},
                                             *WITH_BODY, 404, 502, body="CheckoutBody")},
        "/v1/billing/alerts": {"get": _op("The caller's spend alert rules and the crossings seen", {"200": alerts}, *AUTHED)},
        "/admin/accounts/{account_id}/credits": {
            "get": _op("Balance, recharge state and the latest credit-ledger rows", {"200": balance}, *AUTHED, 404, params=account),
            "post": _op("Add a credit-ledger row (top-up, grant, refund, adjustment)", {"201": _json(_ref("CreditEntry"), "Created")},
                        *WITH_BODY, 404, body="AddCredit", params=account),
        },
        "/admin/accounts/{account_id}/statement": {"get": _op("A prepaid month", {"200": _json(_ref("CreditStatement"))}, *AUTHED, 404,
                                                              params=[*account, _query("period", PERIOD)])},
        "/v1/statements": {"get": _op("The caller's monthly prepaid statements (made by the monthly close)",
                                      {"200": _json(_list_of("PrepaidStatement"))}, *AUTHED)},
        "/v1/statements/{statement_id}": {"get": _op("One of the caller's prepaid statements", {"200": statement}, *AUTHED, 404,
                                                     params=stmt)},
        "/v1/statements/{statement_id}/{fmt}": {"get": _op("One of the caller's prepaid statements as a page or PDF", doc_page,
                                                           *AUTHED, 404, params=[*stmt, FORMAT])},
        "/admin/statements": {"get": _op("Prepaid statements", {"200": _json(_list_of("PrepaidStatement"))}, *AUTHED, params=[
            _query("account_id", ID), _query("period", PERIOD)])},
        "/admin/statements/{statement_id}": {"get": _op("One prepaid statement", {"200": statement}, *AUTHED, 404, params=stmt)},
        "/admin/statements/{statement_id}/{fmt}": {"get": _op("A prepaid statement as a page or PDF", doc_page, *AUTHED, 404,
                                                              params=[*stmt, FORMAT])},
        "/admin/accounts/{account_id}/billing_mode": {"put": _op("Make an account prepaid (or postpaid)", {"200": balance}, *WITH_BODY, 404,
                                                                 body="BillingMode", params=account)},
        "/admin/accounts/{account_id}/recharge": {"put": _op("Set or turn off auto-recharge (clears a failed state)",
                                                             {"200": _json({"type": "object"})}, *WITH_BODY, 404, body="Recharge",
                                                             params=account)},
        "/admin/accounts/{account_id}/alerts": {
            "get": _op("Spend alert rules and crossings", {"200": alerts}, *AUTHED, 404, params=account),
            "post": _op("Add a spend alert rule (its signing secret is in this answer only)", {"201": _json({"type": "object"}, "Created")},
                        *WITH_BODY, 404, body="AddAlert", params=account),
        },
        "/admin/credits/housekeeping": {"post": _op("Post prepaid usage, expire grants, charge due recharges, check alerts now",
                                                    {"200": _json({"type": "object"})}, *AUTHED, 502)},
    }


TOKENS = {"type": "array", "minItems": 1, "items": INT}
EMBEDDING_REQUEST = _obj({
    "model": {"type": "string", "minLength": 1},
    "input": {"anyOf": [
        {"type": "string", "minLength": 1}, TOKENS,
        {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"anyOf": [{"type": "string", "minLength": 1}, TOKENS]}},
    ]},
}, {
    "encoding_format": _nullable({"enum": ["float", "base64"]}),
    "dimensions": _nullable({"type": "integer", "minimum": 1}),
})
EMBEDDINGS = _obj({
    "object": {"const": "list"}, "model": STR,
    "data": {"type": "array", "items": _obj({"object": {"const": "embedding"}, "index": INT,
                                             "embedding": {"anyOf": [{"type": "array", "items": NUM}, STR]}})},
    "usage": _obj({"prompt_tokens": INT, "total_tokens": INT}),
})

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "ChatCompletionRequest": ChatCompletionRequest,
    "CompletionRequest": CompletionRequest,
    "MessagesRequest": MessagesRequest,
    "CountTokensRequest": CountTokensRequest,
    "ResponsesRequest": ResponsesRequest,
    "CreateAccount": admin.CreateAccount,
    "CreateKey": admin.CreateKey,
    "AddPrice": admin.AddPrice,
    "CloseRequest": admin_invoices.CloseRequest,
    "CreditNoteBody": admin_invoices.CreditNoteBody,
    "SettleChargeback": admin_invoices.SettleChargeback,
    "AddOverride": admin_invoices.AddOverride,
    "AddCredit": admin_credits.AddCredit,
    "BillingMode": admin_credits.BillingMode,
    "CheckoutBody": account_credits.Checkout,
    "Recharge": admin_credits.Recharge,
    "AddAlert": admin_alerts.AddAlert,
}


def _times(node: Any) -> Any:
    """pydantic's datetime fields also take Unix seconds: say so."""
    if isinstance(node, dict):
        if node.get("format") == "date-time":
            return {"type": ["string", "number"], "description": "ISO 8601 time or Unix seconds"}
        return {k: _times(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_times(v) for v in node]
    return node


def _request_schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {
        "PatchLimits": _obj({"limits": LIMITS}),
        "PatchAccount": {
            "type": "object", "anyOf": [{"required": ["limits"]}, {"required": ["priority"]}],
            "properties": {"limits": LIMITS, "priority": _nullable({"type": "string", "maxLength": 32, "description": "a scheduling class"})},
        },
        "EmbeddingRequest": EMBEDDING_REQUEST,
        "BatchRequest": BATCH_REQUEST,
        "MessageBatchRequest": MESSAGE_BATCH_REQUEST,
        "BillingDetailsBody": BILLING_DETAILS_BODY,
        "TaxRateBody": _obj({"rate": {"type": "string", "description": "percent, e.g. 19.000"}}),
    }
    for name, model in REQUEST_MODELS.items():
        schema = _times(model.model_json_schema(ref_template="#/components/schemas/{model}"))
        schemas.update(schema.pop("$defs", {}))
        schema["title"] = name
        schemas[name] = schema
    return schemas


@lru_cache(maxsize=4)
def document(served: frozenset[str] | None = None) -> dict[str, Any]:
    """The whole document, or only the paths in `served` (what this app mounts)."""
    paths = {p: ops for p, ops in _paths().items() if served is None or p in served}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Tollgate",
            "version": "0.1.0",
            "description": "A token-metered, OpenAI-compatible LLM gateway. Errors are always "
                           "`{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`; every response carries `x-request-id`.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "An API key, `sk-...`; `/admin/` needs an admin key"}},
            "schemas": {**RESPONSES, **_request_schemas()},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }


def route_path(path: str) -> str:
    """Starlette's `/v1/models/{model_id:path}` as OpenAPI's `/v1/models/{model_id}`."""
    return re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", path)


async def openapi_document(request: Request) -> Response:
    served = frozenset(route_path(r.path) for r in request.app.routes if isinstance(r, Route))
    return Response(orjson.dumps(document(served)), media_type=JSON)
