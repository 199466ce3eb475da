"""Stripe webhooks: verified on the raw body, deduplicated by event id, order-independent.

Stripe delivers at least once and in any order, so an event is only a hint: the handler re-reads
the invoice or subscription from Stripe and stores what Stripe says now, then re-derives the
account's state (billing.invoices.account_state). The event id is recorded in the same transaction as
the change, so a replay has no second effect and a failure leaves nothing half done (Stripe
retries it).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from stripe import InvalidRequestError, SignatureVerificationError, StripeClient

from billing.invoices.account_state import DELINQUENT_SUBSCRIPTION, recompute
from billing.invoices.models import BillingAccount, Invoice, StripeEvent
from billing.models import utcnow
from billing.stripe.sync import _plain, carried_too_small, carry_of, upsert

log = logging.getLogger("tollgate.webhooks")

INVOICES = Invoice.__table__
BILLING = BillingAccount.__table__
EVENTS = StripeEvent.__table__
INVOICE_EVENTS = ("invoice.paid", "invoice.payment_failed", "invoice.payment_succeeded", "invoice.voided",
                  "invoice.marked_uncollectible", "invoice.finalized", "invoice.updated", "invoice.overdue")
SUBSCRIPTION_EVENTS = ("customer.subscription.updated", "customer.subscription.deleted", "customer.subscription.created")


class WebhookRejected(ValueError):
    """The delivery is not a genuine Stripe event (bad signature or body): answer 400. `code`: which."""

    def __init__(self, message: str, code: str = "invalid_event") -> None:
        super().__init__(message)
        self.code = code


Apply = Callable[[AsyncConnection], Awaitable["int | None"]]


class WebhookHandler:
    def __init__(
        self,
        db: AsyncEngine,
        client: StripeClient,
        secret: str,
        *,
        grace_seconds: float,
        overdue: bool = False,
        on_change: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self._db = db
        self._stripe = client
        self._secret = secret
        self._grace = grace_seconds
        self._overdue = overdue  # unpaid invoices past their due date count (BillingConfig.sends_for_payment)
        self._on_change = on_change
        # Other event kinds (prepaid top-ups, billing/stripe/checkout.py): kind -> re-read -> apply in the event's transaction
        self.extra: dict[str, Callable[[dict[str, Any]], Awaitable[Apply | None]]] = {}
        self.after: list[Callable[[int], Awaitable[None]]] = []  # after the commit of a change to an account

    async def handle(self, payload: bytes, signature: str | None) -> dict[str, Any]:
        try:
            event = _plain(self._stripe.construct_event(payload, signature, self._secret))
        except SignatureVerificationError:
            raise WebhookRejected("Stripe signature verification failed.", "invalid_signature") from None
        # AttributeError: a signed JSON non-object; RecursionError: JSON nested past what the parser takes
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError, RecursionError):
            raise WebhookRejected("The body is not a Stripe event.") from None
        if not isinstance(event, dict):
            raise WebhookRejected("The body is not a Stripe event.")
        event_id, kind = event.get("id"), event.get("type")
        data = event.get("data")
        obj = data.get("object") if isinstance(data, dict) else None
        if not _name(event_id, 255) or not _name(kind, 128) or not isinstance(obj, dict):
            raise WebhookRejected("The event has no id, type or data.object.")
        if await self._seen(event_id):
            return {"received": True, "id": event_id, "duplicate": True}
        stamp = event.get("created") or 0  # Stripe's: a Unix time in seconds
        try:
            created = datetime.fromtimestamp(stamp, tz=timezone.utc) if type(stamp) is int else None
        except (ValueError, OverflowError, OSError):
            created = None
        if created is None:
            raise WebhookRejected("The event's created is not a Unix time.")
        apply = await self._reread(kind, obj, created)
        async with self._db.begin() as conn:
            row = dict(id=event_id, type=kind, created=created, processed_at=utcnow())
            inserted = await conn.execute(upsert(self._db, EVENTS).values(**row).on_conflict_do_nothing(index_elements=["id"]))
            if inserted.rowcount == 0:  # a concurrent delivery of the same event won
                return {"received": True, "id": event_id, "duplicate": True}
            account_id = await apply(conn) if apply is not None else None
            if account_id is not None:
                state = await recompute(conn, account_id, now=utcnow(), grace_seconds=self._grace, overdue=self._overdue)
        if account_id is not None and self._on_change is not None:
            await self._on_change(account_id)
        for hook in self.after if account_id is not None else []:
            await hook(account_id)
        result: dict[str, Any] = {"received": True, "id": event_id, "type": kind, "account_id": account_id}
        if account_id is not None:
            result["state"] = state
        return result

    async def _seen(self, event_id: str) -> bool:
        async with self._db.connect() as conn:
            return (await conn.execute(sa.select(EVENTS.c.id).where(EVENTS.c.id == event_id))).first() is not None

    async def _reread(self, kind: str, obj: dict[str, Any], created: datetime) -> Apply | None:
        """Fetches the object's current state from Stripe (network, before the transaction)."""
        object_id = obj.get("id")
        if not isinstance(object_id, str):
            return None
        try:
            if kind in INVOICE_EVENTS:
                invoice = _plain(await self._stripe.v1.invoices.retrieve_async(object_id))
                carried = await carried_too_small(self._stripe, invoice)  # paid with nothing paid: below the minimum charge?
                return lambda conn: apply_stripe_invoice(conn, invoice, created, carried=carried)
            if kind in SUBSCRIPTION_EVENTS:
                subscription = _plain(await self._stripe.v1.subscriptions.retrieve_async(object_id))
                return lambda conn: self._apply_subscription(conn, subscription, created)
            if kind in self.extra:
                return await self.extra[kind](obj)
        except InvalidRequestError as exc:
            if exc.http_status == 404:  # deleted on Stripe's side (e.g. a draft): nothing of ours to change
                return None
            raise
        return None

    async def _apply_subscription(self, conn: AsyncConnection, remote: dict[str, Any], created: datetime) -> int | None:
        customer = remote.get("customer")
        row = (await conn.execute(sa.select(BILLING).where(BILLING.c.stripe_customer_id == customer))).first()
        if row is None:
            return None
        status = remote.get("status")
        since = None
        if status in DELINQUENT_SUBSCRIPTION:
            since = row.subscription_delinquent_since or created
        await conn.execute(
            BILLING.update()
            .where(BILLING.c.account_id == row.account_id)
            .values(subscription_id=remote["id"], subscription_status=status, subscription_delinquent_since=since)
        )
        return int(row.account_id)


def _name(value: Any, longest: int) -> bool:
    """An event's id or type as Stripe writes them (`evt_...`, `invoice.paid`): printable ASCII, at
    most the column's length. Anything else is no Stripe event, never a database error."""
    return isinstance(value, str) and 0 < len(value) <= longest and value.isascii() and value.isprintable()


async def apply_stripe_invoice(conn: AsyncConnection, remote: dict[str, Any], created: datetime, *, carried: int = 0) -> int | None:
    """Stores what Stripe says of an invoice now (`remote`, re-read) on ours; the account changed, or
    None when it is none of ours. `created`: when Stripe said so (a payment's time when Stripe gives none).
    `carried`: what of it Stripe did not charge, below its minimum charge, and carried to the
    customer's next invoice (billing/stripe/sync.py carried_too_small): ours is paid, and says so."""
    ours = await _ours(conn, remote)
    if ours is None:
        log.info("Stripe invoice %s is none of ours", remote["id"])
        return None
    status = remote.get("status")
    values: dict[str, Any] = {"stripe_status": status, "stripe_invoice_id": remote["id"]}
    # ours stays void: a credit note for all of an open invoice takes its balance to 0, and Stripe
    # then marks it paid with nothing collected (docs.stripe.com/invoicing/dashboard/credit-notes)
    if status == "paid" and ours.status != "void":
        paid = (remote.get("status_transitions") or {}).get("paid_at")
        values.update(status="paid", paid_at=ours.paid_at or (datetime.fromtimestamp(paid, tz=timezone.utc) if paid else created))
    elif status == "void":
        values.update(status="void")
    elif status in ("open", "uncollectible") and (
        remote.get("attempted") or int(remote.get("attempt_count") or 0) > 0 or status == "uncollectible"
    ):
        values.update(payment_failed_at=ours.payment_failed_at or created)
    # What it carried out and collected of earlier carries, once finalized (a push whose answer was
    # lost has not recorded them; the next invoice's balance push reads them).
    values.update(carry_of(int(ours.credit_applied_cents or 0), remote, carried))
    await conn.execute(INVOICES.update().where(INVOICES.c.id == ours.id).values(**values))
    return int(ours.account_id)


async def _ours(conn: AsyncConnection, remote: dict[str, Any]) -> Any:
    """Our invoice that this Stripe invoice is: the one that stored its id; else (a push that made
    it and stopped before storing the id) the one its metadata names, when that one has no Stripe
    invoice yet and belongs to the remote's customer. Another Stripe invoice carrying our number
    (a copy made by hand, another customer's) changes nothing of ours."""
    ours = (await conn.execute(sa.select(INVOICES).where(INVOICES.c.stripe_invoice_id == remote["id"]))).first()
    number = (remote.get("metadata") or {}).get("tollgate_invoice")
    if ours is not None or not isinstance(number, str) or not number:
        return ours
    query = (
        sa.select(INVOICES)
        .join(BILLING, BILLING.c.account_id == INVOICES.c.account_id)
        .where(INVOICES.c.number == number, INVOICES.c.stripe_invoice_id.is_(None), BILLING.c.stripe_customer_id == remote.get("customer"))
    )
    return (await conn.execute(query)).first()
