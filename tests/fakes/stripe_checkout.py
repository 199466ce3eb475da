"""A FAKE of Stripe's payment objects, added to tests/fakes/stripe_server.py's fake API (Stripe's
servers cannot run here): Checkout Sessions, PaymentIntents, Charges (implied), Refunds and the
events they send. Shapes and rules follow Stripe's API reference (2026-10):

- POST /v1/checkout/sessions: mode=payment needs success_url and line_items (price_data with
  currency, unit_amount, product_data[name]; quantity); answers a Session with status `open`,
  payment_status `unpaid`, amount_total, `url`, metadata, customer (or customer_creation),
  payment_intent null until the customer pays. GET /v1/checkout/sessions/{id}.
- The customer paying (test helper `complete_session`) makes a succeeded PaymentIntent (metadata
  from payment_intent_data[metadata], a saved payment method when setup_future_usage is set), marks
  the Session `complete`/`paid` and emits `checkout.session.completed`.
- POST /v1/payment_intents with confirm=true and off_session=true charges a saved payment method:
  succeeded (and `payment_intent.succeeded`), or, for a declining card (`decline_next`), HTTP 402
  with a `card_error` (code card_declined) whose error carries the PaymentIntent, which stays
  `requires_payment_method` with `last_payment_error` (and `payment_intent.payment_failed`).
- POST /v1/refunds {payment_intent, amount?}: a succeeded Refund (no more than what is left to
  refund), emitting `refund.created`. GET /v1/refunds/{id}.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from tests.fakes.stripe_server import FakeStripe, StripeFailure, _int, _metadata, missing


class FakeStripePayments(FakeStripe):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sessions: dict[str, dict[str, Any]] = {}
        self.payment_intents: dict[str, dict[str, Any]] = {}
        self.refunds: dict[str, dict[str, Any]] = {}
        self.payment_methods: dict[str, str] = {}  # id -> customer it is attached to
        self._decline = 0
        self._arrived: threading.Event | None = None
        self._release: threading.Event | None = None

    # test helpers ------------------------------------------------------------------------------
    def complete_session(self, session_id: str, payment_method: str = "pm_card_visa") -> dict[str, Any]:
        """The customer pays on the hosted page: the session's `checkout.session.completed` event."""
        with self._lock:
            session = self.sessions[session_id]
            assert session["status"] == "open", session["status"]
            if session["customer"] is None:
                session["customer"] = self._create_customer({"metadata": {}})["id"]
            data = session.pop("_payment_intent_data")
            pm = f"{payment_method}_{self._id('pm')}"
            if data.get("setup_future_usage"):
                self.payment_methods[pm] = session["customer"]
            intent = self._intent(session["amount_total"], session["currency"], session["customer"], pm, _metadata(data))
            intent["setup_future_usage"] = data.get("setup_future_usage")
            session.update(status="complete", payment_status="paid", payment_intent=intent["id"], url=None)
            return self._event("checkout.session.completed", session)

    def hold_charges(self) -> tuple[threading.Event, threading.Event]:
        """Off-session charges wait, outside the fake's lock, until the returned `release` is set;
        `arrived` is set once one waits: a test holds a charge in flight at Stripe (the real
        thing takes its time too). `release_charges()` ends it."""
        self._arrived, self._release = threading.Event(), threading.Event()
        return self._arrived, self._release

    def release_charges(self) -> None:
        if self._release is not None:
            self._release.set()
        self._arrived = self._release = None

    def _handle(self, http: BaseHTTPRequestHandler) -> None:
        release, arrived = self._release, self._arrived
        if release is not None and arrived is not None and http.command == "POST" and urlsplit(http.path).path == "/v1/payment_intents":
            arrived.set()
            release.wait(30)
        super()._handle(http)

    def decline_next(self, times: int = 1) -> None:
        """The next off-session charges are declined by the card's bank."""
        with self._lock:
            self._decline += times

    # routes ------------------------------------------------------------------------------------
    def _route(self, method: str, path: str, params: dict[str, Any]) -> dict[str, Any]:
        import re

        routes = [
            ("POST", r"/v1/checkout/sessions", lambda p: self._create_session(p)),
            ("GET", r"/v1/checkout/sessions/(?P<id>[^/]+)", lambda p, id: self._public(self._get(self.sessions, "checkout.session", id))),
            ("POST", r"/v1/payment_intents", lambda p: self._create_intent(p)),
            ("GET", r"/v1/payment_intents/(?P<id>[^/]+)", lambda p, id: self._public(self._get(self.payment_intents, "payment_intent", id))),
            ("POST", r"/v1/refunds", lambda p: self._create_refund(p)),
            ("GET", r"/v1/refunds/(?P<id>[^/]+)", lambda p, id: self._get(self.refunds, "refund", id)),
        ]
        for verb, pattern, handler in routes:
            match = re.fullmatch(pattern, path)
            if verb == method and match:
                return handler(params, **match.groupdict())  # type: ignore[no-any-return]
        return super()._route(method, path, params)

    @staticmethod
    def _public(session: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in session.items() if not k.startswith("_")}

    def _create_session(self, params: dict[str, Any]) -> dict[str, Any]:
        if params.get("mode") not in ("payment", "setup", "subscription"):
            raise StripeFailure(400, "Missing required param: mode.", param="mode", code="parameter_missing")
        if not params.get("success_url"):
            raise StripeFailure(400, "Missing required param: success_url.", param="success_url", code="parameter_missing")
        items = params.get("line_items")
        if not isinstance(items, list) or not items:
            raise StripeFailure(400, "Missing required param: line_items.", param="line_items", code="parameter_missing")
        total, currency = 0, None
        for i, item in enumerate(items):
            data = item.get("price_data") if isinstance(item, dict) else None
            if not isinstance(data, dict) or not (data.get("product_data") or {}).get("name"):
                raise StripeFailure(400, f"Missing required param: line_items[{i}][price_data][product_data][name].",
                                    param=f"line_items[{i}][price_data]", code="parameter_missing")
            amount = _int(data, "unit_amount", required=True)
            quantity = _int(item, "quantity", required=True)
            assert amount is not None and quantity is not None
            if amount < 0 or quantity < 1:
                raise StripeFailure(400, "Invalid line item amount or quantity.", param=f"line_items[{i}]")
            currency = currency or data.get("currency")
            total += amount * quantity
        if currency != "usd":
            raise StripeFailure(400, "Missing required param: currency.", param="line_items[0][price_data][currency]")
        if total < 50:
            raise StripeFailure(400, "The Checkout Session's total amount due must add up to at least $0.50 usd",
                                param="line_items", code="amount_too_small")
        customer = params.get("customer") or None
        if customer is not None and customer not in self.customers:
            raise missing("customer", customer, "customer")
        sid = "cs_test_" + self._id("a")[2:]
        now = int(time.time())
        session = {
            "id": sid, "object": "checkout.session", "mode": params["mode"], "status": "open", "payment_status": "unpaid",
            "amount_subtotal": total, "amount_total": total, "currency": currency, "customer": customer,
            "customer_creation": params.get("customer_creation"), "client_reference_id": params.get("client_reference_id"),
            "metadata": _metadata(params), "payment_intent": None, "success_url": params["success_url"],
            "cancel_url": params.get("cancel_url"), "url": f"https://checkout.stripe.com/c/pay/{sid}", "created": now,
            "expires_at": now + 86400, "livemode": False,
            "_payment_intent_data": params.get("payment_intent_data") or {},
        }
        self.sessions[sid] = session
        return self._public(session)

    def _intent(self, amount: int, currency: str, customer: str | None, pm: str | None, metadata: dict[str, str],
                status: str = "succeeded") -> dict[str, Any]:
        intent = {
            "id": self._id("pi"), "object": "payment_intent", "amount": amount, "amount_received": amount if status == "succeeded" else 0,
            "currency": currency, "customer": customer, "payment_method": pm, "status": status, "metadata": metadata,
            "latest_charge": self._id("ch") if status == "succeeded" else None, "last_payment_error": None,
            "created": int(time.time()), "livemode": False, "_refunded": 0,
        }
        self.payment_intents[intent["id"]] = intent
        return intent

    def _create_intent(self, params: dict[str, Any]) -> dict[str, Any]:
        amount = _int(params, "amount", required=True)
        assert amount is not None
        if amount < 50:
            raise StripeFailure(400, "Amount must be at least $0.50 usd", param="amount", code="amount_too_small")
        customer, pm = params.get("customer"), params.get("payment_method")
        if params.get("confirm") != "true" or params.get("off_session") != "true":
            raise StripeFailure(400, "This fake only charges saved cards off-session: confirm=true and off_session=true.", param="confirm")
        if pm not in self.payment_methods or self.payment_methods[pm] != customer:
            raise StripeFailure(400, f"No such PaymentMethod: '{pm}'", param="payment_method", code="resource_missing")
        if self._decline:
            self._decline -= 1
            intent = self._intent(amount, params.get("currency") or "usd", customer, pm, _metadata(params), "requires_payment_method")
            error = {"type": "card_error", "code": "card_declined", "decline_code": "insufficient_funds",
                     "message": "Your card has insufficient funds.", "param": None}
            intent["last_payment_error"] = error
            self._event("payment_intent.payment_failed", self._public(intent))
            failure = StripeFailure(402, error["message"], type_="card_error", code="card_declined")
            failure.body["error"].update(decline_code="insufficient_funds", payment_intent=self._public(intent))
            raise failure
        intent = self._intent(amount, params.get("currency") or "usd", customer, pm, _metadata(params))
        self._event("payment_intent.succeeded", self._public(intent))
        return self._public(intent)

    def _create_refund(self, params: dict[str, Any]) -> dict[str, Any]:
        pid = params.get("payment_intent")
        if not isinstance(pid, str) or pid not in self.payment_intents:
            raise missing("payment_intent", str(pid), "payment_intent")
        intent = self.payment_intents[pid]
        if intent["status"] != "succeeded":
            raise StripeFailure(400, "This PaymentIntent does not have a successful charge to refund.", param="payment_intent")
        left = intent["amount_received"] - intent["_refunded"]
        amount = _int(params, "amount") or left
        if amount > left or amount <= 0:
            raise StripeFailure(400, f"Refund amount (${amount / 100:.2f}) is greater than unrefunded amount on charge "
                                     f"(${left / 100:.2f})", param="amount", code="amount_too_large")
        intent["_refunded"] += amount
        refund = {"id": self._id("re"), "object": "refund", "amount": amount, "currency": intent["currency"],
                  "charge": intent["latest_charge"], "payment_intent": pid, "status": "succeeded", "reason": params.get("reason"),
                  "metadata": _metadata(params), "created": int(time.time())}
        self.refunds[refund["id"]] = refund
        self._event("refund.created", refund)
        return refund

    def event_of(self, kind: str, object_id: str) -> dict[str, Any]:
        """The latest event of a kind about an object (what Stripe would deliver)."""
        return next(e for e in reversed(self.events) if e["type"] == kind and e["data"]["object"]["id"] == object_id)
