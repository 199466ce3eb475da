"""FakeStripe: a small stateful fake of the slice of Stripe's API that Tollgate uses, served on
127.0.0.1 for the official `stripe` SDK (`StripeClient(..., base_addresses={"api": fake.url})`).

Faithful to Stripe's documented behaviour where Tollgate depends on it:
- bodies are form-encoded with bracket notation (`metadata[k]=v`, `expand[0]=x`) and decoded here;
- `Idempotency-Key`: the first result of a key is stored and replayed (`Idempotent-Replayed:
  true`); the same key with different parameters is a 400 `idempotency_error`; a request that
  failed before executing stores nothing, so the SDK's retry runs it;
- errors are `{"error": {"type", "message", "param", "code"}}` with Stripe's status codes;
- faults can be injected: 500 / 429 (`Stripe-Should-Retry: true`, as for lock timeouts) before a
  request runs, or a dropped connection after it ran (the response is lost, the effect is not);
- invoices: draft -> open (finalize) -> paid / void; items only on drafts, 250 at most; the
  subtotal is the sum of the items, the total adds the lines' exclusive tax amounts (set per line
  with `tax_amounts` while a draft, as Stripe's manual tax amounts; Stripe uses the amounts as
  given and reuses one tax rate per identical `tax_rate_data`); finalizing copies the customer's
  name, email, address and tax ids onto the invoice and applies the customer's balance, all of
  it, as Stripe documents (docs.stripe.com/billing/customer/balance; the SDK's Invoice fields): a
  credit (negative) up to the invoice's total, a debit (positive) whole, added to `amount_due`;
  `starting_balance` is the customer's balance before finalizing (a draft shows the current one),
  `ending_balance` after it, and an invoice left with nothing due is paid; list endpoints page
  with `limit`/`starting_after`;
- an amount due above 0 but below Stripe's minimum charge for the currency (`MINIMUM_CHARGE`: USD
  $0.50, docs.stripe.com/currencies) is not charged: finalizing marks the invoice paid and adds the
  amount to the customer's balance as a debit, an `invoice_too_small` balance transaction naming
  the invoice, which the next invoice's finalize applies (API reference, the Invoices object:
  "If the amount due for the invoice is less than Stripe's minimum allowed charge per currency, the
  invoice is automatically marked paid, and we add the amount due to the customer's credit
  balance which is applied to the next invoice"; docs.stripe.com/billing/customer/balance). Both
  collection methods (the rule names none). The invoice then shows `amount_due` 0 (the SDK's
  `amount_due`: "If the invoice's total is smaller than the minimum charge amount ... may be 0"),
  `amount_paid` 0, `amount_remaining` 0, `status_transitions.paid_at`, and an `ending_balance`
  that includes the debit (so `amount_due` = `total` + `starting_balance` - `ending_balance`, as
  for a credit applied: inferred from that identity, Stripe's pages do not print one such invoice);
- finalizing sends `invoice.finalized`, and `invoice.paid` when it leaves nothing due;
- customers carry name, email, address, balance; tax ids are their own objects (`txi_`, typed);
  every change of a balance is a customer balance transaction (`cbtxn_`: `adjustment` made by
  `POST /v1/customers/{id}/balance_transactions`, `credit_note`, `applied_to_invoice`), listed
  newest first, each with the balance after it (`ending_balance`);
- credit notes: on open or paid invoices only, at most what is left; first reduce the invoice's
  `amount_remaining` (pre-payment; an invoice left with nothing due is paid), the rest must be
  split exactly into `credit_amount` (to the customer's balance), `refund_amount` and
  `out_of_band_amount` (parameters: the note itself shows `out_of_band_amount` and, for a credit,
  its `customer_balance_transaction`); numbered per invoice. All credit notes of an invoice at most
  its total (docs.stripe.com/invoicing/dashboard/credit-notes: "The sum of all credit notes cannot
  exceed the invoice's total amount"), whatever was paid; `refund_amount` refunds "the charge
  associated with the invoice" (API reference), so at most its `amount_paid` less earlier notes'
  refunds (the limit and its message are this fake's: Stripe's pages print neither). So on an
  invoice paid below the minimum charge (`amount_paid` 0, `amount_remaining` 0, the amount carried
  as an `invoice_too_small` debit) a note is all post-payment, up to the total, as `credit_amount`
  (to the customer's balance, where it nets against the debit still there) or `out_of_band_amount`,
  never a refund;
- objects carry only the fields of the SDK's class for them in the pinned API version (no
  invoice `paid` nor `days_until_due`): keys starting `_` are the fake's own bookkeeping, never
  sent (tests/billing/stripe/test_stripe_contract.py);
- events are signed like Stripe's webhooks: `Stripe-Signature: t=<unix>,v1=<hex HMAC-SHA256 of
  f"{t}.{body}" under the endpoint secret>`.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx

MAX_INVOICE_ITEMS = 250


class StripeFailure(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"type": type_, "message": message, "param": param, "code": code}}
        self.headers = headers or {}


def public(obj: dict[str, Any]) -> dict[str, Any]:
    """What Stripe shows of a stored object: the fake's own bookkeeping (keys starting `_`) left out."""
    return {k: v for k, v in obj.items() if not k.startswith("_")}


def missing(kind: str, object_id: str, param: str = "id") -> StripeFailure:
    return StripeFailure(404, f"No such {kind}: '{object_id}'", param=param, code="resource_missing")


def decode_form(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """`a[b][0]=x` -> {"a": {"b": ["x"]}}: Stripe's bracket notation."""
    root: dict[str, Any] = {}
    for key, value in pairs:
        parts = re.findall(r"[^\[\]]+", key)
        if not parts:
            continue
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return _lists(root)  # type: ignore[return-value]


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    converted = {k: _lists(v) for k, v in node.items()}
    if converted and all(k.isdigit() for k in converted):
        return [converted[k] for k in sorted(converted, key=int)]
    return converted


# Stripe's minimum charge amounts per currency (docs.stripe.com/currencies#minimum-and-maximum-charge-amounts), in
# the currency's smallest unit; a currency not listed here: 50.
MINIMUM_CHARGE = {"usd": 50, "eur": 50, "gbp": 30, "cad": 50, "aud": 50, "chf": 50, "nzd": 50, "sgd": 50, "dkk": 250,
                  "nok": 300, "sek": 300, "jpy": 50, "mxn": 1000, "hkd": 400, "inr": 50, "brl": 50, "pln": 200}


def minimum_charge(currency: str) -> int:
    return MINIMUM_CHARGE.get(currency.lower(), 50)


def _int(params: dict[str, Any], name: str, *, required: bool = False) -> int | None:
    raw = params.get(name)
    if raw is None:
        if required:
            raise StripeFailure(400, f"Missing required param: {name}.", param=name, code="parameter_missing")
        return None
    if not isinstance(raw, str) or not re.fullmatch(r"-?\d+", raw):
        raise StripeFailure(400, f"Invalid integer: {raw}", param=name, code="parameter_invalid_integer")
    return int(raw)


def _bool(params: dict[str, Any], name: str, default: bool) -> bool:
    raw = params.get(name)
    if raw is None:
        return default
    if raw not in ("true", "false"):
        raise StripeFailure(400, f"Invalid boolean: {raw}", param=name, code="parameter_invalid_boolean")
    return raw == "true"


TAX_ID_TYPES = frozenset({  # a subset of Stripe's customer tax id types
    "eu_vat", "gb_vat", "ch_vat", "no_vat", "us_ein", "ca_bn", "au_abn", "nz_gst", "in_gst", "jp_cn", "sg_gst", "za_vat",
    "br_cnpj", "mx_rfc", "kr_brn", "ae_trn", "il_vat", "tr_tin",
})
ADDRESS_FIELDS = ("line1", "line2", "city", "postal_code", "state", "country")


def _address(params: dict[str, Any]) -> dict[str, Any] | None:
    raw = params.get("address")
    if raw is None or raw == "":
        return None
    if not isinstance(raw, dict):
        raise StripeFailure(400, "Invalid address: must be a hash", param="address")
    unknown = sorted(set(raw) - set(ADDRESS_FIELDS))
    if unknown:
        raise StripeFailure(400, f"Received unknown parameter: address[{unknown[0]}]", param=f"address[{unknown[0]}]")
    return {name: raw.get(name) or None for name in ADDRESS_FIELDS}


def _metadata(params: dict[str, Any]) -> dict[str, str]:
    meta = params.get("metadata") or {}
    if not isinstance(meta, dict):
        raise StripeFailure(400, "Invalid metadata: must be a hash", param="metadata")
    return {str(k): str(v) for k, v in meta.items()}


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int  # 0: drop the connection after the request ran
    times: int


class FakeStripe:
    def __init__(self, api_key: str = "sk_test_fake_" + secrets.token_hex(4), webhook_secret: str = "whsec_fake_" + secrets.token_hex(8)) -> None:
        self.api_key = api_key
        self.webhook_secret = webhook_secret
        self.customers: dict[str, dict[str, Any]] = {}
        self.invoices: dict[str, dict[str, Any]] = {}
        self.items: dict[str, dict[str, Any]] = {}
        self.subscriptions: dict[str, dict[str, Any]] = {}
        self.tax_ids: dict[str, dict[str, Any]] = {}
        self.tax_rates: dict[str, dict[str, Any]] = {}
        self.credit_notes: dict[str, dict[str, Any]] = {}
        self.balance_transactions: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.sent: dict[str, int] = {}  # invoice id -> emails sent
        self.requests: list[tuple[str, str, str | None, int]] = []  # method, path, idempotency key, status
        self._idempotency: dict[str, tuple[str, int, bytes]] = {}
        self._faults: list[Fault] = []
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None

    # lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "FakeStripe":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                fake._handle(self)

            def do_POST(self) -> None:
                fake._handle(self)

            def do_DELETE(self) -> None:
                fake._handle(self)

            def log_message(self, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True, name="fake-stripe").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # test controls -----------------------------------------------------------------------------
    def fail(self, method: str, path: str, status: int = 500, times: int = 1) -> None:
        """The next `times` matching requests fail: status 500/429 before running, 0 = the request
        runs and then the connection drops without a response."""
        with self._lock:
            self._faults.append(Fault(method.upper(), re.compile(path), status, times))

    def forget_idempotency_keys(self) -> None:
        """What ~24 hours do on Stripe: stored idempotent results expire."""
        with self._lock:
            self._idempotency.clear()

    def count(self, method: str, path: str, status: int | None = None) -> int:
        pattern = re.compile(path)
        with self._lock:
            return sum(1 for m, p, _, s in self.requests if m == method.upper() and pattern.fullmatch(p) and status in (None, s))

    def items_of(self, invoice_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [i for i in self.items.values() if i["invoice"] == invoice_id]

    def pay(self, invoice_id: str, parts: list[int] | None = None) -> dict[str, Any]:
        """The invoice paid: by one payment, or by several (`parts`, summing to its amount due:
        Stripe's partial payments, PaymentIntents attached to the invoice, the last one its default payment)."""
        with self._lock:
            inv = self.invoices[invoice_id]
            assert inv["status"] in ("open", "uncollectible"), inv["status"]  # an uncollectible invoice can still be paid
            parts = parts or [inv["amount_due"]]
            assert sum(parts) == inv["amount_due"] and all(p > 0 for p in parts), (parts, inv["amount_due"])
            now = int(time.time())
            inv.update(status="paid", attempted=True, attempt_count=inv["attempt_count"] + 1,
                       amount_paid=inv["amount_due"], amount_remaining=0)
            inv["status_transitions"]["paid_at"] = now
            for i, part in enumerate(parts):
                self._collect(inv, part, default=i == len(parts) - 1)
            return self._event("invoice.paid", inv)

    def _collect(self, invoice: dict[str, Any], amount: int, *, default: bool = True) -> None:
        """The payment that paid `amount` of an invoice. This fake has no payment objects
        (tests/fakes/stripe_checkout.py's makes a PaymentIntent, a Charge and an InvoicePayment)."""

    def fail_payment(self, invoice_id: str) -> dict[str, Any]:
        with self._lock:
            inv = self.invoices[invoice_id]
            assert inv["status"] == "open", inv["status"]
            inv.update(attempted=True, attempt_count=inv["attempt_count"] + 1, next_payment_attempt=int(time.time()) + 86400)
            return self._event("invoice.payment_failed", inv)

    def void(self, invoice_id: str) -> dict[str, Any]:
        """The invoice voided in Stripe's dashboard (or by another integration): its `invoice.voided`."""
        with self._lock:
            return self._event("invoice.voided", self._void({}, invoice_id))

    def mark_uncollectible(self, invoice_id: str) -> dict[str, Any]:
        """The invoice written off in Stripe's dashboard (or by its retry settings): its `invoice.marked_uncollectible`."""
        with self._lock:
            return self._event("invoice.marked_uncollectible", self._mark_uncollectible({}, invoice_id))

    def invoice_event(self, kind: str, invoice_id: str) -> dict[str, Any]:
        """An `invoice.*` event carrying the invoice as it is now (e.g. a late or re-sent delivery)."""
        with self._lock:
            return self._event(kind, self._get(self.invoices, "invoice", invoice_id))

    def set_subscription(self, customer: str, status: str, subscription_id: str | None = None) -> dict[str, Any]:
        with self._lock:
            if subscription_id is None:
                subscription_id = self._id("sub")
                self.subscriptions[subscription_id] = {
                    "id": subscription_id, "object": "subscription", "customer": customer, "status": status,
                    "created": int(time.time()), "livemode": False, "metadata": {},
                }
            sub = self.subscriptions[subscription_id]
            sub["status"] = status
            kind = "customer.subscription.deleted" if status == "canceled" else "customer.subscription.updated"
            return self._event(kind, sub)

    def _event(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        event = {
            "id": self._id("evt"), "object": "event", "api_version": "2026-10-28", "created": int(time.time()),
            "data": {"object": json.loads(json.dumps(public(obj)))}, "livemode": False, "pending_webhooks": 1,
            "request": {"id": None, "idempotency_key": None}, "type": kind,
        }
        self.events.append(event)
        return event

    def sign(self, payload: bytes, secret: str | None = None, timestamp: int | None = None) -> str:
        t = int(time.time()) if timestamp is None else timestamp
        mac = hmac.new((secret or self.webhook_secret).encode(), f"{t}.".encode() + payload, hashlib.sha256)
        return f"t={t},v1={mac.hexdigest()}"

    async def deliver(self, event: dict[str, Any], url: str, *, secret: str | None = None,
                      signature: str | None = None) -> httpx.Response:
        """POSTs an event as Stripe would (JSON body, signed); `secret`/`signature` to forge one."""
        body = json.dumps(event, indent=2).encode()
        header = signature if signature is not None else self.sign(body, secret)
        async with httpx.AsyncClient(timeout=30) as client:
            return await client.post(url, content=body, headers={"Content-Type": "application/json; charset=utf-8",
                                                                 "Stripe-Signature": header, "User-Agent": "Stripe/1.0"})

    # HTTP --------------------------------------------------------------------------------------
    def _handle(self, http: BaseHTTPRequestHandler) -> None:
        method = http.command
        split = urlsplit(http.path)
        length = int(http.headers.get("Content-Length") or 0)
        raw = http.rfile.read(length).decode() if length else ""
        pairs = parse_qsl(raw if method == "POST" else split.query, keep_blank_values=True)
        key = http.headers.get("Idempotency-Key") if method == "POST" else None
        with self._lock:
            status, body, headers, drop = self._process(method, split.path, pairs, key, http.headers.get("Authorization"))
            self.requests.append((method, split.path, key, 0 if drop else status))
        if drop:
            http.close_connection = True
            return
        http.send_response(status)
        http.send_header("Content-Type", "application/json")
        http.send_header("Content-Length", str(len(body)))
        http.send_header("Request-Id", "req_" + secrets.token_hex(7))
        for name, value in headers.items():
            http.send_header(name, value)
        http.end_headers()
        http.wfile.write(body)

    def _process(self, method: str, path: str, pairs: list[tuple[str, str]], key: str | None,
                 auth: str | None) -> tuple[int, bytes, dict[str, str], bool]:
        if auth != f"Bearer {self.api_key}":
            failure = StripeFailure(401, "Invalid API Key provided.")
            return failure.status, json.dumps(failure.body).encode(), {}, False
        fault = self._take_fault(method, path)
        if fault is not None and fault.status:
            failure = self._fault_failure(fault.status)
            return failure.status, json.dumps(failure.body).encode(), failure.headers, False
        fingerprint = json.dumps([method, path, sorted(pairs)])
        if key is not None and key in self._idempotency:
            stored_fp, status, body = self._idempotency[key]
            if stored_fp != fingerprint:
                failure = StripeFailure(
                    400, f"Keys for idempotent requests can only be used with the same parameters they were first used "
                         f"with. Try using a key other than '{key}' if you meant to execute a different request.",
                    type_="idempotency_error")
                return failure.status, json.dumps(failure.body).encode(), {}, False
            return status, body, {"Idempotent-Replayed": "true", "Idempotency-Key": key}, fault is not None
        try:
            status, payload = 200, public(self._route(method, path, decode_form(pairs)))
        except StripeFailure as failure:
            status, payload = failure.status, failure.body
        body = json.dumps(payload).encode()
        if key is not None:  # the request executed: its result is what the key replays
            self._idempotency[key] = (fingerprint, status, body)
        return status, body, ({"Idempotency-Key": key} if key else {}), fault is not None

    def _take_fault(self, method: str, path: str) -> Fault | None:
        for fault in self._faults:
            if fault.method == method and fault.path.fullmatch(path) and fault.times > 0:
                fault.times -= 1
                return fault
        return None

    @staticmethod
    def _fault_failure(status: int) -> StripeFailure:
        if status == 429:
            return StripeFailure(429, "This object cannot be accessed right now because another API request or Stripe "
                                      "process is currently accessing it.", code="lock_timeout",
                                 headers={"Stripe-Should-Retry": "true"})
        return StripeFailure(status, "An unknown error occurred", type_="api_error")

    def _route(self, method: str, path: str, params: dict[str, Any]) -> dict[str, Any]:
        routes: list[tuple[str, str, Callable[..., dict[str, Any]]]] = [
            ("POST", r"/v1/customers", self._create_customer),
            ("GET", r"/v1/customers/search", self._search_customers),
            ("GET", r"/v1/customers/(?P<id>[^/]+)", lambda p, id: self._get(self.customers, "customer", id)),
            ("POST", r"/v1/customers/(?P<id>[^/]+)", self._update_customer),
            ("POST", r"/v1/customers/(?P<id>[^/]+)/tax_ids", self._create_tax_id),
            ("GET", r"/v1/customers/(?P<id>[^/]+)/tax_ids", self._list_tax_ids),
            ("POST", r"/v1/customers/(?P<id>[^/]+)/balance_transactions", self._create_balance_transaction),
            ("GET", r"/v1/customers/(?P<id>[^/]+)/balance_transactions", self._list_balance_transactions),
            ("GET", r"/v1/invoices/(?P<id>[^/]+)/lines", self._list_lines),
            ("POST", r"/v1/invoices/(?P<id>[^/]+)/lines/(?P<line>[^/]+)", self._update_line),
            ("POST", r"/v1/credit_notes", self._create_credit_note),
            ("GET", r"/v1/credit_notes", lambda p: self._list("/v1/credit_notes", self.credit_notes, p, "invoice")),
            ("POST", r"/v1/invoices", self._create_invoice),
            ("GET", r"/v1/invoices", lambda p: self._list("/v1/invoices", self.invoices, p, "customer")),
            ("GET", r"/v1/invoices/(?P<id>[^/]+)", lambda p, id: self._get(self.invoices, "invoice", id)),
            ("POST", r"/v1/invoices/(?P<id>[^/]+)/finalize", self._finalize),
            ("POST", r"/v1/invoices/(?P<id>[^/]+)/send", self._send),
            ("POST", r"/v1/invoices/(?P<id>[^/]+)/void", self._void),
            ("POST", r"/v1/invoices/(?P<id>[^/]+)/mark_uncollectible", self._mark_uncollectible),
            ("POST", r"/v1/invoiceitems", self._create_item),
            ("GET", r"/v1/invoiceitems", lambda p: self._list("/v1/invoiceitems", self.items, p, "invoice")),
            ("GET", r"/v1/subscriptions/(?P<id>[^/]+)", lambda p, id: self._get(self.subscriptions, "subscription", id)),
        ]
        for verb, pattern, handler in routes:
            match = re.fullmatch(pattern, path)
            if verb == method and match:
                return handler(params, **match.groupdict())
        raise StripeFailure(404, f"Unrecognized request URL ({method}: {path}).")

    # resources ---------------------------------------------------------------------------------
    def _id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):06d}{secrets.token_hex(4)}"

    def _get(self, table: dict[str, dict[str, Any]], kind: str, object_id: str) -> dict[str, Any]:
        if object_id not in table:
            raise missing(kind, object_id)
        return table[object_id]

    def _list(self, url: str, table: dict[str, dict[str, Any]], params: dict[str, Any], filter_field: str) -> dict[str, Any]:
        limit = _int(params, "limit") or 10
        if not 1 <= limit <= 100:
            raise StripeFailure(400, "Invalid limit: must be between 1 and 100", param="limit")
        rows = [o for o in table.values() if filter_field not in params or o.get(filter_field) == params[filter_field]]
        rows.reverse()  # newest first, as Stripe lists
        after = params.get("starting_after")
        if after:
            ids = [o["id"] for o in rows]
            if after not in ids:
                raise missing("object", after, "starting_after")
            rows = rows[ids.index(after) + 1:]
        return {"object": "list", "url": url, "has_more": len(rows) > limit, "data": rows[:limit]}

    def _create_customer(self, params: dict[str, Any]) -> dict[str, Any]:
        customer = {
            "id": self._id("cus"), "object": "customer", "name": params.get("name"), "email": params.get("email"),
            "address": _address(params), "balance": 0, "currency": None,
            "metadata": _metadata(params), "created": int(time.time()), "livemode": False, "delinquent": False,
        }
        self.customers[customer["id"]] = customer
        return customer

    def _update_customer(self, params: dict[str, Any], id: str) -> dict[str, Any]:
        customer = self._get(self.customers, "customer", id)
        for name in ("name", "email"):
            if name in params:
                customer[name] = params[name] or None  # an empty string unsets, as on Stripe
        if "address" in params:
            customer["address"] = _address(params)
        if "metadata" in params:
            customer["metadata"].update(_metadata(params))
        return customer

    def _create_tax_id(self, params: dict[str, Any], id: str) -> dict[str, Any]:
        self._get(self.customers, "customer", id)
        kind, value = params.get("type"), params.get("value")
        for name, given in (("type", kind), ("value", value)):
            if not given:
                raise StripeFailure(400, f"Missing required param: {name}.", param=name, code="parameter_missing")
        if kind not in TAX_ID_TYPES:
            raise StripeFailure(400, f"Invalid value for type: {kind}", param="type", code="parameter_invalid_string")
        tax_id = {"id": self._id("txi"), "object": "tax_id", "customer": id, "type": kind, "value": value,
                  "country": None, "created": int(time.time()), "livemode": False,
                  "verification": {"status": "pending", "verified_address": None, "verified_name": None}}
        self.tax_ids[tax_id["id"]] = tax_id
        return tax_id

    def _list_tax_ids(self, params: dict[str, Any], id: str) -> dict[str, Any]:
        self._get(self.customers, "customer", id)
        return self._list(f"/v1/customers/{id}/tax_ids", self.tax_ids, {**params, "customer": id}, "customer")

    def _create_balance_transaction(self, params: dict[str, Any], id: str) -> dict[str, Any]:
        customer = self._get(self.customers, "customer", id)
        amount = _int(params, "amount", required=True)
        currency = params.get("currency")
        if not currency:
            raise StripeFailure(400, "Missing required param: currency.", param="currency", code="parameter_missing")
        if amount == 0:
            raise StripeFailure(400, "The amount must be a non-zero integer.", param="amount")
        return self._balance(customer, int(amount), "adjustment", currency=currency, description=params.get("description"),
                             metadata=_metadata(params))

    def _list_balance_transactions(self, params: dict[str, Any], id: str) -> dict[str, Any]:
        self._get(self.customers, "customer", id)
        return self._list(f"/v1/customers/{id}/balance_transactions", self.balance_transactions, {**params, "customer": id}, "customer")

    def _balance(self, customer: dict[str, Any], amount: int, kind: str, *, currency: str = "usd", invoice: str | None = None,
                 credit_note: str | None = None, description: str | None = None,
                 metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """One change of a customer's balance (negative: a credit), recorded as Stripe records it."""
        customer["balance"] += amount
        if customer["currency"] is None:  # set by the first transaction, as on Stripe
            customer["currency"] = currency
        txn = {
            "id": self._id("cbtxn"), "object": "customer_balance_transaction", "amount": amount, "checkout_session": None,
            "created": int(time.time()), "credit_note": credit_note, "currency": currency, "customer": customer["id"],
            "customer_account": None, "description": description, "ending_balance": customer["balance"], "invoice": invoice,
            "livemode": False, "metadata": metadata or {}, "type": kind,
        }
        self.balance_transactions[txn["id"]] = txn
        for draft in self.invoices.values():  # a draft's starting_balance is the customer's balance now
            if draft["customer"] == customer["id"] and draft["status"] == "draft":
                draft["starting_balance"] = customer["balance"]
        return txn

    def _list_lines(self, params: dict[str, Any], id: str) -> dict[str, Any]:
        invoice = self._get(self.invoices, "invoice", id)
        table = {line["id"]: line for line in reversed(invoice["lines"]["data"])}  # _list reverses: lines keep their order
        return self._list(f"/v1/invoices/{id}/lines", table, params, "invoice")

    def _update_line(self, params: dict[str, Any], id: str, line: str) -> dict[str, Any]:
        invoice = self._get(self.invoices, "invoice", id)
        found = [x for x in invoice["lines"]["data"] if x["id"] == line]
        if not found:
            raise missing("invoice line item", line)
        if invoice["status"] != "draft":
            raise StripeFailure(400, "Updating an invoice's line item is only possible before the invoice is finalized.",
                                code="invoice_not_editable")
        if "tax_amounts" in params:
            found[0]["taxes"] = [self._tax(entry, i) for i, entry in enumerate(params["tax_amounts"] or [])]
        self._total(invoice)
        return found[0]

    def _tax(self, entry: Any, i: int) -> dict[str, Any]:
        where = f"tax_amounts[{i}]"
        if not isinstance(entry, dict):
            raise StripeFailure(400, f"Invalid {where}: must be a hash", param=where)
        amount = _int(entry, "amount", required=True)
        taxable = _int(entry, "taxable_amount", required=True)
        data = entry.get("tax_rate_data")
        if not isinstance(data, dict):
            raise StripeFailure(400, f"Missing required param: {where}[tax_rate_data].", param=f"{where}[tax_rate_data]",
                                code="parameter_missing")
        for name in ("display_name", "inclusive", "percentage"):
            if name not in data:
                raise StripeFailure(400, f"Missing required param: {where}[tax_rate_data][{name}].",
                                    param=f"{where}[tax_rate_data][{name}]", code="parameter_missing")
        if not re.fullmatch(r"\d{1,3}(\.\d{1,4})?", data["percentage"]) or float(data["percentage"]) > 100:
            raise StripeFailure(400, "percentage must be between 0 and 100 with at most 4 decimal places",
                                param=f"{where}[tax_rate_data][percentage]")
        inclusive = _bool(data, "inclusive", False)
        fields = {"display_name": data["display_name"], "inclusive": inclusive, "percentage": float(data["percentage"]),
                  "country": data.get("country"), "jurisdiction": data.get("jurisdiction"), "tax_type": data.get("tax_type")}
        rate = next((r for r in self.tax_rates.values() if {k: r[k] for k in fields} == fields), None)
        if rate is None:  # the same tax_rate_data reuses one rate; created archived (active: false)
            rate = {"id": self._id("txr"), "object": "tax_rate", "active": False, "created": int(time.time()),
                    "livemode": False, **fields}
            self.tax_rates[rate["id"]] = rate
        return {"amount": amount, "taxable_amount": taxable, "tax_behavior": "inclusive" if inclusive else "exclusive",
                "taxability_reason": entry.get("taxability_reason") or "standard_rated", "type": "tax_rate_details",
                "tax_rate_details": {"tax_rate": rate["id"]}}

    @staticmethod
    def _total(invoice: dict[str, Any]) -> None:
        lines = invoice["lines"]["data"]
        subtotal = sum(line["amount"] for line in lines)
        by_rate: dict[str, dict[str, Any]] = {}
        for line in lines:
            for tax in line.get("taxes") or []:
                key = tax["tax_rate_details"]["tax_rate"]
                slot = by_rate.setdefault(key, {**tax, "amount": 0, "taxable_amount": 0})
                slot["amount"] += tax["amount"]
                slot["taxable_amount"] += tax["taxable_amount"]
        exclusive = sum(t["amount"] for t in by_rate.values() if t["tax_behavior"] == "exclusive")
        total = subtotal + exclusive
        invoice.update(subtotal=subtotal, subtotal_excluding_tax=subtotal, total=total,
                       total_excluding_tax=total - sum(t["amount"] for t in by_rate.values()),
                       total_taxes=list(by_rate.values()), amount_due=total, amount_remaining=total)

    def _search_customers(self, params: dict[str, Any]) -> dict[str, Any]:
        query = params.get("query")
        if not query:
            raise StripeFailure(400, "Missing required param: query.", param="query", code="parameter_missing")
        match = re.fullmatch(r"metadata\['([^']+)'\]:'([^']*)'", query)
        if match is None:
            raise StripeFailure(400, "This fake understands only metadata['key']:'value' searches.", param="query")
        found = [c for c in self.customers.values() if c["metadata"].get(match.group(1)) == match.group(2)]
        return {"object": "search_result", "url": "/v1/customers/search", "has_more": False, "data": found,
                "next_page": None, "total_count": len(found)}

    def _create_invoice(self, params: dict[str, Any]) -> dict[str, Any]:
        customer = params.get("customer")
        if not customer:
            raise StripeFailure(400, "Missing required param: customer.", param="customer", code="parameter_missing")
        if customer not in self.customers:
            raise missing("customer", customer, "customer")
        method = params.get("collection_method", "charge_automatically")
        if method not in ("charge_automatically", "send_invoice"):
            raise StripeFailure(400, f"Invalid collection_method: {method}", param="collection_method")
        days = _int(params, "days_until_due")
        if method == "send_invoice" and days is None:
            raise StripeFailure(400, "Missing required param: days_until_due.", param="days_until_due", code="parameter_missing")
        now = int(time.time())
        invoice = {
            "id": self._id("in"), "object": "invoice", "customer": customer, "status": "draft", "number": None,
            "collection_method": method, "_days_until_due": days, "due_date": None,
            "auto_advance": _bool(params, "auto_advance", False), "currency": params.get("currency", "usd"),
            "description": params.get("description"), "metadata": _metadata(params),
            "subtotal": 0, "total": 0, "amount_due": 0, "amount_paid": 0, "amount_remaining": 0,
            "subtotal_excluding_tax": 0, "total_excluding_tax": 0, "total_taxes": [],
            "starting_balance": self.customers[customer]["balance"],
            "ending_balance": None, "pre_payment_credit_notes_amount": 0, "post_payment_credit_notes_amount": 0,
            "customer_name": None, "customer_email": None, "customer_address": None, "customer_tax_ids": [],
            "attempted": False, "attempt_count": 0, "next_payment_attempt": None,
            "status_transitions": {"finalized_at": None, "marked_uncollectible_at": None, "paid_at": None, "voided_at": None},
            "lines": {"object": "list", "url": "/v1/invoices/lines", "has_more": False, "data": []},
            "created": now, "livemode": False, "hosted_invoice_url": None,
        }
        self.invoices[invoice["id"]] = invoice
        return invoice

    def _create_item(self, params: dict[str, Any]) -> dict[str, Any]:
        customer = params.get("customer")
        if not customer:
            raise StripeFailure(400, "Missing required param: customer.", param="customer", code="parameter_missing")
        if customer not in self.customers:
            raise missing("customer", customer, "customer")
        amount = _int(params, "amount", required=True)
        currency = params.get("currency")
        if not currency:
            raise StripeFailure(400, "Missing required param: currency.", param="currency", code="parameter_missing")
        invoice_id = params.get("invoice")
        invoice = None
        if invoice_id is not None:
            invoice = self._get(self.invoices, "invoice", invoice_id)
            if invoice["status"] != "draft":
                raise StripeFailure(400, f"You can only add invoice items to draft invoices; {invoice_id} is {invoice['status']}.",
                                    param="invoice", code="invoice_not_editable")
            if invoice["customer"] != customer:
                raise StripeFailure(400, "The invoice belongs to another customer.", param="invoice")
            if len(invoice["lines"]["data"]) >= MAX_INVOICE_ITEMS:
                raise StripeFailure(400, f"An invoice can have at most {MAX_INVOICE_ITEMS} invoice items.", param="invoice")
        item = {
            "id": self._id("ii"), "object": "invoiceitem", "amount": amount, "currency": currency, "customer": customer,
            "description": params.get("description"), "discountable": _bool(params, "discountable", True),
            "invoice": invoice_id, "metadata": _metadata(params), "date": int(time.time()), "livemode": False,
        }
        self.items[item["id"]] = item
        if invoice is not None:
            invoice["lines"]["data"].append({
                "id": "il_" + item["id"][3:], "object": "line_item", "amount": amount, "subtotal": amount, "currency": currency,
                "description": item["description"], "invoice": invoice_id, "metadata": dict(item["metadata"]), "taxes": [],
                "parent": {"type": "invoice_item_details", "invoice_item_details": {"invoice_item": item["id"]}},
                "livemode": False,
            })
            self._total(invoice)
        return item

    def _finalize(self, params: dict[str, Any], id: str) -> dict[str, Any]:
        invoice = self._get(self.invoices, "invoice", id)
        if invoice["status"] != "draft":
            raise StripeFailure(400, "This invoice is already finalized, you can't re-finalize a non-draft invoice.",
                                code="invoice_not_editable")
        now = int(time.time())
        invoice["auto_advance"] = _bool(params, "auto_advance", invoice["auto_advance"])
        invoice["number"] = f"FAKE-{len([i for i in self.invoices.values() if i['number']]) + 1:04d}"
        invoice["status_transitions"]["finalized_at"] = now
        customer = self.customers[invoice["customer"]]
        invoice.update(customer_name=customer["name"], customer_email=customer["email"], customer_address=customer["address"],
                       customer_tax_ids=[{"type": t["type"], "value": t["value"]} for t in self.tax_ids.values()
                                         if t["customer"] == customer["id"]])
        # The whole balance applies: a credit up to the total (the rest stays on the customer), a debit whole.
        starting = customer["balance"]
        applied = min(invoice["total"], -starting) if starting < 0 else -starting  # credit used (negative: a debit)
        if applied:
            self._balance(customer, applied, "applied_to_invoice", currency=invoice["currency"], invoice=invoice["id"])
        due = invoice["total"] - applied
        if 0 < due < minimum_charge(invoice["currency"]):  # too small to charge: carried to the next invoice, paid
            self._balance(customer, due, "invoice_too_small", currency=invoice["currency"], invoice=invoice["id"])
            due = 0
        invoice.update(starting_balance=starting, ending_balance=customer["balance"], amount_due=due, amount_remaining=due)
        invoice["hosted_invoice_url"] = f"https://invoice.stripe.test/{invoice['id']}"
        if invoice["collection_method"] == "send_invoice":
            invoice["due_date"] = now + 86400 * (invoice["_days_until_due"] or 0)
        if invoice["amount_due"] == 0:
            invoice["status"] = "paid"
            invoice["status_transitions"]["paid_at"] = now
        else:
            invoice["status"] = "open"
        self._event("invoice.finalized", invoice)
        if invoice["status"] == "paid":
            self._event("invoice.paid", invoice)
        return invoice

    def _void(self, params: dict[str, Any], id: str) -> dict[str, Any]:
        """Only a finalized invoice not paid can be voided (docs.stripe.com/api/invoices/void)."""
        invoice = self._get(self.invoices, "invoice", id)
        if invoice["status"] not in ("open", "uncollectible"):
            raise StripeFailure(400, f"You can only void open or uncollectible invoices; {id} is {invoice['status']}.",
                                code="invoice_not_editable")
        invoice["status"] = "void"
        invoice["status_transitions"]["voided_at"] = int(time.time())
        # The balance it applied goes back to the customer (since API 2019-12-03: "Customer balances
        # are now returned when voiding invoices"), as an `unapplied_from_invoice` transaction.
        applied = int(invoice["ending_balance"] or 0) - int(invoice["starting_balance"] or 0)
        if applied:
            self._balance(self.customers[invoice["customer"]], -applied, "unapplied_from_invoice",
                          currency=invoice["currency"], invoice=invoice["id"])
        return invoice

    def _mark_uncollectible(self, params: dict[str, Any], id: str) -> dict[str, Any]:
        """Only an open invoice (docs.stripe.com/invoicing/overview: an unpaid invoice can be marked
        `uncollectible`); it turns off automatic advancement and can still be paid."""
        invoice = self._get(self.invoices, "invoice", id)
        if invoice["status"] != "open":
            raise StripeFailure(400, f"You can only mark open invoices as uncollectible; {id} is {invoice['status']}.",
                                code="invoice_not_editable")
        invoice.update(status="uncollectible", auto_advance=False)
        invoice["status_transitions"]["marked_uncollectible_at"] = int(time.time())
        return invoice

    def _create_credit_note(self, params: dict[str, Any]) -> dict[str, Any]:
        invoice_id = params.get("invoice")
        if not invoice_id:
            raise StripeFailure(400, "Missing required param: invoice.", param="invoice", code="parameter_missing")
        invoice = self._get(self.invoices, "invoice", invoice_id)
        if invoice["status"] not in ("open", "paid"):
            raise StripeFailure(400, f"You can only create credit notes on open or paid invoices; {invoice_id} is "
                                     f"{invoice['status']}.", param="invoice", code="invoice_not_editable")
        amount = _int(params, "amount")
        if amount is None:
            raise StripeFailure(400, "One of amount, lines, or shipping_cost must be provided.", param="amount")
        credited = sum(c["total"] for c in self.credit_notes.values() if c["invoice"] == invoice_id and c["status"] == "issued")
        if amount <= 0 or amount > invoice["total"] - credited:
            raise StripeFailure(400, f"The credit note amount ({amount}) must be positive and at most the invoice's "
                                     f"remaining total ({invoice['total'] - credited}).", param="amount")
        reason = params.get("reason")
        if reason is not None and reason not in ("duplicate", "fraudulent", "order_change", "product_unsatisfactory"):
            raise StripeFailure(400, f"Invalid reason: {reason}", param="reason")
        pre = min(amount, invoice["amount_remaining"]) if invoice["status"] == "open" else 0
        post = amount - pre
        credit, refund, out_of_band = (_int(params, n) or 0 for n in ("credit_amount", "refund_amount", "out_of_band_amount"))
        if credit + refund + out_of_band != post:
            raise StripeFailure(400, f"The sum of credit_amount, refund_amount and out_of_band_amount ({credit + refund + out_of_band})"
                                     f" must equal the credit note's post-payment amount ({post}).", param="credit_amount")
        refunded = sum(c["_refund_amount"] for c in self.credit_notes.values() if c["invoice"] == invoice_id and c["status"] == "issued")
        if refund > invoice["amount_paid"] - refunded:  # a refund is of the invoice's payment: none below the minimum charge
            raise StripeFailure(400, f"The refund_amount ({refund}) is more than the invoice's payment can refund "
                                     f"({invoice['amount_paid'] - refunded}).", param="refund_amount")
        customer = self.customers[invoice["customer"]]
        number = f"{invoice['number']}-CN-{len([c for c in self.credit_notes.values() if c['invoice'] == invoice_id]) + 1:02d}"
        note = {
            "id": self._id("cn"), "object": "credit_note", "invoice": invoice_id, "customer": customer["id"],
            "amount": amount, "subtotal": amount, "total": amount, "currency": invoice["currency"], "number": number,
            "pre_payment_amount": pre, "post_payment_amount": post, "_credit_amount": credit, "_refund_amount": refund,
            "customer_balance_transaction": None,
            "out_of_band_amount": out_of_band, "reason": reason, "memo": params.get("memo"), "metadata": _metadata(params),
            "status": "issued", "type": "pre_payment" if post == 0 else ("post_payment" if pre == 0 else "mixed"),
            "created": int(time.time()), "livemode": False,
        }
        self.credit_notes[note["id"]] = note
        invoice["pre_payment_credit_notes_amount"] += pre
        invoice["post_payment_credit_notes_amount"] += post
        invoice["amount_due"] -= pre
        invoice["amount_remaining"] -= pre
        if invoice["status"] == "open" and invoice["amount_remaining"] == 0:
            invoice["status"] = "paid"
            invoice["status_transitions"]["paid_at"] = int(time.time())
        if credit:  # negative: credit the customer holds
            note["customer_balance_transaction"] = self._balance(customer, -credit, "credit_note", currency=invoice["currency"],
                                                                 invoice=invoice_id, credit_note=note["id"])["id"]
        return note

    def _send(self, params: dict[str, Any], id: str) -> dict[str, Any]:
        invoice = self._get(self.invoices, "invoice", id)
        if invoice["collection_method"] != "send_invoice":
            raise StripeFailure(400, "You can only manually send an invoice if its collection method is 'send_invoice'.")
        if invoice["status"] != "open":
            raise StripeFailure(400, f"You can't send an invoice that is {invoice['status']}.", code="invoice_not_open")
        self.sent[id] = self.sent.get(id, 0) + 1
        return invoice
