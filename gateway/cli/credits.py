"""`tollgate credits`: prepaid balances from the command line (billing/credits/balance.py).

    tollgate credits mode --account NAME prepaid|postpaid
    tollgate credits balance --account NAME
    tollgate credits add --account NAME --kind topup|grant|refund|adjustment --amount USD [--reason TEXT] [--expires-at ISO]
    tollgate credits post            post prepaid usage and remove expired grants now

With REDIS_URL set, a new credit reaches the gateways' shared limiter at once; otherwise the
gateway applies it within TOLLGATE_CREDITS_CHECK_SECONDS.
"""

from __future__ import annotations

import argparse
from typing import Any

from billing.credits.balance import CreditBook, CreditError, parse_usd
from billing.quota import LedgerTotals, RedisLimiter
from gateway.cli import iso_time
from gateway.cli.billing import CommandError, _account_id, _guarded, _print, _run
from gateway.config import Settings
from billing.credits.housekeeping import housekeeping


def _book(settings: Settings, db: Any) -> tuple[CreditBook, Any]:
    limiter = RedisLimiter(settings.redis.url, LedgerTotals(db), prefix=settings.redis.prefix, timeout=2.0) if settings.redis.url else None
    return CreditBook(db, limiter, settle_seconds=settings.credits.settle_seconds), limiter


def cmd_mode(settings: Settings, args: argparse.Namespace) -> int:
    async def run(db: Any) -> Any:
        try:
            return await CreditBook(db).set_mode(await _account_id(settings, db, args.account), args.mode)
        except CreditError as exc:
            raise CommandError(str(exc)) from None

    _print(_run(settings, run))
    return 0


def cmd_balance(settings: Settings, args: argparse.Namespace) -> int:
    async def run(db: Any) -> Any:
        account = await _account_id(settings, db, args.account)
        book = CreditBook(db)
        return {**(await book.balance(account) or {}), "entries": await book.entries(account, 20)}

    _print(_run(settings, run))
    return 0


def cmd_add(settings: Settings, args: argparse.Namespace) -> int:
    async def run(db: Any) -> Any:
        book, limiter = _book(settings, db)
        try:
            nanos = parse_usd(args.amount, "amount", signed=args.kind == "adjustment")
            if args.kind == "refund":
                nanos = -abs(nanos)
            return await book.add(await _account_id(settings, db, args.account), args.kind, nanos,
                                  reason=args.reason or ("cli" if args.kind != "adjustment" else None), expires_at=args.expires_at)
        except CreditError as exc:
            raise CommandError(str(exc)) from None
        finally:
            if limiter is not None:
                await limiter.close()

    _print(_run(settings, run))
    return 0


def cmd_post(settings: Settings, args: argparse.Namespace) -> int:
    async def run(db: Any) -> Any:
        book, limiter = _book(settings, db)
        try:
            await housekeeping(book, db)
        finally:
            if limiter is not None:
                await limiter.close()
        return {"posted": True}

    _print(_run(settings, run))
    return 0


def register(sub: Any) -> None:
    credits = sub.add_parser("credits", help="prepaid balances: billing mode, top-ups, grants, adjustments")
    cr = credits.add_subparsers(dest="action", required=True, metavar="ACTION")
    mode = cr.add_parser("mode", help="make an account prepaid or postpaid")
    mode.add_argument("--account", required=True, help="account name")
    mode.add_argument("mode", choices=["prepaid", "postpaid"])
    mode.set_defaults(func=_guarded(cmd_mode))
    balance = cr.add_parser("balance", help="an account's balance, grants and latest credit rows")
    balance.add_argument("--account", required=True, help="account name")
    balance.set_defaults(func=_guarded(cmd_balance))
    add = cr.add_parser("add", help="add a credit-ledger row")
    add.add_argument("--account", required=True, help="account name")
    add.add_argument("--kind", required=True, choices=["topup", "grant", "refund", "adjustment"])
    add.add_argument("--amount", required=True, help='USD, e.g. "10.00" (an adjustment may be negative)')
    add.add_argument("--reason", help="why (required for an adjustment)")
    add.add_argument("--expires-at", type=iso_time, help="a grant's expiry (ISO 8601)")
    add.set_defaults(func=_guarded(cmd_add))
    post = cr.add_parser("post", help="post prepaid usage to the credit ledger and remove expired grants now")
    post.set_defaults(func=_guarded(cmd_post))
