"""Stripe top-ups of prepaid credit: Checkout Sessions, their webhooks, refunds and auto-recharge.

    create_session(account, cents)   a Checkout Session (mode=payment) for that amount; the hosted page's URL
    checkout.session.completed       paid -> one `topup` credit row, external_id = the session id; the first
                                     time only, its card is saved for auto-recharge, unless its payment was
                                     charged back already (a dispute heard first): then the card is stopped
                                     as the dispute would have stopped it (GET /v1/disputes?payment_intent=)
    refund.created/updated           -> one `refund` row (negative), external_id = the refund id
    refund.failed (or canceled)      -> that row, and one that gives it back (external_id `<refund id>:failed`)
    charge.refunded, charge.refund.updated   the same rows, for every refund of the charge (an endpoint on an
                                     API version before 2024-10-28 gets only these for a card's refunds)
    a payment in another currency    (a session from before Checkout turned Adaptive Pricing off, with the
                                     Dashboard's setting on): a refund or dispute debits the same share of
                                     the USD its Session credited, never its local amount as if it were cents
    charge.dispute.*                 a chargeback on a top-up's or recharge's charge (created, updated, closed,
                                     funds_withdrawn, funds_reinstated: all alike; the Dispute is re-read and its
                                     status decides): funds withdrawn -> one negative `refund` row, external_id =
                                     the dispute id, reason `Stripe dispute (<reason>)`; the saved card is dropped
                                     (no off-session charge until a Checkout saves one). `won` -> also one row
                                     giving it back (external_id `<dispute id>:won`); `lost` -> the debit stays,
                                     but for what came back ("partially won": a dispute of a charge's
                                     full amount after a partial refund): the balance transactions of
                                     the dispute say what was withdrawn and reinstated (_dispute_money).
                                     An inquiry (`warning_*`: the bank asks, nothing is withdrawn) and a
                                     `prevented` one write nothing, unless it escalates to a chargeback
                                     On the payment of one of our invoices (no tollgate_account: found by
                                     its InvoicePayment) the invoice is charged back: what the dispute took
                                     back (withdrawn less reinstated) is owed again, per dispute, until won
                                     or settled (billing/stripe/invoice_disputes.py)
    recharge_due()                   balance below the account's threshold -> one off-session PaymentIntent
                                     (at most one in flight: a conditional update claims it), credited by its
                                     id; a decline leaves recharge_state `failed` with Stripe's message; a
                                     charge whose answer was lost (network, 5xx) is sent again, with the same
                                     idempotency key and parameters, RESEND_AFTER later, until the key
                                     may have expired at Stripe (RESEND_WITHIN): then it is `failed` for a person
    payment_intent.succeeded/failed  the same outcome for a recharge, when it arrives by webhook

Webhooks are hints (billing/stripe/webhooks.py): each object is re-read from Stripe, and the credit row
is written in the same transaction that records the event id, so a repeat of the event, or
another event about the same session, refund or dispute, credits nothing more (the unique external_id),
and events in any order end at the same rows.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from stripe import CardError, IdempotencyError, StripeClient

from billing.credits.models import CreditEntry, CreditSettings
from billing.credits.balance import CreditBook, CreditError
from billing.models import utcnow
from billing.stripe.invoice_disputes import chargeback, invoices_paid_by
from billing.stripe.sync import _plain, upsert

log = logging.getLogger("tollgate.checkout")
CREDITS = CreditEntry.__table__
SETTINGS = CreditSettings.__table__
NANOS_PER_CENT = 10_000_000
MIN_CENTS = 50  # Stripe's minimum charge in USD
MAX_CENTS = 99_999_999  # Stripe's maximum amount for USD
# A recharge claim still `pending` with no PaymentIntent id this long after it was made: its create got
# no answer (a connection error after the SDK's retries, a 5xx), and no webhook settled it. recharge_due
# sends the same create again, same idempotency key: Stripe answers with the intent it stored, or makes it.
RESEND_AFTER = timedelta(minutes=5)
# Stripe may prune an idempotency key once it is 24 hours old; after that the same key could charge
# again. The key is younger than its claim, and an hour is kept as a margin: older claims go to a person.
RESEND_WITHIN = timedelta(hours=23)

# Dispute statuses with no money taken from us (docs.stripe.com/disputes/how-disputes-work): an inquiry
# (warning_*: the bank asks first; it escalates to needs_response, the same dispute, if it becomes a
# chargeback) and `prevented` (stopped before a chargeback was filed; a refund that prevented it is a
# Refund of its own, debited by its own events). Every other status, also one Stripe adds later, means the
# disputed amount was withdrawn: needs_response, under_review, the appeal_* ones, won (and then given
# back), lost.
NOTHING_WITHDRAWN = ("warning_needs_response", "warning_under_review", "warning_closed", "prevented")
# The ledger's kinds (billing/credits/models.py CREDIT_KINDS) have no `dispute`: a chargeback is money
# that went back to the customer's bank like a refund; its reason and external_id (`du_...`) tell them apart.
DISPUTE_KIND = "refund"
CARD_STOPPED = "auto-recharge stopped after a chargeback, no saved card is charged:"  # recharge_error until a Checkout saves one

Apply = Callable[[AsyncConnection], Awaitable["int | None"]]


async def insert_credit(conn: AsyncConnection, engine: AsyncEngine, account_id: int, kind: str, nanos: int, external_id: str,
                        reason: str) -> bool:
    """One credit row inside the caller's transaction; False when `external_id` is already there."""
    done = await conn.execute(upsert(engine, CREDITS).values(
        account_id=account_id, kind=kind, amount_nanos=nanos, external_id=external_id, reason=reason, created_at=utcnow(),
    ).on_conflict_do_nothing(index_elements=["external_id"]))
    return bool(done.rowcount)


def _dispute_reason(dispute: dict[str, Any]) -> str:
    return f"Stripe dispute ({dispute.get('reason') or 'no reason given'})"


def _dispute_money(dispute: dict[str, Any]) -> tuple[int, int]:
    """(withdrawn, reinstated) by a dispute that took money, in minor units of its currency (cents in
    USD; _as_credited turns another currency into the credit it reverses). Its balance transactions say
    what moved, when they are in its currency: a bank may dispute a charge's full amount after a
    partial refund, and such a dispute "partially won" is `lost` with the refunded part reinstated
    (support.stripe.com, "Dispute for full charge amount after a partial refund was issued").
    Otherwise (none yet, or converted into another settlement currency) its amount, all of it
    reinstated when `won`."""
    won = dispute.get("status") == "won"
    moved = dispute.get("balance_transactions") or []
    if moved and all(isinstance(t, dict) and t.get("currency") == dispute.get("currency") and isinstance(t.get("amount"), int)
                     for t in moved):
        withdrawn = -sum(t["amount"] for t in moved if t["amount"] < 0)
        if withdrawn:
            return withdrawn, sum(t["amount"] for t in moved if t["amount"] > 0) or (withdrawn if won else 0)
    amount = int(dispute["amount"])
    return amount, amount if won else 0


def _card_stopped(reason: str, intent_id: str) -> str:
    return f"{CARD_STOPPED} {reason} on {intent_id}; a top-up by Checkout saves a card again"


def _account_of(obj: dict[str, Any]) -> int | None:
    raw = (obj.get("metadata") or {}).get("tollgate_account")
    return int(raw) if isinstance(raw, str) and raw.isdigit() else None


class CheckoutService:
    def __init__(self, db: AsyncEngine, client: StripeClient, credits: CreditBook) -> None:
        self._db = db
        self._stripe = client
        self._credits = credits

    # sessions ----------------------------------------------------------------------------------
    async def create_session(self, account_id: int, cents: int, *, success_url: str, cancel_url: str) -> dict[str, Any]:
        if not MIN_CENTS <= cents <= MAX_CENTS:
            raise CreditError(f"amount must be between $0.50 and ${MAX_CENTS // 100:,}.99", "amount")
        settings = await self.settings(account_id)
        params: dict[str, Any] = {
            "mode": "payment",
            "line_items": [{"quantity": 1, "price_data": {"currency": "usd", "unit_amount": cents,
                                                          "product_data": {"name": "Tollgate prepaid credit"}}}],
            "metadata": {"tollgate_account": str(account_id)},
            # the card is saved for auto-recharge; the PaymentIntent carries the account for refunds
            "payment_intent_data": {"metadata": {"tollgate_account": str(account_id)}, "setup_future_usage": "off_session"},
            "client_reference_id": str(account_id),
            # Charged in USD, what the credit is counted in: Adaptive Pricing (the Dashboard's setting
            # unless a session says) would charge the customer's currency, and the payment's refunds
            # and disputes would come in it too.
            "adaptive_pricing": {"enabled": False},
            "success_url": success_url,
            "cancel_url": cancel_url,
        }
        if settings.get("stripe_customer_id"):
            params["customer"] = settings["stripe_customer_id"]
        else:
            params["customer_creation"] = "always"
        session = _plain(await self._stripe.v1.checkout.sessions.create_async(
            params, {"idempotency_key": f"tollgate-checkout-{account_id}-{uuid.uuid4().hex}"}))  # type: ignore[arg-type]
        return {"object": "checkout_session", "id": session["id"], "url": session["url"], "amount_cents": cents,
                "status": session["status"]}

    async def settings(self, account_id: int) -> dict[str, Any]:
        async with self._db.connect() as conn:
            row = (await conn.execute(sa.select(SETTINGS).where(SETTINGS.c.account_id == account_id))).first()
        if row is None:
            return {"account_id": account_id, "recharge_state": "idle"}
        return {k: v for k, v in row._mapping.items() if k != "updated_at"}

    async def set_recharge(self, account_id: int, below_nanos: int | None, amount_cents: int | None) -> dict[str, Any]:
        """Sets (or with None, turns off) auto-recharge; also clears a failed state (not a chargeback's stop)."""
        if (below_nanos is None) != (amount_cents is None):
            raise CreditError("give both recharge_below and recharge_amount, or neither", "recharge_amount")
        if amount_cents is not None and not MIN_CENTS <= amount_cents <= MAX_CENTS:
            raise CreditError("recharge_amount must be between $0.50 and $999,999.99", "recharge_amount")
        async with self._db.begin() as conn:
            # a chargeback's stop stays until a Checkout saves a card (the reason no charge comes)
            stopped = (await conn.execute(sa.select(SETTINGS.c.recharge_error).where(
                SETTINGS.c.account_id == account_id, SETTINGS.c.payment_method_id.is_(None),
                SETTINGS.c.recharge_error.startswith(CARD_STOPPED)))).scalar_one_or_none()
            await self._upsert(conn, account_id, recharge_below_nanos=below_nanos, recharge_amount_cents=amount_cents,
                               recharge_error=stopped, reset_state=True)
        return await self.settings(account_id)

    async def _upsert(self, conn: AsyncConnection, account_id: int, *, reset_state: bool = False, **values: Any) -> None:
        """Inserts or updates an account's settings. A pending claim is never touched: its charge may
        have been made at Stripe (its answer lost, or its webhook not yet here), and only its outcome
        ends it; forgetting it would let the next round charge the card again. `reset_state`: a
        `failed` state goes back to `idle`."""
        now = utcnow()
        pending = SETTINGS.c.recharge_state == "pending"
        changes: dict[str, Any] = {**values, "updated_at": sa.case((pending, SETTINGS.c.updated_at),  # a claim's age is its claim's
                                                                    else_=sa.literal(now, SETTINGS.c.updated_at.type))}
        if reset_state:
            changes["recharge_state"] = sa.case((pending, SETTINGS.c.recharge_state), else_=sa.literal("idle"))
            changes["recharge_error"] = sa.case((pending, SETTINGS.c.recharge_error),
                                                else_=sa.literal(values.get("recharge_error"), SETTINGS.c.recharge_error.type))
        await conn.execute(upsert(self._db, SETTINGS).values(account_id=account_id, **values, updated_at=now)
                           .on_conflict_do_update(index_elements=["account_id"], set_=changes))

    # webhooks ----------------------------------------------------------------------------------
    def webhook_handlers(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[Apply | None]]]:
        return {
            "checkout.session.completed": self._session_completed,
            "checkout.session.async_payment_succeeded": self._session_completed,
            "refund.created": self._refund,
            "refund.updated": self._refund,
            "refund.failed": self._refund,
            # A webhook endpoint on an API version before 2024-10-28 hears of a card's refunds only
            # through these (refund.* came for them from that version on): the same rows, by refund id.
            "charge.refunded": self._charge_refunded,
            "charge.refund.updated": self._refund,
            "charge.dispute.created": self._dispute,
            "charge.dispute.updated": self._dispute,
            "charge.dispute.closed": self._dispute,
            "charge.dispute.funds_withdrawn": self._dispute,
            "charge.dispute.funds_reinstated": self._dispute,
            "payment_intent.succeeded": self._intent_event,
            "payment_intent.payment_failed": self._intent_event,
        }

    async def _session_completed(self, obj: dict[str, Any]) -> Apply | None:
        session = _plain(await self._stripe.v1.checkout.sessions.retrieve_async(obj["id"]))
        account_id = _account_of(session)
        if account_id is None or session.get("mode") != "payment" or session.get("payment_status") != "paid":
            return None  # not ours, or not paid yet (async payment methods complete later)
        intent = _plain(await self._stripe.v1.payment_intents.retrieve_async(session["payment_intent"]))
        card = intent.get("payment_method") if intent.get("setup_future_usage") else None
        # A chargeback can be heard before its payment's Checkout (webhooks come in any order, a
        # session's can be retried for days): its card is not saved then, as if the dispute came after.
        charged_back = await self._charged_back(intent["id"]) if card else None

        async def apply(conn: AsyncConnection) -> int | None:
            if not await insert_credit(conn, self._db, account_id, "topup", int(session["amount_total"]) * NANOS_PER_CENT,
                                       session["id"], "Stripe Checkout"):
                return account_id  # applied before: a late repeat saves no card (a newer one, or none after a dispute, stays)
            if charged_back is not None:
                await self._upsert(conn, account_id, stripe_customer_id=session.get("customer"), payment_method_id=None,
                                   recharge_error=_card_stopped(charged_back, intent["id"]))
                return account_id
            await self._upsert(conn, account_id, stripe_customer_id=session.get("customer"), payment_method_id=card)
            if card:  # a card saved again after a dispute stopped the last one
                await conn.execute(SETTINGS.update().where(SETTINGS.c.account_id == account_id,
                                                           SETTINGS.c.recharge_error.startswith(CARD_STOPPED)).values(recharge_error=None))
            return account_id

        return apply

    async def _charged_back(self, intent_id: str) -> str | None:
        """The reason (as the dispute's rows give it) of a chargeback on this payment, or None: an
        inquiry, or a `prevented` dispute, takes no money and stops no card."""
        found = _plain(await self._stripe.v1.disputes.list_async({"payment_intent": intent_id, "limit": 100}))
        for dispute in found.get("data") or []:
            if isinstance(dispute.get("status"), str) and dispute["status"] not in NOTHING_WITHDRAWN:
                return _dispute_reason(dispute)
        return None

    async def _refund(self, obj: dict[str, Any]) -> Apply | None:
        refund = _plain(await self._stripe.v1.refunds.retrieve_async(obj["id"]))
        if not refund.get("payment_intent"):
            return None
        intent = _plain(await self._stripe.v1.payment_intents.retrieve_async(refund["payment_intent"]))
        return await self._refunds_of(intent, [refund])

    async def _charge_refunded(self, obj: dict[str, Any]) -> Apply | None:
        """charge.refunded: every refund of the charge, each as its own refund.* event would have it."""
        charge = _plain(await self._stripe.v1.charges.retrieve_async(obj["id"]))
        if not charge.get("payment_intent"):
            return None  # a charge made without a PaymentIntent: none of ours
        intent = _plain(await self._stripe.v1.payment_intents.retrieve_async(charge["payment_intent"]))
        if _account_of(intent) is None:
            return None
        refunds = _plain(await self._stripe.v1.refunds.list_async({"charge": charge["id"], "limit": 100}))
        return await self._refunds_of(intent, refunds.get("data") or [])

    async def _refunds_of(self, intent: dict[str, Any], refunds: list[dict[str, Any]]) -> Apply | None:
        """The rows of a payment's refunds: each debits what it gives back (external_id: its id), and
        one that failed or was canceled gives that back again (the money stayed with us)."""
        account_id = _account_of(intent)
        if account_id is None:
            return None
        moved = [r for r in refunds if r.get("status") in ("succeeded", "pending", "failed", "canceled")]  # requires_action: nothing yet
        rows = []
        for refund in moved:
            nanos = await self._as_credited(intent, int(refund["amount"]), str(refund.get("currency") or "usd"), refund["id"])
            if nanos is not None:
                rows.append((refund, nanos))
        if not rows:
            return None

        async def apply(conn: AsyncConnection) -> int | None:
            for refund, nanos in rows:
                await insert_credit(conn, self._db, account_id, "refund", -nanos, refund["id"], "Stripe refund")
                if refund["status"] in ("failed", "canceled"):  # given back, whichever event came first
                    await insert_credit(conn, self._db, account_id, "refund", nanos, f"{refund['id']}:failed",
                                        f"Stripe refund {refund['status']}: {refund.get('failure_reason') or 'no reason given'}")
            return account_id

        return apply

    async def _as_credited(self, intent: dict[str, Any], amount: int, currency: str, what: str) -> int | None:
        """Nano-USD of the credit that `amount` (minor units of `currency`) of this payment gives back.
        In USD, its cents. In another currency (a top-up paid before Checkout Sessions turned Adaptive
        Pricing off, the Dashboard's setting on): the same share of what its Session credited in USD,
        so a full refund takes back the whole top-up at the rate it was paid at. None, logged for a
        person, when no Session of it says."""
        if currency == "usd":
            return amount * NANOS_PER_CENT
        found = _plain(await self._stripe.v1.checkout.sessions.list_async({"payment_intent": intent["id"], "limit": 1}))
        session = next(iter(found.get("data") or []), None)
        paid = int(intent.get("amount_received") or intent.get("amount") or 0)
        if session is None or session.get("currency") != "usd" or intent.get("currency") != currency or paid <= 0:
            log.error("%s: %d %s of payment %s not debited: no USD Checkout Session of it says what it credited; "
                      "debit the account by hand", what, amount, currency, intent["id"])
            return None
        return amount * int(session["amount_total"]) * NANOS_PER_CENT // paid

    async def _dispute(self, obj: dict[str, Any]) -> Apply | None:
        """Every charge.dispute.* event alike: what the Dispute's status says now decides, so the
        events in any order, or repeated, end at the same rows."""
        dispute = _plain(await self._stripe.v1.disputes.retrieve_async(obj["id"]))
        status = dispute.get("status")
        if not isinstance(status, str) or status in NOTHING_WITHDRAWN:
            return None
        intent_id = dispute.get("payment_intent")
        if not intent_id and dispute.get("charge"):  # null for a charge made without a PaymentIntent (none of ours)
            intent_id = _plain(await self._stripe.v1.charges.retrieve_async(dispute["charge"])).get("payment_intent")
        if not isinstance(intent_id, str) or not intent_id:
            return None
        intent = _plain(await self._stripe.v1.payment_intents.retrieve_async(intent_id))
        account_id = _account_of(intent)
        if account_id is None:  # not a top-up: maybe the payment of one of our invoices (what the dispute took back of it)
            return chargeback(dispute, await invoices_paid_by(self._stripe, intent_id), *_dispute_money(dispute))
        reason = _dispute_reason(dispute)
        currency = str(dispute.get("currency") or "usd")
        withdrawn, reinstated = _dispute_money(dispute)
        withdrawn_nanos = await self._as_credited(intent, withdrawn, currency, dispute["id"])
        reinstated_nanos = await self._as_credited(intent, reinstated, currency, dispute["id"]) if reinstated else 0
        if withdrawn_nanos is None or reinstated_nanos is None:
            return None

        async def apply(conn: AsyncConnection) -> int | None:
            taken = await insert_credit(conn, self._db, account_id, DISPUTE_KIND, -withdrawn_nanos, dispute["id"], reason)
            if reinstated:  # funds came back: at most what was debited (its row may be from an earlier event)
                debit = (await conn.execute(sa.select(CREDITS.c.amount_nanos).where(CREDITS.c.external_id == dispute["id"]))).scalar_one()
                back = min(-int(debit), reinstated_nanos)
                cents = back // NANOS_PER_CENT
                outcome = "won: funds reinstated" if status == "won" else f"partially won: ${cents // 100}.{cents % 100:02d} reinstated"
                await insert_credit(conn, self._db, account_id, DISPUTE_KIND, back, f"{dispute['id']}:won", f"{reason} {outcome}")
            if taken:
                # No off-session charge after a chargeback, also one first heard of already won (as when its
                # events come in order): the next one would likely be disputed too (another fee), and the
                # same card saved by a later Checkout has another PaymentMethod id. Auto-recharge stops
                # until the customer pays by Checkout again, which saves the card it used.
                await conn.execute(SETTINGS.update().where(SETTINGS.c.account_id == account_id, SETTINGS.c.payment_method_id.is_not(None))
                                   .values(payment_method_id=None, recharge_error=_card_stopped(reason, intent_id)))  # updated_at: a pending claim's time stays
            return account_id

        return apply

    async def _intent_event(self, obj: dict[str, Any]) -> Apply | None:
        intent = _plain(await self._stripe.v1.payment_intents.retrieve_async(obj["id"]))
        account_id = _account_of(intent)
        if account_id is None or not (intent.get("metadata") or {}).get("tollgate_recharge"):
            return None  # a Checkout payment: credited by its session

        async def apply(conn: AsyncConnection) -> int | None:
            await self._recharge_outcome(conn, account_id, intent)
            return account_id

        return apply

    async def _recharge_outcome(self, conn: AsyncConnection, account_id: int, intent: dict[str, Any]) -> None:
        # The account's pending charge is this intent, also when Stripe's answer to the charge was lost
        # (its id never stored): the attempt number in its metadata names the claim it was made for.
        attempt = str((intent.get("metadata") or {}).get("tollgate_recharge") or "")
        claim = sa.and_(SETTINGS.c.recharge_state == "pending", SETTINGS.c.recharge_count == int(attempt)) if attempt.isdigit() else sa.false()
        mine = sa.and_(SETTINGS.c.account_id == account_id, sa.or_(SETTINGS.c.recharge_payment_intent == intent["id"], claim))
        if intent.get("status") == "succeeded":
            await insert_credit(conn, self._db, account_id, "topup", int(intent["amount_received"]) * NANOS_PER_CENT, intent["id"],
                                "auto-recharge")
            await conn.execute(SETTINGS.update().where(mine).values(
                recharge_state="idle", recharge_error=None, recharge_payment_intent=intent["id"], updated_at=utcnow()))
        elif intent.get("status") in ("requires_payment_method", "canceled"):
            error = (intent.get("last_payment_error") or {}).get("message") or intent.get("status")
            await conn.execute(SETTINGS.update().where(mine, SETTINGS.c.recharge_state == "pending").values(  # not after a reset
                recharge_state="failed", recharge_error=f"auto-recharge declined: {error}", recharge_payment_intent=intent["id"],
                updated_at=utcnow()))

    # auto-recharge -----------------------------------------------------------------------------
    async def recharge_due(self, now: datetime | None = None) -> list[int]:
        """Charges, off-session, every account below its threshold that has no charge in flight, and
        sends again each charge whose answer from Stripe was lost (RESEND_AFTER)."""
        now = now or utcnow()
        async with self._db.connect() as conn:
            lost = (await conn.execute(sa.select(SETTINGS).where(
                SETTINGS.c.recharge_state == "pending", SETTINGS.c.recharge_payment_intent.is_(None),
                SETTINGS.c.updated_at <= now - RESEND_AFTER))).all()
            rows = (await conn.execute(sa.select(SETTINGS).where(
                SETTINGS.c.recharge_below_nanos.is_not(None), SETTINGS.c.payment_method_id.is_not(None),
                SETTINGS.c.recharge_state == "idle"))).all()
        charged = []
        for row in lost:
            if await self._resend(row, now):
                charged.append(int(row.account_id))
        for row in rows:
            balance = await self._credits.balance(row.account_id)
            if balance is None or balance["billing_mode"] != "prepaid" or balance["balance_nanos"] >= row.recharge_below_nanos:
                continue
            if await self._charge(row):
                charged.append(int(row.account_id))
        return charged

    async def _charge(self, row: Any) -> bool:
        attempt = int(row.recharge_count) + 1
        async with self._db.begin() as conn:  # the claim: one instance, one charge in flight
            claimed = await conn.execute(SETTINGS.update().where(
                SETTINGS.c.account_id == row.account_id, SETTINGS.c.recharge_state == "idle",
                SETTINGS.c.recharge_count == row.recharge_count,
            ).values(recharge_state="pending", recharge_count=attempt, recharge_error=None, recharge_payment_intent=None,
                     recharge_claim_cents=row.recharge_amount_cents, updated_at=utcnow()))
            if claimed.rowcount != 1:
                return False
        return await self._send(row, attempt, int(row.recharge_amount_cents))

    async def _resend(self, row: Any, now: datetime) -> bool:
        """The create of a claim that got no answer, again: same key, same parameters."""
        attempt = int(row.recharge_count)
        if row.updated_at > now - RESEND_WITHIN:
            log.warning("auto-recharge %s of account %s got no answer from Stripe: sending it again", attempt, row.account_id)
            # the claim's own amount: the settings may have changed since, and a create sent again
            # must carry the parameters its key was first sent with
            return await self._send(row, attempt, int(row.recharge_claim_cents or row.recharge_amount_cents))
        await self._give_up(row.account_id, attempt, "its charge got no answer from Stripe and is too old to send again "
                                                     "safely (Stripe keeps idempotency keys 24 hours)")
        return False

    async def _give_up(self, account_id: int, attempt: int, why: str) -> None:
        async with self._db.begin() as conn:
            await conn.execute(SETTINGS.update().where(
                SETTINGS.c.account_id == account_id, SETTINGS.c.recharge_state == "pending", SETTINGS.c.recharge_count == attempt,
                SETTINGS.c.recharge_payment_intent.is_(None),
            ).values(recharge_state="failed", updated_at=utcnow(), recharge_error=(
                f"auto-recharge {attempt} needs a person: {why}. Look in the Stripe dashboard for a PaymentIntent with "
                f"metadata tollgate_recharge={attempt} (tollgate_account={account_id}); if one succeeded and is not in the "
                f"credit ledger (external_id = its id), credit it, then set auto-recharge again")))
        log.error("auto-recharge %s of account %s: %s; marked failed", attempt, account_id, why)

    async def _send(self, row: Any, attempt: int, cents: int) -> bool:
        """The off-session charge of claim `attempt` and its outcome; its key and parameters depend only on the claim."""
        params = {"amount": cents, "currency": "usd", "customer": row.stripe_customer_id,
                  "payment_method": row.payment_method_id, "off_session": True, "confirm": True,
                  "metadata": {"tollgate_account": str(row.account_id), "tollgate_recharge": str(attempt)}}
        this_claim = sa.and_(SETTINGS.c.account_id == row.account_id, SETTINGS.c.recharge_count == attempt)
        try:
            intent = _plain(await self._stripe.v1.payment_intents.create_async(
                params, {"idempotency_key": f"tollgate-recharge-{row.account_id}-{attempt}"}))  # type: ignore[arg-type]
        except CardError as exc:
            intent = dict((exc.json_body or {}).get("error", {}).get("payment_intent") or {})
            message = exc.user_message or str(exc)
            async with self._db.begin() as conn:
                await conn.execute(SETTINGS.update().where(this_claim, SETTINGS.c.recharge_state == "pending").values(
                    recharge_state="failed", recharge_payment_intent=intent.get("id"),
                    recharge_error=f"auto-recharge declined: {message}", updated_at=utcnow()))
            log.warning("auto-recharge of account %s declined", row.account_id)
            return False
        except IdempotencyError:
            # the account's card or customer changed since the first send: this key cannot be answered
            await self._give_up(row.account_id, attempt, "its payment details changed before Stripe's answer to the charge came")
            return False
        except Exception:
            # Unknown outcome (network, 5xx): stays pending; its webhook settles it, or recharge_due sends it again.
            log.warning("auto-recharge of account %s: no answer from Stripe; waiting for its webhook", row.account_id)
            return False
        async with self._db.begin() as conn:
            await conn.execute(SETTINGS.update().where(this_claim).values(recharge_payment_intent=intent["id"]))
            await self._recharge_outcome(conn, int(row.account_id), intent)
        await self._credits.sync_recent()
        return intent.get("status") == "succeeded"
