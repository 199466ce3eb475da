"""A FAKE of Stripe's payment objects, added to tests/fakes/stripe_server.py's fake API (Stripe's
servers cannot run here): Checkout Sessions, PaymentIntents, Charges, Refunds and the events each
flow sends. Field names and values follow the SDK's object definitions (API version 2026-10-28;
tests/billing/stripe/test_stripe_contract.py checks every object and event the fake makes against them).

Each test helper returns the events its flow emits, in one of the orders Stripe may deliver them
(Stripe guarantees no order, and delivers at least once: tests shuffle and repeat them):

- POST /v1/checkout/sessions: mode=payment needs success_url and line_items (price_data with
  currency, unit_amount, product_data[name]; quantity); answers a Session with status `open`,
  payment_status `unpaid`, amount_total, `url`, metadata, customer (or customer_creation),
  payment_intent null until the customer pays. GET /v1/checkout/sessions/{id}.
- `complete_session` (the customer pays by card on the hosted page): a succeeded PaymentIntent
  (metadata from payment_intent_data[metadata], a saved payment method when setup_future_usage is
  set) and its succeeded Charge; the Session `complete`/`paid`. Events: payment_intent.created,
  charge.succeeded, payment_intent.succeeded, checkout.session.completed.
- `complete_session(delayed=True)` (a bank debit: ACH, SEPA): the Session is `complete` but
  `unpaid`, the PaymentIntent `processing`, the Charge `pending`. Events: payment_intent.created,
  payment_intent.processing, charge.pending, checkout.session.completed. Later `settle_session`:
  succeeded -> charge.succeeded, payment_intent.succeeded, checkout.session.async_payment_succeeded
  (payment_status `paid`); failed -> charge.failed, payment_intent.payment_failed,
  checkout.session.async_payment_failed (the PaymentIntent back to `requires_payment_method`
  with `last_payment_error`, the Session still `unpaid`).
- POST /v1/payment_intents with confirm=true and off_session=true charges a saved payment method:
  succeeded (payment_intent.created, charge.succeeded, payment_intent.succeeded), or, for a
  declining card (`decline_next`) or one whose bank wants the customer to authenticate
  (`require_authentication_next`: 3-D Secure cannot happen off-session), HTTP 402 with a
  `card_error` (code card_declined / authentication_required) whose error carries the
  PaymentIntent, which stays `requires_payment_method` with `last_payment_error`
  (payment_intent.created, charge.failed, payment_intent.payment_failed). Stripe sends
  `payment_intent.requires_action` only on-session; an off-session confirm never leaves the
  PaymentIntent in `requires_action`.
- Adaptive Pricing: a Session records adaptive_pricing[enabled] (else the Dashboard's setting, off
  unless `localize(currency, rate)` turns it on); an enabled one is paid in that currency (the
  Session keeps its USD amount_total and gets presentment_details; the PaymentIntent, Charge,
  Refunds and Disputes are in the local currency). GET /v1/checkout/sessions?payment_intent= and
  GET /v1/refunds?charge=|payment_intent= list them, newest first.
- POST /v1/refunds {payment_intent, amount?}: a Refund (no more than what is left to refund),
  `succeeded` or, after `pend_refunds`, `pending`; the Charge's amount_refunded grows. Events:
  refund.created, charge.refunded. GET /v1/refunds/{id}. `fail_refund` (the card was closed: the
  money comes back to the merchant's balance): status `failed` with failure_reason, the Charge's
  amount_refunded shrinks back. Events: refund.updated, refund.failed, charge.refund.updated.
- `dispute` (the cardholder's bank disputes a succeeded payment; Stripe's API only reads disputes:
  GET /v1/disputes/{id}): a Dispute (`du_...`) of what is left of the charge (or `amount`: a part,
  or up to the charge's full amount after a partial refund, as banks sometimes dispute; a payment
  may be disputed again, each dispute its own object, as Stripe's multiple-disputes FAQ says), with
  its charge and payment_intent, the Charge `disputed`; GET /v1/disputes lists them (newest first),
  filtered by `payment_intent` or `charge`. A chargeback is `needs_response`, its
  amount and the dispute fee withdrawn at once (one balance transaction); events
  charge.dispute.created, charge.dispute.funds_withdrawn. An inquiry (`inquiry=True`: the bank asks
  first, as American Express and Discover do) is `warning_needs_response` and withdraws nothing:
  charge.dispute.created only. `escalate_dispute`: the inquiry becomes a chargeback, the same
  dispute (`needs_response`, funds withdrawn): charge.dispute.updated,
  charge.dispute.funds_withdrawn. `review_dispute` (evidence submitted): `under_review`
  (`warning_under_review`): charge.dispute.updated. `close_dispute(won=)`: a chargeback `won` (the
  amount reinstated: a second balance transaction; charge.dispute.closed,
  charge.dispute.funds_reinstated) or `lost` (charge.dispute.closed); `lost` with `reinstated=`:
  "partially won" (a full-amount dispute after a partial refund: the refunded part comes back, a
  second balance transaction, charge.dispute.funds_reinstated, the status still `lost`); an inquiry closes
  `warning_closed` (charge.dispute.closed).
- an invoice paid (`pay`): a succeeded USD PaymentIntent (no metadata: Stripe copies none of the
  invoice's) and its Charge for the amount paid, and the InvoicePayment (`inpay_...`, `paid`,
  `is_default`) that links them (since API 2025-03-31 the PaymentIntent and Charge name no
  invoice). `pay(parts=[...])` (partial payments): a PaymentIntent and an InvoicePayment per part,
  the first ones attached (POST /v1/invoices/{id}/attach_payment: `is_default` false), the last the
  default one; `payments_of` lists their PaymentIntents. Events: charge.succeeded, payment_intent.succeeded before invoice.paid. GET
  /v1/invoice_payments (newest first; filtered by `invoice`, `status`, `payment[type]` with
  `payment[payment_intent]`) and GET /v1/invoice_payments/{id}. `dispute` works on its payment.
- `payment(amount)`: a card payment made on the same Stripe account without Tollgate (no
  `tollgate_account` metadata), to dispute a charge that is not ours.
"""

from __future__ import annotations

import re
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from tests.fakes.stripe_server import FakeStripe, StripeFailure, _int, _metadata, missing, public

DECLINES = {
    "card_declined": ("insufficient_funds", "Your card has insufficient funds."),
    "authentication_required": ("authentication_required", "Your card was declined. This transaction requires authentication."),
}

# Dispute.Evidence's fields (the SDK's class); the fake stages none but a text in review_dispute
EVIDENCE_FIELDS = (
    "access_activity_log", "appeal", "billing_address", "cancellation_policy", "cancellation_policy_disclosure", "cancellation_rebuttal",
    "customer_communication", "customer_email_address", "customer_name", "customer_purchase_ip", "customer_signature",
    "duplicate_charge_documentation", "duplicate_charge_explanation", "duplicate_charge_id", "product_description", "receipt",
    "refund_policy", "refund_policy_disclosure", "refund_refusal_explanation", "service_date", "service_documentation",
    "shipping_address", "shipping_carrier", "shipping_date", "shipping_documentation", "shipping_tracking_number",
    "uncategorized_file", "uncategorized_text",
)


def _flag(params: dict[str, Any], name: str, *, default: bool) -> bool:
    """`name[enabled]` as the form encoding sends it (true/false), else `default`."""
    value = (params.get(name) or {}).get("enabled") if isinstance(params.get(name), dict) else None
    if value is None:
        return default
    if value not in ("true", "false"):
        raise StripeFailure(400, f"Invalid boolean: {value}", param=f"{name}[enabled]")
    return value == "true"


class FakeStripePayments(FakeStripe):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sessions: dict[str, dict[str, Any]] = {}
        self.payment_intents: dict[str, dict[str, Any]] = {}
        self.charges: dict[str, dict[str, Any]] = {}
        self.refunds: dict[str, dict[str, Any]] = {}
        self.disputes: dict[str, dict[str, Any]] = {}
        self.invoice_payments: dict[str, dict[str, Any]] = {}
        self.payment_methods: dict[str, str] = {}  # id -> customer it is attached to
        self._declines: list[str] = []  # error codes of the next off-session charges
        self._refund_status = "succeeded"
        # The Dashboard's Adaptive Pricing setting (off unless `localize` turns it on): a Session that
        # does not pass adaptive_pricing[enabled] takes it; an enabled one is paid in the customer's currency.
        self._local: tuple[str, int] | None = None
        self._arrived: threading.Event | None = None
        self._release: threading.Event | None = None

    # test helpers ------------------------------------------------------------------------------
    def complete_session(self, session_id: str, payment_method: str = "pm_card_visa", *, delayed: bool = False) -> list[dict[str, Any]]:
        """The customer pays on the hosted page: by card, or (`delayed`) by a bank debit that
        settles later (`settle_session`). Returns the flow's events."""
        with self._lock:
            session = self.sessions[session_id]
            assert session["status"] == "open", session["status"]
            if session["customer"] is None:
                session["customer"] = self._create_customer({"metadata": {}})["id"]
            data = session.pop("_payment_intent_data")
            pm = f"{payment_method}_{self._id('pm')}"
            if data.get("setup_future_usage"):
                self.payment_methods[pm] = session["customer"]
            amount, currency = session["amount_total"], session["currency"]
            if session["adaptive_pricing"]["enabled"] and self._local is not None:
                currency, rate = self._local
                amount = (amount * rate + 50) // 100
                session["presentment_details"] = {"presentment_amount": amount, "presentment_currency": currency}
            intent = self._intent(amount, currency, session["customer"], pm, _metadata(data), "processing" if delayed else "succeeded")
            intent["setup_future_usage"] = data.get("setup_future_usage")
            intent["payment_method_types"] = ["us_bank_account"] if delayed else ["card"]
            charge = self.charges[intent["latest_charge"]]
            session.update(status="complete", payment_status="unpaid" if delayed else "paid", payment_intent=intent["id"], url=None)
            created = self._event("payment_intent.created", {**intent, "status": "requires_payment_method", "latest_charge": None})
            if delayed:
                return [created, self._event("payment_intent.processing", intent), self._event("charge.pending", charge),
                        self._event("checkout.session.completed", session)]
            return [created, self._event("charge.succeeded", charge), self._event("payment_intent.succeeded", intent),
                    self._event("checkout.session.completed", session)]

    def settle_session(self, session_id: str, *, succeeded: bool) -> list[dict[str, Any]]:
        """The bank debit of a `delayed` Checkout payment settles (days later, on Stripe)."""
        with self._lock:
            session = self.sessions[session_id]
            intent = self.payment_intents[session["payment_intent"]]
            charge = self.charges[intent["latest_charge"]]
            assert intent["status"] == "processing", intent["status"]
            if succeeded:
                intent.update(status="succeeded", amount_received=intent["amount"])
                charge.update(status="succeeded", paid=True, captured=True, amount_captured=charge["amount"],
                              outcome=self._outcome(None))
                session["payment_status"] = "paid"
                return [self._event("charge.succeeded", charge), self._event("payment_intent.succeeded", intent),
                        self._event("checkout.session.async_payment_succeeded", session)]
            error = {"type": "invalid_request_error", "code": "payment_method_provider_decline", "decline_code": None,
                     "message": "The customer's bank account could not be debited.", "param": None,
                     "charge": charge["id"], "payment_method": {"id": intent["payment_method"], "object": "payment_method"}}
            intent.update(status="requires_payment_method", last_payment_error=error)
            charge.update(status="failed", failure_code="payment_method_provider_decline", failure_message=error["message"],
                          outcome=self._outcome("payment_method_provider_decline"))
            return [self._event("charge.failed", charge), self._event("payment_intent.payment_failed", intent),
                    self._event("checkout.session.async_payment_failed", session)]

    def localize(self, currency: str = "eur", per_100_usd_cents: int = 92) -> None:
        """Adaptive Pricing turned on in the Dashboard (docs.stripe.com, Adaptive Pricing: "Defaults to
        your dashboard setting"): a Checkout Session that does not turn it off is paid in `currency`,
        `per_100_usd_cents` of its minor units per 100 USD cents (the rate Stripe guarantees for the
        session). The Session keeps its USD amount_total with presentment_details; the PaymentIntent, its
        Charge and their Refunds and Disputes are in `currency` (the docs: "make sure any event
        destinations can handle PaymentIntent objects with local currencies")."""
        with self._lock:
            self._local = (currency, per_100_usd_cents)

    def pend_refunds(self, pending: bool = True) -> None:
        """New refunds stay `pending` (as bank refunds do) instead of succeeding at once."""
        with self._lock:
            self._refund_status = "pending" if pending else "succeeded"

    def fail_refund(self, refund_id: str, reason: str = "expired_or_canceled_card") -> list[dict[str, Any]]:
        """A refund fails after it was created (the card was closed): the money is back in the
        merchant's balance and the charge can be refunded again."""
        with self._lock:
            refund = self.refunds[refund_id]
            assert refund["status"] in ("pending", "succeeded"), refund["status"]
            refund.update(status="failed", failure_reason=reason, failure_balance_transaction=self._id("txn"))
            intent = self.payment_intents[refund["payment_intent"]]
            intent["_refunded"] -= refund["amount"]
            charge = self.charges[refund["charge"]]
            charge["amount_refunded"] -= refund["amount"]
            charge["refunded"] = False
            return [self._event("refund.updated", refund), self._event("refund.failed", refund),
                    self._event("charge.refund.updated", refund)]

    def refund(self, payment_intent: str, amount: int | None = None) -> list[dict[str, Any]]:
        """A refund made on Stripe's dashboard (POST /v1/refunds), and its events."""
        with self._lock:
            before = len(self.events)
            self._create_refund({"payment_intent": payment_intent, **({"amount": str(amount)} if amount is not None else {})})
            return self.events[before:]

    def _collect(self, invoice: dict[str, Any], amount: int, *, default: bool = True) -> None:
        """The card payment of an invoice (paid by the customer's card on file, or on its hosted page);
        not `default`: a PaymentIntent attached to it (a partial payment)."""
        if amount <= 0:  # nothing collected: Stripe makes no payment
            return
        intent = self._intent(amount, invoice["currency"], invoice["customer"], f"pm_card_visa_{self._id('pm')}", {})
        intent["description"] = "Payment for Invoice"
        now = int(time.time())
        link = {
            "id": self._id("inpay"), "object": "invoice_payment", "amount_paid": amount, "amount_requested": amount,
            "created": now, "currency": invoice["currency"], "invoice": invoice["id"], "is_default": default, "livemode": False,
            "payment": {"type": "payment_intent", "payment_intent": intent["id"]}, "status": "paid",
            "status_transitions": {"canceled_at": None, "paid_at": now},
        }
        self.invoice_payments[link["id"]] = link
        self._event("charge.succeeded", self.charges[intent["latest_charge"]])
        self._event("payment_intent.succeeded", intent)

    def payment_of(self, invoice_id: str) -> str:
        """The PaymentIntent that paid an invoice."""
        with self._lock:
            return next(str(p["payment"]["payment_intent"]) for p in reversed(self.invoice_payments.values())
                        if p["invoice"] == invoice_id and p["status"] == "paid")

    def payments_of(self, invoice_id: str) -> list[str]:
        """The PaymentIntents that paid an invoice, oldest first (several: partial payments)."""
        with self._lock:
            return [str(p["payment"]["payment_intent"]) for p in self.invoice_payments.values()
                    if p["invoice"] == invoice_id and p["status"] == "paid"]

    def payment(self, amount: int, metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """A succeeded card payment made on this Stripe account by something other than Tollgate."""
        with self._lock:
            customer = self._create_customer({"metadata": {}})["id"]
            return public(self._intent(amount, "usd", customer, f"pm_card_visa_{self._id('pm')}", dict(metadata or {})))

    def dispute(self, payment_intent: str, amount: int | None = None, reason: str = "fraudulent", *,
                inquiry: bool = False) -> list[dict[str, Any]]:
        """The cardholder's bank disputes the payment: a chargeback (funds withdrawn at once) or an
        inquiry (nothing withdrawn unless it escalates). Returns its events."""
        with self._lock:
            intent = self.payment_intents[payment_intent]
            charge = self.charges[intent["latest_charge"]]
            # A payment may be disputed more than once (support.stripe.com, "Receiving multiple disputes per
            # payment FAQ": partial disputes, a re-filed one, an Amex inquiry after a chargeback), each a Dispute of its own.
            assert charge["status"] == "succeeded", charge["status"]
            # What is left of the charge by default; a bank may dispute the full amount of a charge partly
            # refunded already (Stripe support: "Dispute for full charge amount after a partial refund").
            left = charge["amount_captured"] - charge["amount_refunded"]
            amount = left if amount is None else amount
            assert 0 < amount <= charge["amount_captured"], (amount, charge["amount_captured"])
            now = int(time.time())
            did = self._id("du")
            code = {"fraudulent": "10.4", "product_not_received": "13.1", "duplicate": "12.6.1"}.get(reason, "13.7")
            dispute = {
                "id": did, "object": "dispute", "amount": amount, "balance_transactions": [], "charge": charge["id"],
                "created": now, "currency": charge["currency"], "enhanced_eligibility_types": [],
                "evidence": {**dict.fromkeys(EVIDENCE_FIELDS), "enhanced_evidence": {}},
                "evidence_details": {"due_by": now + 7 * 86400, "enhanced_eligibility": {}, "has_evidence": False, "past_due": False,
                                     "submission_count": 0, "submission_method": "not_submitted"},
                "intended_submission_method": None, "is_charge_refundable": inquiry, "livemode": False, "metadata": {},
                "network_reason_code": code, "payment_intent": payment_intent,
                "payment_method_details": {"card": {"brand": "visa", "case_type": "inquiry" if inquiry else "chargeback",
                                                    "network": "visa", "network_reason_code": code}, "type": "card"},
                "reason": reason, "status": "warning_needs_response" if inquiry else "needs_response",
            }
            self.disputes[did] = dispute
            charge["disputed"] = True
            created = self._event("charge.dispute.created", dispute)
            return [created] if inquiry else [created, self._withdraw(dispute)]

    def escalate_dispute(self, dispute_id: str) -> list[dict[str, Any]]:
        """An inquiry becomes a chargeback: the same dispute, its funds withdrawn now."""
        with self._lock:
            dispute = self.disputes[dispute_id]
            assert dispute["status"] in ("warning_needs_response", "warning_under_review"), dispute["status"]
            dispute.update(status="needs_response", is_charge_refundable=False)
            dispute["payment_method_details"]["card"]["case_type"] = "chargeback"
            return [self._event("charge.dispute.updated", dispute), self._withdraw(dispute)]

    def review_dispute(self, dispute_id: str) -> list[dict[str, Any]]:
        """The merchant submitted evidence: the bank reviews it."""
        with self._lock:
            dispute = self.disputes[dispute_id]
            review = {"needs_response": "under_review", "warning_needs_response": "warning_under_review"}[dispute["status"]]
            dispute["evidence"]["uncategorized_text"] = "The customer bought prepaid API credit and used it."
            dispute["evidence_details"].update(has_evidence=True, submission_count=1, submission_method="manual")
            dispute["status"] = review
            return [self._event("charge.dispute.updated", dispute)]

    def close_dispute(self, dispute_id: str, won: bool, reinstated: int = 0) -> list[dict[str, Any]]:
        """The bank decides: a chargeback won (its amount reinstated) or lost; an inquiry just closes
        (`won` must be true: an inquiry is not lost, it escalates). `reinstated` on a lost one: a
        dispute of a charge's full amount after a partial refund, "partially won" (Stripe support):
        its status `lost`, the refunded part returned (a balance transaction, funds_reinstated)."""
        with self._lock:
            dispute = self.disputes[dispute_id]
            if dispute["status"].startswith("warning_"):
                assert won, "an inquiry is not lost: escalate_dispute first"
                dispute["status"] = "warning_closed"
                return [self._event("charge.dispute.closed", dispute)]
            assert dispute["status"] in ("needs_response", "under_review"), dispute["status"]
            assert not (won and reinstated) and 0 <= reinstated < dispute["amount"], (won, reinstated)
            dispute.update(status="won" if won else "lost")
            dispute["evidence_details"]["due_by"] = None
            back = dispute["amount"] if won else reinstated
            if not back:
                return [self._event("charge.dispute.closed", dispute)]
            dispute["balance_transactions"].append(self._dispute_transaction(dispute, back, 0, "Chargeback reversal"))
            return [self._event("charge.dispute.closed", dispute), self._event("charge.dispute.funds_reinstated", dispute)]

    def _withdraw(self, dispute: dict[str, Any]) -> dict[str, Any]:
        dispute["balance_transactions"].append(self._dispute_transaction(dispute, -dispute["amount"], 1500, "Chargeback withdrawal"))
        return self._event("charge.dispute.funds_withdrawn", dispute)

    def _dispute_transaction(self, dispute: dict[str, Any], amount: int, fee: int, what: str) -> dict[str, Any]:
        now = int(time.time())
        return {"id": self._id("txn"), "object": "balance_transaction", "amount": amount, "available_on": now,
                "balance_type": "payments", "created": now, "currency": dispute["currency"],
                "description": f"{what} for {dispute['charge']}", "exchange_rate": None, "fee": fee,
                "fee_details": [{"amount": fee, "application": None, "currency": dispute["currency"], "description": "Dispute fee",
                                 "type": "stripe_fee"}] if fee else [],
                "net": amount - fee, "reporting_category": "dispute" if amount < 0 else "dispute_reversal", "source": dispute["id"],
                "status": "available", "type": "adjustment"}

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
            self._declines += ["card_declined"] * times

    def require_authentication_next(self, times: int = 1) -> None:
        """The card's bank wants the customer to authenticate the next off-session charges."""
        with self._lock:
            self._declines += ["authentication_required"] * times

    def event_of(self, kind: str, object_id: str) -> dict[str, Any]:
        """The latest event of a kind about an object (what Stripe would deliver)."""
        return next(e for e in reversed(self.events) if e["type"] == kind and e["data"]["object"]["id"] == object_id)

    def events_about(self, *object_ids: str) -> list[dict[str, Any]]:
        """Every event so far whose object is one of these (a PaymentIntent's flow: it, its charge, its session)."""
        return [e for e in self.events if e["data"]["object"]["id"] in object_ids]

    # routes ------------------------------------------------------------------------------------
    def _route(self, method: str, path: str, params: dict[str, Any]) -> dict[str, Any]:
        routes = [
            ("POST", r"/v1/checkout/sessions", lambda p: self._create_session(p)),
            ("GET", r"/v1/checkout/sessions/(?P<id>[^/]+)", lambda p, id: public(self._get(self.sessions, "checkout.session", id))),
            ("GET", r"/v1/checkout/sessions", lambda p: self._list_public("/v1/checkout/sessions", self.sessions, p, ("payment_intent",))),
            ("POST", r"/v1/payment_intents", lambda p: self._create_intent(p)),
            ("GET", r"/v1/payment_intents/(?P<id>[^/]+)", lambda p, id: public(self._get(self.payment_intents, "payment_intent", id))),
            ("GET", r"/v1/charges/(?P<id>[^/]+)", lambda p, id: public(self._get(self.charges, "charge", id))),
            ("POST", r"/v1/refunds", lambda p: self._create_refund(p)),
            ("GET", r"/v1/refunds/(?P<id>[^/]+)", lambda p, id: public(self._get(self.refunds, "refund", id))),
            ("GET", r"/v1/refunds", lambda p: self._list_public("/v1/refunds", self.refunds, p, ("charge", "payment_intent"))),
            ("GET", r"/v1/disputes/(?P<id>[^/]+)", lambda p, id: public(self._get(self.disputes, "dispute", id))),
            ("GET", r"/v1/disputes", lambda p: self._list_disputes(p)),
            ("GET", r"/v1/invoice_payments/(?P<id>[^/]+)", lambda p, id: public(self._get(self.invoice_payments, "invoice_payment", id))),
            ("GET", r"/v1/invoice_payments", lambda p: self._list_invoice_payments(p)),
        ]
        for verb, pattern, handler in routes:
            match = re.fullmatch(pattern, path)
            if verb == method and match:
                return handler(params, **match.groupdict())  # type: ignore[no-any-return]
        return super()._route(method, path, params)

    def _list_disputes(self, params: dict[str, Any]) -> dict[str, Any]:
        """GET /v1/disputes, newest first, filtered by `charge` or `payment_intent` (Stripe's list takes both)."""
        return self._list_public("/v1/disputes", self.disputes, params, ("payment_intent", "charge"))

    def _list_invoice_payments(self, params: dict[str, Any]) -> dict[str, Any]:
        """GET /v1/invoice_payments, newest first: by `invoice`, `status`, and `payment[type]` with
        `payment[payment_intent]` (or `payment[payment_record]`, none here)."""
        payment = params.get("payment")
        if payment is not None:
            if not isinstance(payment, dict) or not payment.get("type"):
                raise StripeFailure(400, "Missing required param: payment[type].", param="payment[type]", code="parameter_missing")
            if payment["type"] not in ("payment_intent", "payment_record"):
                raise StripeFailure(400, "Invalid payment[type]: must be one of payment_intent or payment_record",
                                    param="payment[type]")
        status = params.get("status")
        if status is not None and status not in ("canceled", "open", "paid"):
            raise StripeFailure(400, "Invalid status: must be one of canceled, open, or paid", param="status")

        def matches(link: dict[str, Any]) -> bool:
            if status is not None and link["status"] != status:
                return False
            if payment is None:
                return True
            return link["payment"]["type"] == payment["type"] and all(
                link["payment"].get(k) == payment[k] for k in ("payment_intent", "payment_record") if k in payment)

        table = {k: v for k, v in self.invoice_payments.items() if matches(v)}
        return self._list_public("/v1/invoice_payments", table, {k: v for k, v in params.items() if k != "status"}, ("invoice",))

    def _list_public(self, url: str, table: dict[str, dict[str, Any]], params: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
        """A list, newest first, filtered by the first of `fields` the call passes (GET /v1/refunds takes
        `charge` or `payment_intent`, GET /v1/checkout/sessions `payment_intent`)."""
        field = next((f for f in fields if f in params), fields[0])
        found = self._list(url, table, params, field)
        return {**found, "data": [public(o) for o in found["data"]]}

    @staticmethod
    def _public(obj: dict[str, Any]) -> dict[str, Any]:
        return public(obj)

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
            "expires_at": now + 86400, "livemode": False, "payment_method_types": ["card"],
            "_payment_intent_data": params.get("payment_intent_data") or {},
            "adaptive_pricing": {"enabled": _flag(params, "adaptive_pricing", default=self._local is not None)},
            "presentment_details": None,
        }
        self.sessions[sid] = session
        return public(session)

    @staticmethod
    def _outcome(decline: str | None) -> dict[str, Any]:
        if decline is None:
            return {"type": "authorized", "network_status": "approved_by_network", "reason": None, "risk_level": "normal",
                    "seller_message": "Payment complete."}
        return {"type": "issuer_declined", "network_status": "declined_by_network", "reason": decline, "risk_level": "normal",
                "seller_message": "The bank did not return any further details with this decline."}

    def _intent(self, amount: int, currency: str, customer: str | None, pm: str | None, metadata: dict[str, str],
                status: str = "succeeded") -> dict[str, Any]:
        """A PaymentIntent after its confirmation, and the Charge that attempt made."""
        now = int(time.time())
        pid, cid = self._id("pi"), self._id("ch")
        succeeded = status == "succeeded"
        intent = {
            "id": pid, "object": "payment_intent", "amount": amount, "amount_capturable": 0,
            "amount_received": amount if succeeded else 0, "capture_method": "automatic_async",
            "client_secret": f"{pid}_secret_{self._id('s')[2:]}", "confirmation_method": "automatic", "currency": currency,
            "customer": customer, "description": None, "payment_method": pm, "payment_method_types": ["card"], "status": status,
            "metadata": metadata, "latest_charge": cid, "last_payment_error": None, "next_action": None,
            "setup_future_usage": None, "canceled_at": None, "cancellation_reason": None, "created": now, "livemode": False,
            "_refunded": 0,
        }
        self.payment_intents[pid] = intent
        self.charges[cid] = {
            "id": cid, "object": "charge", "amount": amount, "amount_captured": amount if succeeded else 0, "amount_refunded": 0,
            "balance_transaction": self._id("txn") if succeeded else None, "captured": succeeded, "created": now,
            "currency": currency, "customer": customer, "description": None, "disputed": False, "failure_code": None,
            "failure_message": None, "livemode": False, "metadata": dict(metadata),
            "outcome": self._outcome(None) if status != "processing" else None, "paid": succeeded, "payment_intent": pid,
            "payment_method": pm, "refunded": False,
            "status": {"succeeded": "succeeded", "processing": "pending"}.get(status, "failed"),
        }
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
        currency = params.get("currency") or "usd"
        if self._declines:
            code = self._declines.pop(0)
            decline, message = DECLINES[code]
            intent = self._intent(amount, currency, customer, pm, _metadata(params), "requires_payment_method")
            charge = self.charges[intent["latest_charge"]]
            charge.update(failure_code=code, failure_message=message, outcome=self._outcome(decline))
            error = {"type": "card_error", "code": code, "decline_code": decline, "message": message, "param": None,
                     "charge": charge["id"], "payment_method": {"id": pm, "object": "payment_method"}}
            intent["last_payment_error"] = error
            self._event("payment_intent.created", {**intent, "last_payment_error": None, "latest_charge": None})
            self._event("charge.failed", charge)
            self._event("payment_intent.payment_failed", intent)
            failure = StripeFailure(402, message, type_="card_error", code=code)
            failure.body["error"].update(decline_code=decline, charge=charge["id"], payment_intent=public(intent))
            raise failure
        intent = self._intent(amount, currency, customer, pm, _metadata(params))
        self._event("payment_intent.created", {**intent, "status": "requires_payment_method", "latest_charge": None})
        self._event("charge.succeeded", self.charges[intent["latest_charge"]])
        self._event("payment_intent.succeeded", intent)
        return public(intent)

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
        charge = self.charges[intent["latest_charge"]]
        charge["amount_refunded"] += amount
        charge["refunded"] = charge["amount_refunded"] == charge["amount_captured"]
        refund = {"id": self._id("re"), "object": "refund", "amount": amount, "currency": intent["currency"],
                  "charge": charge["id"], "payment_intent": pid, "status": self._refund_status, "reason": params.get("reason"),
                  "balance_transaction": self._id("txn"), "failure_balance_transaction": None, "failure_reason": None,
                  "description": None, "metadata": _metadata(params), "created": int(time.time())}
        self.refunds[refund["id"]] = refund
        self._event("refund.created", refund)
        self._event("charge.refunded", charge)
        return refund
