"""Pushing closed invoices to Stripe with the official SDK (`StripeClient`).

    account  -> Stripe customer (created on demand; id stored) with the billing details' name,
                email, address and tax id, brought up to date on every push
    invoice  -> draft Stripe invoice (id stored) -> one invoice item per line (ids stored)
             -> the tax line as manual tax amounts on the lines (our tax, computed once on the
                subtotal, shared over the lines so they sum to it exactly)
             -> total compared with ours -> the customer's balance made to apply exactly our
                credit_applied_cents -> finalized -> sent (per config) -> total compared again
    credit note -> a Stripe credit note on the invoice: pre-payment while it is open, else to the
                customer's balance (which Stripe applies to the next invoice); one that has not
                reached Stripe goes with the next push of its invoice or push_pending, whatever our
                invoice's status is now (a void or paid one included)

The customer's balance. Invoices go to Stripe gross (our total); the credit our invoice applied
(`credit_applied_cents`, from credit notes: billing/invoices/documents.py) reaches it as Stripe's
customer balance, which Stripe applies, all of it up to the total, to the next invoice it finalizes
(`starting_balance` / `ending_balance`). So every invoice with something to collect goes to Stripe,
one our balance paid in full included (ours is `paid` at once; Stripe's finalize takes the credit
and marks it paid), and right before finalizing, the push reads the customer's balance: if Stripe
would apply anything but our credit_applied_cents (a credit note still on its way, one posted
after our invoice was made, a balance left by earlier drift), one customer balance transaction
sets it to exactly that credit, so the two sides apply the same credit, each once. A debit on the
customer (an amount Stripe itself carried over) is left for Stripe to collect: the balance Stripe
must hold is the debit it carried and has not collected (ours: carried_to_next_cents less
carried_in_cents) less our credit, so a credit note Stripe already netted against that debit is
not added again. After finalizing, the credit Stripe applied (ending less starting balance, less
the debit) is checked: a difference is an error.

Below Stripe's minimum charge (USD $0.50) Stripe's finalize charges nothing: it marks the invoice
paid and adds the amount due to the customer's balance as a debit (`invoice_too_small`), which the
next invoice's finalize collects. That debit is not a credit applied (the check leaves it out); ours
is paid and records it (`carried_to_next_cents`), and the next one what it carries in
(`carried_in_cents`: its amount due is what Stripe collects). docs/invoices.md.

Every create carries a deterministic idempotency key, and every Stripe id is stored as soon as it
is known. Stripe keeps idempotency keys for about 24 hours only, so a re-run also looks for what
an interrupted run made before creating anything: the customer by metadata (search), the invoice
among the customer's invoices, the items among the invoice's items, a credit note among the
invoice's credit notes (all by metadata). A total
that differs from ours is an error (recorded on the invoice and raised), never silent.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine
from stripe import StripeClient, StripeError

from billing.invoices.billing_details import get_details, split_tax
from billing.config import BillingConfig
from billing.invoices.models import BillingAccount, CreditNote, Invoice, InvoiceLine
from billing.invoices.close import format_cents
from billing.models import Account, utcnow

log = logging.getLogger("tollgate.stripe")

INVOICES = Invoice.__table__
LINES = InvoiceLine.__table__
ACCOUNTS = Account.__table__
BILLING = BillingAccount.__table__
CREDIT_NOTES = CreditNote.__table__
MAX_ITEMS = 250  # Stripe's limit per invoice


class StripeSyncError(RuntimeError):
    pass


class StripeTotalMismatch(StripeSyncError):
    pass


class StripeCreditMismatch(StripeTotalMismatch):
    """Stripe's finalize applied another customer balance than our invoice's credit."""


WAITS_FOR_A_PERSON = ("total mismatch", "credit mismatch")  # push_pending leaves these invoices alone


def stripe_client(config: BillingConfig) -> StripeClient:
    if not config.stripe_api_key:
        raise StripeSyncError("Stripe is not configured (TOLLGATE_STRIPE_API_KEY)")
    base = {"api": config.stripe_api_base} if config.stripe_api_base else None
    return StripeClient(config.stripe_api_key, base_addresses=base, max_network_retries=config.stripe_max_retries)  # type: ignore[arg-type]


def _plain(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def _micros(value: datetime) -> int:
    value = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return int(value.timestamp() * 1_000_000)


def account_ref(account_id: int, created_at: datetime) -> str:
    """Names one account across databases: its id plus its creation instant."""
    return f"{account_id}-{_micros(created_at)}"


def _customer_fields(name: str, details: dict[str, Any] | None) -> dict[str, Any]:
    """What a Stripe customer says of the buyer: the billing details, else the account's name."""
    if details is None:
        return {"name": name}
    address = {"line1": details.get("address_line1") or "", "line2": details.get("address_line2") or "",
               "city": details.get("city") or "", "postal_code": details.get("postal_code") or "",
               "state": details.get("region") or "", "country": details["country"]}
    return {"name": details["legal_name"], "email": details.get("email") or "", "address": address}


def _differs(want: dict[str, Any], have: dict[str, Any]) -> bool:
    for key, value in want.items():
        if isinstance(value, dict):
            current = have.get(key) or {}
            if any((v or None) != (current.get(k) or None) for k, v in value.items()):
                return True
        elif (value or None) != (have.get(key) or None):
            return True
    return False


def _collects(invoice: Any) -> bool:
    """An invoice Stripe has something to do for: open, or paid in full by our balance credit at
    issue (Stripe's finalize must take that credit from the customer's balance too)."""
    total = int(invoice.total_cents)
    return total > 0 and (invoice.status == "open"
                          or (invoice.status == "paid" and int(invoice.credit_applied_cents or 0) >= total))


def _collects_clause() -> Any:
    return sa.and_(INVOICES.c.total_cents > 0, sa.or_(
        INVOICES.c.status == "open",
        sa.and_(INVOICES.c.status == "paid", INVOICES.c.credit_applied_cents >= INVOICES.c.total_cents)))


async def carried_too_small(client: StripeClient, remote: dict[str, Any]) -> int:
    """What of a finalized Stripe invoice's amount due Stripe did not charge because it was below its
    minimum charge for the currency (USD $0.50): Stripe marks such an invoice paid with nothing paid
    and adds the amount to the customer's balance as a debit, an `invoice_too_small` balance
    transaction naming the invoice, which the customer's next invoice collects. 0 for any other
    invoice (one paid, open, void; one our balance credit paid in full: nothing is carried)."""
    if remote.get("status") != "paid" or int(remote.get("amount_paid") or 0) != 0 or remote.get("ending_balance") is None:
        return 0
    if int(remote["ending_balance"]) <= 0:  # no debit left on the customer: nothing carried
        return 0
    finalized = int((remote.get("status_transitions") or {}).get("finalized_at") or 0)
    carried = 0
    page = await client.v1.customers.balance_transactions.list_async(str(remote["customer"]), {"limit": 100})
    async for txn in page.auto_paging_iter():  # newest first: stop an hour before the finalize
        if finalized and int(txn.created) < finalized - 3600:
            break
        if txn.type == "invoice_too_small" and _id(txn.invoice) == remote["id"]:
            carried += int(txn.amount)
    return carried


def carry_of(credit_applied: int, remote: dict[str, Any], out: int) -> dict[str, int]:
    """What a finalized Stripe invoice carried below the minimum charge: `out` (carried_too_small) to
    the customer's next invoice, and what it collected of earlier carries (the debit its finalize
    applied: the balance it moved less our credit and what it carried on). Every path that learns of
    a finalize records both (the push, the invoice webhooks and the overdue re-read, a credit note's
    push): the balance push reads what is still to collect from them (StripeSync._carried_debit).
    Empty before the finalize (Stripe sets ending_balance then)."""
    if remote.get("ending_balance") is None:
        return {}
    moved = int(remote["ending_balance"]) - int(remote.get("starting_balance") or 0) - out
    return {"carried_to_next_cents": out, "carried_in_cents": max(0, credit_applied - moved)}


def _applies(balance: int, total: int) -> int:
    """What Stripe's finalize takes off an invoice of `total` from a customer balance: a credit
    (negative) up to the total, a debit (positive) whole (added: negative)."""
    return min(total, -balance) if balance < 0 else -balance


def _id(value: Any) -> str | None:
    return None if value is None else str(value if isinstance(value, str) else value.id)


def upsert(db: AsyncEngine, table: Any) -> Any:
    return postgresql.insert(table) if db.dialect.name == "postgresql" else sqlite.insert(table)


class StripeSync:
    def __init__(self, db: AsyncEngine, client: StripeClient, config: BillingConfig) -> None:
        self._db = db
        self._stripe = client
        self._config = config

    # customers ---------------------------------------------------------------------------------
    async def ensure_customer(self, account_id: int) -> str:
        async with self._db.connect() as conn:
            stored = (
                await conn.execute(sa.select(BILLING.c.stripe_customer_id).where(BILLING.c.account_id == account_id))
            ).scalar_one_or_none()
            account = (await conn.execute(sa.select(ACCOUNTS).where(ACCOUNTS.c.id == account_id))).one()
        details = await get_details(self._db, account_id)
        if stored:
            await self._update_customer(str(stored), account.name, details)
            return str(stored)
        ref = account_ref(account_id, account.created_at)
        found = await self._stripe.v1.customers.search_async({"query": f"metadata['tollgate_account']:'{ref}'"})
        matches = [c for c in found.data if _plain(c).get("metadata", {}).get("tollgate_account") == ref]
        if matches:
            customer_id = str(matches[0].id)
        else:
            customer = await self._stripe.v1.customers.create_async(
                {**_customer_fields(account.name, details), "metadata": {"tollgate_account": ref, "tollgate_account_id": str(account_id)}},
                {"idempotency_key": f"tollgate-customer-{ref}"},
            )
            customer_id = str(customer.id)
        await self._update_customer(customer_id, account.name, details, fields=bool(matches))
        stmt = upsert(self._db, BILLING).values(
            account_id=account_id, stripe_customer_id=customer_id, state="active", updated_at=utcnow()
        )
        async with self._db.begin() as conn:
            await conn.execute(
                stmt.on_conflict_do_update(index_elements=["account_id"], set_={"stripe_customer_id": customer_id})
            )
        return customer_id

    async def _update_customer(self, customer_id: str, name: str, details: dict[str, Any] | None, *, fields: bool = True) -> None:
        """The customer as the billing details say now (name, email, address), and their tax id."""
        if fields:
            want = _customer_fields(name, details)
            have = _plain(await self._stripe.v1.customers.retrieve_async(customer_id))
            if _differs(want, have):  # a re-run reads only
                await self._stripe.v1.customers.update_async(customer_id, want)  # type: ignore[arg-type]
        if details is None or not details.get("tax_id") or not details.get("tax_id_type"):
            return
        page = await self._stripe.v1.customers.tax_ids.list_async(customer_id, {"limit": 100})
        async for tax_id in page.auto_paging_iter():
            if tax_id.type == details["tax_id_type"] and tax_id.value == details["tax_id"]:
                return
        await self._stripe.v1.customers.tax_ids.create_async(
            customer_id, {"type": details["tax_id_type"], "value": details["tax_id"]},
            {"idempotency_key": f"tollgate-taxid-{customer_id}-{details['tax_id_type']}-{details['tax_id']}"},
        )

    # invoices ----------------------------------------------------------------------------------
    async def push(self, invoice_id: int) -> dict[str, Any]:
        """Makes the Stripe side of one invoice complete. Safe to repeat at any point."""
        invoice, lines = await self._load(invoice_id)
        if not _collects(invoice):
            return await self._push_notes_only(invoice)
        try:
            return await self._push(invoice, lines)
        except StripeError as exc:
            await self._record(invoice_id, stripe_error=f"{type(exc).__name__}: {exc.user_message or exc}")
            raise
        except StripeSyncError as exc:
            await self._record(invoice_id, stripe_error=str(exc))
            raise

    async def _push_notes_only(self, invoice: Any) -> dict[str, Any]:
        """Nothing to collect (void, paid, zero): only its credit notes that have not reached Stripe
        (a void's note whose push failed: without it Stripe would still collect the invoice). A
        note's failure is recorded on the note and raised; the invoice's own Stripe state is kept."""
        notes = await self._push_waiting_credit_notes(invoice.id) if invoice.stripe_invoice_id else []
        synced = any(n["result"] == "synced" for n in notes)
        result = self._result(invoice, "credit notes synced" if synced else "skipped: nothing to collect")
        if notes:
            result["credit_notes"] = notes
        return result

    async def _push(self, invoice: Any, lines: list[Any]) -> dict[str, Any]:
        invoice_id = int(invoice.id)
        if len(lines) > MAX_ITEMS:
            raise StripeSyncError(f"invoice {invoice.number} has {len(lines)} lines; a Stripe invoice holds at most {MAX_ITEMS}")
        customer = await self.ensure_customer(invoice.account_id)
        remote = await self._stripe_invoice(invoice, customer)
        if remote["status"] == "draft":
            await self._push_items(invoice, lines, remote["id"], customer)
            await self._push_tax(invoice, remote["id"])
            remote = _plain(await self._stripe.v1.invoices.retrieve_async(remote["id"]))
            self._compare(invoice, remote, "draft")
            debit = await self._set_balance(invoice, customer, remote)
            remote = _plain(
                await self._stripe.v1.invoices.finalize_invoice_async(
                    remote["id"], {"auto_advance": True}, {"idempotency_key": f"tollgate-finalize-{remote['id']}"}
                )
            )
            await self._record(invoice_id, stripe_status=remote["status"])
            self._compare_credit(invoice, remote, debit, await carried_too_small(self._stripe, remote))
        if self._should_send(invoice, remote):
            remote = _plain(
                await self._stripe.v1.invoices.send_invoice_async(
                    remote["id"], None, {"idempotency_key": f"tollgate-send-{remote['id']}"}
                )
            )
            await self._record(invoice_id, stripe_sent_at=utcnow())
        self._compare(invoice, remote, remote["status"])
        await self._record(
            invoice_id,
            **await self._carried(invoice, remote),
            stripe_status=remote["status"],
            stripe_total_cents=int(remote["total"]),
            stripe_synced_at=utcnow(),
            stripe_error=None,
        )
        notes = await self._push_waiting_credit_notes(invoice_id)  # issued before the invoice reached Stripe, or failed
        invoice, _ = await self._load(invoice_id)
        result = self._result(invoice, "synced")
        if notes:
            result["credit_notes"] = notes
        return result

    async def _set_balance(self, invoice: Any, customer: str, remote: dict[str, Any]) -> int:
        """Makes Stripe's finalize apply exactly our credit_applied_cents on top of the debit Stripe
        carried below its minimum charge and has not collected yet (`_carried_debit`): one balance
        transaction when the customer's balance would apply anything else. The balance Stripe must
        hold is that debit less our credit: a credit note Stripe has already put on the balance
        nets against the debit there (a note on an invoice carried below the minimum and not yet
        collected: both sides hold it once). A larger debit than Tollgate knows of (one Stripe
        carried whose finalize answer was lost, one posted by hand) is left for Stripe to collect,
        ours on top of it. Returns the debit the finalize collects besides our credit. A re-run
        reads the balance again, so it adds nothing once the balance is right."""
        credit, total = int(invoice.credit_applied_cents or 0), int(invoice.total_cents)
        balance = int(_plain(await self._stripe.v1.customers.retrieve_async(customer)).get("balance") or 0)
        debit = max(balance, await self._carried_debit(invoice))
        target = debit - credit
        if _applies(balance, total) == _applies(target, total):  # the same amount due already (the usual case)
            return debit
        await self._stripe.v1.customers.balance_transactions.create_async(
            customer,
            {"amount": target - balance, "currency": invoice.currency,
             "description": f"Tollgate: invoice {invoice.number} applies {format_cents(credit)} of credit",
             "metadata": {"tollgate_invoice": invoice.number, "tollgate_credit_applied_cents": str(credit)}},
            {"idempotency_key": f"tollgate-balance-{remote['id']}-{balance}"},
        )
        log.info("Stripe customer %s: balance %s -> %s so that invoice %s applies %s of credit",
                 customer, balance, target, invoice.number, credit)
        return debit

    async def _carried_debit(self, invoice: Any) -> int:
        """What Stripe carried below its minimum charge out of the account's other invoices and has not
        collected with a later one yet (carried_to_next_cents less carried_in_cents; an invoice voided
        on Stripe gives back the debit it applied, as its balance)."""
        others = sa.and_(INVOICES.c.account_id == invoice.account_id, INVOICES.c.id != invoice.id)
        kept = sa.or_(INVOICES.c.stripe_status.is_(None), INVOICES.c.stripe_status != "void")
        query = sa.select(
            sa.func.coalesce(sa.func.sum(INVOICES.c.carried_to_next_cents), 0),
            sa.func.coalesce(sa.func.sum(sa.case((kept, INVOICES.c.carried_in_cents), else_=0)), 0),
        ).where(others)
        async with self._db.connect() as conn:
            out, collected = (await conn.execute(query)).one()
        return max(0, int(out) - int(collected))

    async def _carried(self, invoice: Any, remote: dict[str, Any]) -> dict[str, Any]:
        """What Stripe carried below its minimum charge (once finalized): of this invoice to the
        customer's next one, and of earlier ones into this one (the debit its finalize applied:
        the balance it moved less our credit and what it carried on, as _compare_credit checked)."""
        if remote.get("ending_balance") is None:
            return {}
        out = await carried_too_small(self._stripe, remote)
        values: dict[str, Any] = dict(carry_of(int(invoice.credit_applied_cents or 0), remote, out))
        if out and invoice.status == "open":  # Stripe marked it paid at its finalize: no payment, no invoice.paid to wait for
            paid = (remote.get("status_transitions") or {}).get("paid_at")
            values.update(status="paid", paid_at=datetime.fromtimestamp(paid, tz=timezone.utc) if paid else utcnow())
        return values

    def _compare_credit(self, invoice: Any, remote: dict[str, Any], debit: int, carried: int = 0) -> None:
        """`carried`: the amount due Stripe did not charge, below its minimum, and put on the
        customer's balance as a debit (ending_balance includes it): not a credit it applied."""
        if remote.get("ending_balance") is None:  # not finalized (Stripe sets it when it finalizes)
            return
        applied = int(remote["ending_balance"]) - int(remote.get("starting_balance") or 0) - carried
        want = int(invoice.credit_applied_cents or 0) - debit
        if applied != want:
            raise StripeCreditMismatch(
                f"credit mismatch on {invoice.number} (finalized): Stripe applied {format_cents(applied)} of the customer's "
                f"balance, Tollgate {format_cents(want)} {invoice.currency.upper()}"
            )

    async def _push_waiting_credit_notes(self, invoice_id: int) -> list[dict[str, Any]]:
        async with self._db.connect() as conn:
            ids = [int(i) for i in (await conn.execute(sa.select(CREDIT_NOTES.c.id).where(
                CREDIT_NOTES.c.invoice_id == invoice_id, CREDIT_NOTES.c.stripe_credit_note_id.is_(None)).order_by(CREDIT_NOTES.c.id))).scalars()]
        return [await self.push_credit_note(note_id) for note_id in ids]

    def _should_send(self, invoice: Any, remote: dict[str, Any]) -> bool:
        return (
            self._config.send_invoices
            and self._config.collection_method == "send_invoice"
            and remote["status"] == "open"
            and invoice.stripe_sent_at is None
        )

    async def _stripe_invoice(self, invoice: Any, customer: str) -> dict[str, Any]:
        if invoice.stripe_invoice_id:
            return _plain(await self._stripe.v1.invoices.retrieve_async(invoice.stripe_invoice_id))
        remote = await self._find_invoice(invoice, customer)
        if remote is None:
            params: dict[str, Any] = {
                "customer": customer,
                "collection_method": self._config.collection_method,
                "auto_advance": False,
                "pending_invoice_items_behavior": "exclude",
                "currency": invoice.currency,
                "description": f"Tollgate usage {invoice.period} (invoice {invoice.number})",
                "metadata": {"tollgate_invoice": invoice.number, "tollgate_period": invoice.period},
            }
            if self._config.collection_method == "send_invoice":
                params["days_until_due"] = self._config.days_until_due
            created = await self._stripe.v1.invoices.create_async(
                params, {"idempotency_key": f"tollgate-invoice-{customer}-{invoice.number}"}
            )
            remote = _plain(created)
        await self._record(invoice.id, stripe_invoice_id=remote["id"], stripe_status=remote["status"])
        return remote

    async def _find_invoice(self, invoice: Any, customer: str) -> dict[str, Any] | None:
        """An invoice an interrupted run created but did not store (listing is strongly consistent)."""
        page = await self._stripe.v1.invoices.list_async({"customer": customer, "limit": 100})
        async for remote in page.auto_paging_iter():
            data = _plain(remote)
            if (data.get("metadata") or {}).get("tollgate_invoice") == invoice.number and data["status"] != "void":
                return data
        return None

    async def _push_items(self, invoice: Any, lines: list[Any], stripe_invoice: str, customer: str) -> None:
        missing = [line for line in lines if not line.stripe_item_id]
        if not missing:
            return
        made: dict[str, str] = {}
        page = await self._stripe.v1.invoice_items.list_async({"invoice": stripe_invoice, "limit": 100})
        async for item in page.auto_paging_iter():
            ref = (_plain(item).get("metadata") or {}).get("tollgate_line")
            if ref:
                made[ref] = str(item.id)
        for line in missing:
            ref = f"{invoice.number}/{line.position}"
            item_id = made.get(ref)
            if item_id is None:
                item = await self._stripe.v1.invoice_items.create_async(
                    {
                        "customer": customer,
                        "invoice": stripe_invoice,
                        "amount": int(line.amount_cents),
                        "currency": invoice.currency,
                        "description": line.description,
                        "discountable": False,
                        "metadata": {"tollgate_line": ref, "tollgate_invoice": invoice.number},
                    },
                    {"idempotency_key": f"tollgate-item-{stripe_invoice}-{line.position}"},
                )
                item_id = str(item.id)
            async with self._db.begin() as conn:
                await conn.execute(LINES.update().where(LINES.c.id == line.id).values(stripe_item_id=item_id))

    async def _push_tax(self, invoice: Any, stripe_invoice: str) -> None:
        """Our tax line as Stripe manual tax amounts: shared over the lines in proportion, summing to
        our tax (computed once on the subtotal), so Stripe's total is ours. Stripe takes the amounts
        as given; its tax rate (made from tax_rate_data) is what the document shows."""
        tax = int(invoice.tax_cents or 0)
        if invoice.tax_rate is None:
            return
        remote_lines = []
        page = await self._stripe.v1.invoices.line_items.list_async(stripe_invoice, {"limit": 100})
        async for line in page.auto_paging_iter():
            remote_lines.append(_plain(line))
        shares = split_tax([int(line["amount"]) for line in remote_lines], tax)
        rate = format(invoice.tax_rate, "f")
        buyer = json.loads(invoice.buyer) if invoice.buyer else {}
        for line, share in zip(remote_lines, shares):
            if [(t["amount"], t["taxable_amount"]) for t in line.get("taxes") or []] == [(share, int(line["amount"]))]:
                continue  # already there (a re-run)
            data: dict[str, Any] = {"display_name": "Tax", "inclusive": False, "percentage": rate}
            if buyer.get("country"):
                data["country"] = buyer["country"]
            await self._stripe.v1.invoices.line_items.update_async(
                stripe_invoice, line["id"],
                {"tax_amounts": [{"amount": share, "taxable_amount": int(line["amount"]), "tax_rate_data": data}]},  # type: ignore[typeddict-item]
            )

    def _compare(self, invoice: Any, remote: dict[str, Any], stage: str) -> None:
        if int(remote["total"]) != int(invoice.total_cents):
            raise StripeTotalMismatch(
                f"total mismatch on {invoice.number} ({stage}): Stripe {format_cents(int(remote['total']))}, "
                f"Tollgate {format_cents(int(invoice.total_cents))} {invoice.currency.upper()}"
            )

    async def remote_invoice(self, stripe_invoice_id: str) -> dict[str, Any]:
        return _plain(await self._stripe.v1.invoices.retrieve_async(stripe_invoice_id))

    async def carried_too_small(self, remote: dict[str, Any]) -> int:
        return await carried_too_small(self._stripe, remote)

    async def push_pending(self) -> list[dict[str, Any]]:
        """Pushes every credit note not yet on Stripe whose invoice is there, whatever our invoice's
        status now (a void's note whose push failed would otherwise leave Stripe collecting it),
        then every invoice with something to collect whose Stripe side is unfinished (a mismatch
        waits for a person; one our balance paid in full included). Notes first: a credit reaches
        the customer's balance before the next invoice's finalize would have to add it itself."""
        results = await self._push_notes_on_stripe()
        query = sa.select(INVOICES.c.id).where(
            _collects_clause(),
            sa.or_(INVOICES.c.stripe_status.is_(None), INVOICES.c.stripe_status == "draft", INVOICES.c.stripe_total_cents.is_(None)),
            sa.or_(INVOICES.c.stripe_error.is_(None), sa.and_(*[~INVOICES.c.stripe_error.startswith(p) for p in WAITS_FOR_A_PERSON])),
        ).order_by(INVOICES.c.id)
        async with self._db.connect() as conn:
            ids = [int(i) for i in (await conn.execute(query)).scalars()]
        for invoice_id in ids:
            try:
                results.append(await self.push(invoice_id))
            except (StripeError, StripeSyncError) as exc:
                log.error("Stripe sync of invoice %s failed: %s", invoice_id, exc)
                results.append({"id": invoice_id, "result": f"error: {exc}"})
        return results

    async def _push_notes_on_stripe(self) -> list[dict[str, Any]]:
        notes = sa.select(CREDIT_NOTES.c.id).join(INVOICES, INVOICES.c.id == CREDIT_NOTES.c.invoice_id).where(
            CREDIT_NOTES.c.stripe_credit_note_id.is_(None), INVOICES.c.stripe_invoice_id.is_not(None)).order_by(CREDIT_NOTES.c.id)
        async with self._db.connect() as conn:
            note_ids = [int(i) for i in (await conn.execute(notes)).scalars()]
        results = []
        for note_id in note_ids:
            try:
                results.append(await self.push_credit_note(note_id))
            except StripeError as exc:
                log.error("Stripe sync of credit note %s failed: %s", note_id, exc)
                results.append({"id": note_id, "object": "credit_note", "result": f"error: {exc}"})
        return results

    # credit notes --------------------------------------------------------------------------------
    async def push_credit_note(self, note_id: int) -> dict[str, Any]:
        """The Stripe credit note of one of ours, exactly once: an earlier run's note (its response
        lost, maybe more than the ~24 hours Stripe keeps an idempotency key) is found among the
        invoice's credit notes by metadata and adopted. Skipped while its invoice has no Stripe
        invoice, or one that takes no credit note (a draft: the invoice's push finalizes it first;
        a void)."""
        async with self._db.connect() as conn:
            note = (await conn.execute(sa.select(CREDIT_NOTES).where(CREDIT_NOTES.c.id == note_id))).one()
            invoice = (await conn.execute(sa.select(INVOICES).where(INVOICES.c.id == note.invoice_id))).one()
        result: dict[str, Any] = {"id": note.id, "object": "credit_note", "number": note.number}
        if note.stripe_credit_note_id:
            return {**result, "result": "synced", "stripe_credit_note_id": note.stripe_credit_note_id}
        if not invoice.stripe_invoice_id:
            return {**result, "result": "skipped: the invoice is not on Stripe", "stripe_credit_note_id": None}
        try:
            remote = _plain(await self._stripe.v1.invoices.retrieve_async(invoice.stripe_invoice_id))
            made, post_payment = await self._find_credit_note(note.number, invoice.stripe_invoice_id)
            if made is None and remote["status"] in ("draft", "void"):
                return {**result, "result": f"skipped: the Stripe invoice is {remote['status']}", "stripe_credit_note_id": None}
            if made is None and remote["status"] == "uncollectible":
                return {**result, **await self._uncollectible(invoice, remote), "stripe_credit_note_id": None}
            if made is None:
                params: dict[str, Any] = {
                    "invoice": invoice.stripe_invoice_id, "amount": int(note.total_cents),
                    "memo": note.memo or f"Credit note {note.number} for invoice {invoice.number}",
                    "metadata": {"tollgate_credit_note": note.number, "tollgate_invoice": invoice.number},
                }
                if note.reason:
                    params["reason"] = note.reason
                post = int(note.total_cents) - (min(int(note.total_cents), int(remote["amount_remaining"])) if remote["status"] == "open" else 0)
                if post:
                    params["credit_amount"] = post  # to the customer's balance: Stripe applies it to the next invoice
                created = _plain(await self._stripe.v1.credit_notes.create_async(
                    params, {"idempotency_key": f"tollgate-credit-note-{note.number}"}))
                made, post_payment = str(created["id"]), int(created.get("post_payment_amount") or 0)
        except StripeError as exc:
            async with self._db.begin() as conn:
                await conn.execute(CREDIT_NOTES.update().where(CREDIT_NOTES.c.id == note_id).values(
                    stripe_error=f"{type(exc).__name__}: {exc.user_message or exc}"))
            raise
        # Issued against an invoice still open here that Stripe already had paid (its invoice.paid not
        # applied yet): Stripe put all of the note on the customer's balance, and so do we, or the
        # next invoice would not apply it and the balance push would take it back from Stripe.
        # Paid that way below Stripe's minimum charge (nothing paid, the amount carried as a debit): ours
        # records the carry as the push would have, or the next invoice's push would not leave the
        # debit for Stripe to collect and would add the note's credit on top of it (a second credit).
        to_balance = {"applies_to": "balance"} if note.applies_to == "invoice" and post_payment >= int(note.total_cents) else {}
        carried = carry_of(int(invoice.credit_applied_cents or 0), remote, await carried_too_small(self._stripe, remote)) \
            if to_balance and invoice.status == "void" else {}
        async with self._db.begin() as conn:
            await conn.execute(CREDIT_NOTES.update().where(CREDIT_NOTES.c.id == note_id).values(
                stripe_credit_note_id=made, stripe_error=None, **to_balance))
            if to_balance and invoice.status == "void":  # the note took all it held: it was paid, not voided
                paid = (remote.get("status_transitions") or {}).get("paid_at")
                await conn.execute(INVOICES.update().where(INVOICES.c.id == invoice.id, INVOICES.c.status == "void").values(
                    status="paid", paid_at=datetime.fromtimestamp(paid, tz=timezone.utc) if paid else utcnow(),
                    **carried))
        return {**result, "result": "synced", "stripe_credit_note_id": made}

    async def _uncollectible(self, invoice: Any, remote: dict[str, Any]) -> dict[str, str]:
        """Stripe takes credit notes on open or paid invoices only, and an uncollectible one can still
        be paid. When our notes took all of ours (void), Stripe's is voided so that it collects nothing;
        a partial note waits: pushed once the invoice is paid (to the balance) or skipped once void."""
        if invoice.status != "void":
            return {"result": "skipped: the Stripe invoice is uncollectible (Stripe credits open or paid invoices); "
                              "pushed once it is paid"}
        await self._stripe.v1.invoices.void_invoice_async(
            remote["id"], options={"idempotency_key": f"tollgate-void-{remote['id']}"})
        async with self._db.begin() as conn:
            await conn.execute(INVOICES.update().where(INVOICES.c.id == invoice.id).values(stripe_status="void"))
        return {"result": "synced: the uncollectible Stripe invoice voided (credit notes take open or paid invoices)"}

    async def _find_credit_note(self, number: str, stripe_invoice: str) -> tuple[str | None, int]:
        """The Stripe credit note an earlier run made for our note `number` (listing is strongly
        consistent), with the part of it Stripe put on the customer's balance (post-payment)."""
        page = await self._stripe.v1.credit_notes.list_async({"invoice": stripe_invoice, "limit": 100})
        async for remote in page.auto_paging_iter():
            found = _plain(remote)
            if (found.get("metadata") or {}).get("tollgate_credit_note") == number:
                return str(found["id"]), int(found.get("post_payment_amount") or 0)
        return None, 0

    # storage -----------------------------------------------------------------------------------
    async def _load(self, invoice_id: int) -> tuple[Any, list[Any]]:
        async with self._db.connect() as conn:
            invoice = (await conn.execute(sa.select(INVOICES).where(INVOICES.c.id == invoice_id))).first()
            if invoice is None:
                raise StripeSyncError(f"no invoice with id {invoice_id}")
            lines = (await conn.execute(sa.select(LINES).where(LINES.c.invoice_id == invoice_id).order_by(LINES.c.position))).all()
        return invoice, list(lines)

    async def _record(self, invoice_id: int, **values: Any) -> None:
        async with self._db.begin() as conn:
            await conn.execute(INVOICES.update().where(INVOICES.c.id == invoice_id).values(**values))

    def _result(self, invoice: Any, result: str) -> dict[str, Any]:
        return {
            "id": invoice.id,
            "number": invoice.number,
            "result": result,
            "stripe_invoice_id": invoice.stripe_invoice_id,
            "stripe_status": invoice.stripe_status,
            "total_cents": int(invoice.total_cents),
            "stripe_total_cents": invoice.stripe_total_cents,
        }
