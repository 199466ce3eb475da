"""Billing commands of the `tollgate` CLI (registered by gateway.cli.main). They talk to DATABASE_URL
directly, like the other commands; Stripe settings come from the environment (TOLLGATE_STRIPE_*).

    tollgate invoices close --period 2026-10 [--no-progress] [--no-sync]
    tollgate invoices list [--period P] [--account NAME]
    tollgate invoices show ID [--format json|html|pdf] [--output FILE]
    tollgate invoices sync (ID | --period P)
    tollgate invoices credit ID [--amount-cents N] [--reason R] [--memo TEXT]   a credit note (all that is left by default)
    tollgate billing details --account NAME [--legal-name ... --country DE --email ... --tax-id ...]   show / set
    tollgate billing tax-rate COUNTRY [RATE | --delete]                                               per-country tax (percent)
    tollgate prices list [--model M]
    tollgate prices add MODEL --input X --output Y [--cached-input Z] [--effective-from ISO] [--backdate]
    tollgate prices overrides --account NAME
    tollgate prices override --account NAME --model M (--input X --output Y [--cached-input C] | --multiplier Z | --clear)
                             [--effective-from ISO] [--backdate]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from billing.invoices.billing_details import InvalidBillingDetails, country_rates, delete_country_rate, get_details, set_country_rate, set_details
from billing.config import BillingConfig
from billing.db import create_engine
from billing.invoices.views import get_invoice, list_invoices
from billing.invoices.close import CloseResult, PeriodNotEnded, close_period
from billing.keys.store import KeyStore
from billing.invoices.periods import InvalidPeriod, Period
from billing.prices.book import InvalidPrice, PriceBook
from gateway.cli import db_id, iso_time
from gateway.config import Settings


class CommandError(Exception):
    """A user mistake: printed as `error: ...` with exit status 1."""


def _run(settings: Settings, fn: Callable[[Any], Awaitable[Any]]) -> Any:
    async def run() -> Any:
        db = create_engine(settings.resolved_database_url)
        try:
            return await fn(db)
        finally:
            await db.dispose()

    return asyncio.run(run())


def _stripe(db: Any, config: BillingConfig) -> Any:
    from billing.stripe.sync import StripeSync, stripe_client  # the SDK loads only when needed

    return StripeSync(db, stripe_client(config), config)


def _config(settings: Settings) -> BillingConfig:
    return settings.billing  # type: ignore[return-value]  # its group of the one Settings (gateway/config.py)


def _print(payload: Any) -> None:
    print(json.dumps(payload, indent=2, default=str))


def _period(raw: str) -> Period:
    try:
        return Period.parse(raw)
    except InvalidPeriod as exc:
        raise CommandError(str(exc)) from None


async def _account_id(settings: Settings, db: Any, name: str) -> int:
    account = await KeyStore(db, settings.secret_bytes()).get_account(name=name)
    if account is None:
        raise CommandError(f"no account named {name!r}")
    return int(account["id"])


def _guarded(fn: Callable[[Settings, argparse.Namespace], int]) -> Callable[[Settings, argparse.Namespace], int]:
    def run(settings: Settings, args: argparse.Namespace) -> int:
        try:
            return fn(settings, args)
        except (CommandError, InvalidPrice, PeriodNotEnded, InvalidBillingDetails) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1

    return run


# invoices ---------------------------------------------------------------------------------------
class _Bar:
    """A tqdm progress bar on stderr, fed by the close's (done, total) callback."""

    def __init__(self, enabled: bool, period: Period) -> None:
        self._enabled = enabled
        self._period = period
        self._bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if not self._enabled:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=f"closing {self._period}", unit="account", file=sys.stderr, mininterval=0.2)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def cmd_invoices_close(settings: Settings, args: argparse.Namespace) -> int:
    period = _period(args.period)
    config = _config(settings)
    bar = _Bar(not args.no_progress, period)

    async def close(db: Any) -> tuple[CloseResult, list[dict[str, Any]]]:
        try:
            result = await close_period(db, PriceBook(db), period, progress=bar, lookback_months=config.lookback_months, config=config)
        finally:
            bar.close()
        synced: list[dict[str, Any]] = []
        if config.stripe_enabled and not args.no_sync:
            synced = await _stripe(db, config).push_pending()
        return result, synced

    result, synced = _run(settings, close)
    payload = result.view()
    if synced:
        payload["stripe"] = synced
    _print(payload)
    return 1 if any(str(s.get("result", "")).startswith("error") for s in synced) else 0


def cmd_invoices_list(settings: Settings, args: argparse.Namespace) -> int:
    period = str(_period(args.period)) if args.period else None

    async def list_(db: Any) -> Any:
        account_id = await _account_id(settings, db, args.account) if args.account else None
        return await list_invoices(db, account_id=account_id, period=period)

    invoices = _run(settings, list_)
    _print([{k: i[k] for k in ("id", "number", "account_name", "period", "status", "total", "currency")} for i in invoices])
    return 0


def cmd_invoices_show(settings: Settings, args: argparse.Namespace) -> int:
    invoice = _run(settings, lambda db: get_invoice(db, args.id))
    if invoice is None:
        raise CommandError(f"no invoice with id {args.id}")
    from billing.invoices.render import render_html, render_pdf

    if args.format == "json":
        content: bytes = (json.dumps(invoice, indent=2) + "\n").encode()
    elif args.format == "html":
        content = render_html(invoice).encode()
    else:
        content = render_pdf(invoice)
    if args.output:
        Path(args.output).write_bytes(content)
        print(f"wrote {args.output} ({len(content)} bytes)", file=sys.stderr)
    elif args.format == "pdf" and sys.stdout.isatty():
        raise CommandError("a PDF goes to a file: add --output FILE.pdf")
    else:
        sys.stdout.buffer.write(content)
        sys.stdout.flush()
    return 0


def cmd_invoices_sync(settings: Settings, args: argparse.Namespace) -> int:
    config = _config(settings)
    if not config.stripe_enabled:
        raise CommandError("Stripe is not configured: set TOLLGATE_STRIPE_API_KEY")
    if (args.id is None) == (args.period is None):
        raise CommandError("give an invoice ID or --period, not both")
    period = str(_period(args.period)) if args.period else None

    async def sync(db: Any) -> list[dict[str, Any]]:
        stripe = _stripe(db, config)
        ids = [args.id] if args.id is not None else [i["id"] for i in await list_invoices(db, period=period)]
        out = []
        for invoice_id in ids:
            try:
                out.append(await stripe.push(invoice_id))
            except Exception as exc:  # reported per invoice; the exit status says something failed
                out.append({"id": invoice_id, "result": f"error: {type(exc).__name__}: {exc}"})
        return out

    results = _run(settings, sync)
    _print(results)
    return 1 if any(str(r["result"]).startswith("error") for r in results) else 0


def cmd_invoices_credit(settings: Settings, args: argparse.Namespace) -> int:
    from billing.invoices.credit_notes import CreditNoteRefused, CreditRequest, issue_credit_note

    config = _config(settings)

    async def credit(db: Any) -> dict[str, Any]:
        try:
            note = await issue_credit_note(db, args.id, CreditRequest(args.amount_cents, args.reason, args.memo), config)
        except CreditNoteRefused as exc:
            raise CommandError(str(exc)) from None
        if config.stripe_enabled:
            from stripe import StripeError

            from billing.stripe.sync import StripeSyncError

            try:
                note["stripe"] = await _stripe(db, config).push_credit_note(note["id"])
            except (StripeError, StripeSyncError) as exc:  # the note stands: a second `credit` would issue another
                message = " ".join(str(getattr(exc, "user_message", None) or exc).split())
                raise CommandError(f"credit note {note['number']} (id {note['id']}) is issued but did not reach Stripe "
                                   f"({type(exc).__name__}: {message}); do not issue it again: `tollgate invoices sync {args.id}` "
                                   f"sends it") from None
        return note

    _print(_run(settings, credit))
    return 0


# billing details --------------------------------------------------------------------------------
DETAIL_OPTIONS = ("legal_name", "address_line1", "address_line2", "city", "postal_code", "region", "country", "email",
                  "tax_id", "tax_id_type", "tax_rate")


def cmd_billing_details(settings: Settings, args: argparse.Namespace) -> int:
    changes = {name: getattr(args, name) for name in DETAIL_OPTIONS if getattr(args, name) is not None}

    async def run(db: Any) -> Any:
        account_id = await _account_id(settings, db, args.account)
        if not changes:
            details = await get_details(db, account_id)
            if details is None:
                raise CommandError(f"account {args.account!r} has no billing details yet (give --legal-name and --country)")
            return details
        return await set_details(db, account_id, {k: (v or None) for k, v in changes.items()})

    _print(_run(settings, run))
    return 0


def cmd_billing_tax_rate(settings: Settings, args: argparse.Namespace) -> int:
    async def run(db: Any) -> Any:
        if args.delete:
            if not await delete_country_rate(db, args.country):
                raise CommandError(f"no tax rate for {args.country}")
            return {"country": args.country.upper(), "deleted": True}
        if args.rate is None:
            return [r for r in await country_rates(db) if r["country"] == args.country.upper()] or {"country": args.country.upper(), "rate": None}
        return await set_country_rate(db, args.country, args.rate)

    _print(_run(settings, run))
    return 0


# prices -----------------------------------------------------------------------------------------
def cmd_prices_list(settings: Settings, args: argparse.Namespace) -> int:
    _print([v.view() for v in _run(settings, lambda db: PriceBook(db).list(args.model))])
    return 0


def cmd_prices_add(settings: Settings, args: argparse.Namespace) -> int:
    version = _run(
        settings,
        lambda db: PriceBook(db).add(args.model, args.input, args.output, args.effective_from, backdate=args.backdate,
                                     cached_input_per_million=args.cached_input),
    )
    _print(version.view())
    return 0


def cmd_prices_overrides(settings: Settings, args: argparse.Namespace) -> int:
    async def list_(db: Any) -> Any:
        return [o.view() for o in await PriceBook(db).overrides(await _account_id(settings, db, args.account))]

    _print(_run(settings, list_))
    return 0


def cmd_prices_override(settings: Settings, args: argparse.Namespace) -> int:
    async def add(db: Any) -> Any:
        account_id = await _account_id(settings, db, args.account)
        return await PriceBook(db).add_override(
            account_id, args.model, input_per_million=args.input, output_per_million=args.output,
            multiplier=args.multiplier, clear=args.clear, effective_from=args.effective_from, backdate=args.backdate,
            cached_input_per_million=args.cached_input,
        )

    _print(_run(settings, add).view())
    return 0


def register(sub: Any) -> None:
    invoices = sub.add_parser("invoices", help="monthly invoices: close a period, list, show, push to Stripe")
    inv = invoices.add_subparsers(dest="action", required=True, metavar="ACTION")
    close = inv.add_parser("close", help="close a finished month: one invoice per account (idempotent, resumable)")
    close.add_argument("--period", required=True, help="the month, e.g. 2026-10 (UTC)")
    close.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    close.add_argument("--no-sync", action="store_true", help="do not push the invoices to Stripe afterwards")
    close.set_defaults(func=_guarded(cmd_invoices_close))
    list_ = inv.add_parser("list", help="list invoices")
    list_.add_argument("--period", help="only this month")
    list_.add_argument("--account", help="only this account (name)")
    list_.set_defaults(func=_guarded(cmd_invoices_list))
    show = inv.add_parser("show", help="one invoice as JSON, HTML or PDF")
    show.add_argument("id", type=db_id)
    show.add_argument("--format", choices=["json", "html", "pdf"], default="json")
    show.add_argument("--output", help="write to this file instead of stdout")
    show.set_defaults(func=_guarded(cmd_invoices_show))
    sync = inv.add_parser("sync", help="push invoices to Stripe (safe to repeat)")
    sync.add_argument("id", type=db_id, nargs="?", help="one invoice id")
    sync.add_argument("--period", help="every invoice of this month")
    sync.set_defaults(func=_guarded(cmd_invoices_sync))
    credit = inv.add_parser("credit", help="issue a credit note against an invoice (the invoice is never edited)")
    credit.add_argument("id", type=db_id)
    credit.add_argument("--amount-cents", type=int, help="how much to credit, tax included (default: all that is left: a void)")
    credit.add_argument("--reason", choices=["duplicate", "fraudulent", "order_change", "product_unsatisfactory"])
    credit.add_argument("--memo", help="printed on the credit note")
    credit.set_defaults(func=_guarded(cmd_invoices_credit))

    billing = sub.add_parser("billing", help="buyer billing details per account, tax rates per country")
    bl = billing.add_subparsers(dest="action", required=True, metavar="ACTION")
    details = bl.add_parser("details", help="show an account's billing details, or change the fields given")
    details.add_argument("--account", required=True, help="the account (name)")
    for name in DETAIL_OPTIONS:
        details.add_argument("--" + name.replace("_", "-"), dest=name, help="an empty value clears it" if name not in (
            "legal_name", "country") else None)
    details.set_defaults(func=_guarded(cmd_billing_details))
    tax = bl.add_parser("tax-rate", help="show, set or delete a country's tax rate (percent, e.g. 19.000)")
    tax.add_argument("country", help="ISO 3166-1 alpha-2, e.g. DE")
    tax.add_argument("rate", nargs="?", help='e.g. "19.000"')
    tax.add_argument("--delete", action="store_true")
    tax.set_defaults(func=_guarded(cmd_billing_tax_rate))

    prices = sub.add_parser("prices", help="price versions and per-account overrides")
    pr = prices.add_subparsers(dest="action", required=True, metavar="ACTION")
    p_list = pr.add_parser("list", help="list price versions")
    p_list.add_argument("--model")
    p_list.set_defaults(func=_guarded(cmd_prices_list))
    p_add = pr.add_parser("add", help="add (or schedule) a price version, USD per million tokens")
    p_add.add_argument("model")
    p_add.add_argument("--input", required=True, help='input tokens, e.g. "0.150"')
    p_add.add_argument("--output", required=True, help='output tokens, e.g. "0.600"')
    p_add.add_argument("--cached-input", help='prompt tokens served from the prefix cache, e.g. "0.075" (default: the input price)')
    p_add.add_argument("--effective-from", type=iso_time, help="ISO 8601 (default: now); a future time schedules it")
    p_add.add_argument("--backdate", action="store_true", help="allow a past time (never inside a closed period)")
    p_add.set_defaults(func=_guarded(cmd_prices_add))
    p_ovs = pr.add_parser("overrides", help="list an account's overrides")
    p_ovs.add_argument("--account", required=True)
    p_ovs.set_defaults(func=_guarded(cmd_prices_overrides))
    p_ov = pr.add_parser("override", help="add an override version for an account")
    p_ov.add_argument("--account", required=True)
    p_ov.add_argument("--model", required=True, help='a model id, or "*" for a multiplier on every model')
    p_ov.add_argument("--input", help="custom price for input tokens")
    p_ov.add_argument("--output", help="custom price for output tokens")
    p_ov.add_argument("--cached-input", help="custom price for cached prompt tokens (with --input/--output)")
    p_ov.add_argument("--multiplier", help='e.g. "0.85"')
    p_ov.add_argument("--clear", action="store_true", help="end the override (back to the base price)")
    p_ov.add_argument("--effective-from", type=iso_time, help="ISO 8601 (default: now)")
    p_ov.add_argument("--backdate", action="store_true", help="allow a past time (never inside a closed period)")
    p_ov.set_defaults(func=_guarded(cmd_prices_override))
