"""Prepaid credit: an account's balance and the ledger of every change to it.

    balance = credits - usage since the account became prepaid          (exact nano-USD)
    credits = the credit ledger's rows other than `usage` (top-ups, grants, refunds, expiries, adjustments)

Usage reaches the credit ledger in batches: `post_usage` writes `usage` rows for the cost of the
ledger rows above the account's usage mark (ledger ids, so a row replayed late gets a new id and is
posted by the next batch, and a batch never re-reads what is posted), spending the grants that had
not expired when each row was admitted first (earliest expiry first), then purchased credit. Once
usage is posted the balance equals the sum of the credit ledger. An expired grant's unused rest is
removed by an `expiry` row (unique per grant), never by editing.

Admission does not read this module: the quota limiter (billing/quota/) holds each prepaid
account's credits and spent usage, seeded from `prepaid_totals` and told of every new credit row
by `CreditBook` (and by `sync_recent` for rows written elsewhere: the CLI, another instance).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from billing.decimals import plain_decimal
from billing.credits.models import CREDIT_KINDS, CreditEntry, CreditUsageMark
from billing.ledger.records import spends_balance
from billing.credits.views import NANOS_PER_USD, aware, entry_view, iso, usd
from billing.models import Account, LedgerEntry, utcnow
from billing.invoices.periods import Period
from billing.invoices.statements import figures

log = logging.getLogger("tollgate.credits")
CREDITS = CreditEntry.__table__
ACCOUNTS = Account.__table__
LEDGER = LedgerEntry.__table__
MARKS = CreditUsageMark.__table__
DEFAULT_SETTLE_SECONDS = 120.0  # > any ledger write transaction (statements time out after 60 s)
MAX_NANOS = 2**53 - 1  # exact in the limiter's Lua numbers
MAX_USD = Decimal(MAX_NANOS).scaleb(-9)  # the largest amount in USD (9007199.254740991): fits every BIGINT nanos column
BILLING_MODES = ("postpaid", "prepaid")


class _LostRace(Exception):
    """Another process moved the usage mark while this batch ran: the batch is rolled back."""


class CreditError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse_usd(value: Any, field: str = "amount", *, signed: bool = False) -> int:
    """A USD amount as a decimal string or integer (at most 9 places) -> nano-USD; floats refused."""
    if isinstance(value, bool) or isinstance(value, float) or not isinstance(value, (int, str)):
        raise CreditError(f'{field} must be a decimal string of USD like "10.00" (or an integer), not a float', field)
    try:
        amount = plain_decimal(value)
    except InvalidOperation:
        raise CreditError(f"{field} must be a decimal number of USD", field) from None
    if not amount.is_finite():
        raise CreditError(f"{field} must be a decimal number of USD", field)
    # Bounded before any arithmetic (copy_abs and comparisons are exact): "1e999999" * 10**9 would overflow.
    if amount.copy_abs() > MAX_USD:
        raise CreditError(f"{field} must be between -{MAX_USD} and {MAX_USD} USD" if signed else f"{field} must be at most {MAX_USD} USD", field)
    if amount != amount.quantize(Decimal("1e-9")):
        raise CreditError(f"{field} may have at most 9 decimal places", field)
    nanos = int(amount * NANOS_PER_USD)
    if nanos == 0 or (nanos < 0 and not signed):
        raise CreditError(f"{field} must be {'non-zero' if signed else 'positive'}", field)
    return nanos


async def _since(conn: AsyncConnection, account_id: int) -> datetime | None:
    row = (await conn.execute(sa.select(ACCOUNTS.c.billing_mode, ACCOUNTS.c.prepaid_since).where(ACCOUNTS.c.id == account_id))).first()
    return None if row is None else aware(row.prepaid_since)


async def _usage_cost(conn: AsyncConnection, account_id: int, since: datetime | None) -> int:
    """Cost of the account's ledger rows since it became prepaid (the rows quotas count too)."""
    if since is None:
        return 0
    query = sa.select(sa.func.coalesce(sa.func.sum(LEDGER.c.cost_nanos), 0)).where(
        LEDGER.c.account_id == account_id, spends_balance(since))
    return int((await conn.execute(query)).scalar_one())


async def _spent(conn: AsyncConnection, account_id: int, since: datetime | None) -> tuple[int, int]:
    """(cost of the account's usage since it became prepaid, the part of it posted to the credit
    ledger). Through the account's usage mark: what is posted plus the ledger rows above it, so only
    rows not posted yet are read; without a mark (nothing posted through one yet), every row."""
    if since is None:
        return 0, 0
    mark = (await conn.execute(sa.select(MARKS).where(MARKS.c.account_id == account_id))).first()
    if mark is None or mark.posted_id is None:
        posted = -int((await conn.execute(sa.select(sa.func.coalesce(sa.func.sum(CREDITS.c.amount_nanos), 0)).where(
            CREDITS.c.account_id == account_id, CREDITS.c.kind == "usage"))).scalar_one())
        return await _usage_cost(conn, account_id, since), posted
    newer = int((await conn.execute(sa.select(sa.func.coalesce(sa.func.sum(LEDGER.c.cost_nanos), 0)).where(
        LEDGER.c.account_id == account_id, spends_balance(since), LEDGER.c.id > mark.posted_id))).scalar_one())
    return int(mark.posted_nanos) + newer, int(mark.posted_nanos)


async def prepaid_totals(conn: AsyncConnection, account_id: int) -> tuple[tuple[tuple[int, int, float | None], ...], int]:
    """What the limiter seeds a prepaid account with: its credit rows other than usage, each (id,
    nanos, expiry), and the cost of its usage since it became prepaid. The expiry (epoch seconds) is
    a grant's whose end has not come (no expiry row, and something left of it if it has expired):
    from that instant none of it is available (reserve.lua); None for every other row."""
    rows = (await conn.execute(sa.select(CREDITS.c.id, CREDITS.c.amount_nanos).where(
        CREDITS.c.account_id == account_id, CREDITS.c.kind != "usage").order_by(CREDITS.c.id))).all()
    spent, _ = await _spent(conn, account_id, await _since(conn, account_id))
    pending = {g["id"]: g["expires_at"].timestamp() for g in await _grants(conn, account_id)
               if g["expires_at"] is not None and not g["expired_nanos"] and not (g["expired"] and g["remaining"] <= 0)}
    return tuple((int(r.id), int(r.amount_nanos), pending.get(int(r.id))) for r in rows), spent


class CreditBook:
    """Writes the credit ledger and tells the limiter (when there is one) of each new credit."""

    def __init__(self, engine: AsyncEngine, limiter: Any = None, *, settle_seconds: float | None = None) -> None:
        self._engine = engine
        self._limiter = limiter
        # How long after seeing the highest ledger id a batch may post up to it (see CreditUsageMark):
        # SQLite has one writer at a time, so an id seen is committed with all below it.
        if settle_seconds is None:
            settle_seconds = 0.0 if engine.dialect.name == "sqlite" else DEFAULT_SETTLE_SECONDS
        self.settle = timedelta(seconds=settle_seconds)
        self._ended: set[int] = set()  # grants used up before they expired, whose end the limiter was told

    async def set_mode(self, account_id: int, mode: str) -> dict[str, Any] | None:
        if mode not in BILLING_MODES:
            raise CreditError(f"billing_mode must be one of: {', '.join(BILLING_MODES)}", "billing_mode")
        async with self._engine.begin() as conn:
            row = (await conn.execute(sa.select(ACCOUNTS.c.prepaid_since).where(ACCOUNTS.c.id == account_id).with_for_update())).first()
            if row is None:
                return None
            if mode == "postpaid" and row.prepaid_since is not None:
                # its usage since then is the balance's, not an invoice's: going back is not supported
                raise CreditError("a prepaid account stays prepaid (its usage is paid from its balance)", "billing_mode")
            values: dict[str, Any] = {"billing_mode": mode}
            if mode == "prepaid" and row.prepaid_since is None:
                values["prepaid_since"] = utcnow()  # usage from now on spends the balance
            await conn.execute(ACCOUNTS.update().where(ACCOUNTS.c.id == account_id).values(**values))
        return await self.balance(account_id)

    async def add(
        self, account_id: int, kind: str, amount_nanos: int, *, reason: str | None = None, admin_key_id: int | None = None,
        expires_at: datetime | None = None, external_id: str | None = None, now: datetime | None = None,
        grant_id: int | None = None,
    ) -> dict[str, Any] | None:
        """Adds one credit row and applies it to the limiter. None when `external_id` was already
        recorded (a repeat of the same Stripe object adds nothing)."""
        now = now or utcnow()
        if kind not in CREDIT_KINDS or kind == "usage":
            raise CreditError(f"kind must be one of: {', '.join(k for k in CREDIT_KINDS if k != 'usage')}", "kind")
        if kind in ("topup", "grant") and amount_nanos <= 0 or kind in ("refund", "expiry") and amount_nanos >= 0:
            raise CreditError(f"a {kind} must be {'positive' if kind in ('topup', 'grant') else 'negative'}", "amount")
        if kind == "adjustment" and not (reason and reason.strip()):
            raise CreditError("a manual adjustment needs a reason", "reason")
        if expires_at is not None and (kind != "grant" or aware(expires_at) <= now):  # type: ignore[operator]
            raise CreditError("expires_at is for grants, and must be in the future", "expires_at")
        values = dict(account_id=account_id, kind=kind, amount_nanos=amount_nanos, reason=reason, admin_key_id=admin_key_id,
                      expires_at=expires_at, external_id=external_id, created_at=now, grant_id=grant_id)
        try:
            async with self._engine.begin() as conn:
                if (await conn.execute(sa.select(ACCOUNTS.c.id).where(ACCOUNTS.c.id == account_id))).first() is None:
                    raise CreditError(f"no account {account_id}", "account_id")
                row = (await conn.execute(CREDITS.insert().values(**values).returning(*CREDITS.c))).one()
        except IntegrityError:
            if external_id is None:
                raise
            return None
        try:
            await self.apply(row)
        except Exception as exc:
            # The row is committed: the credit is made, and saying otherwise would have a retry make it
            # twice. The quota store learns of it from the ledger: its group is rebuilt once it answers
            # (invalidate), and the housekeeping loop's sync_recent applies rows it missed.
            log.warning("credit %s for account %s recorded; the quota store did not take it (%s): it is rebuilt from the ledger",
                        row.id, account_id, type(exc).__name__)
            await self._limiter.invalidate_account(account_id)
        return entry_view(row)

    async def entry_by_external_id(self, external_id: str) -> dict[str, Any] | None:
        """The credit row recorded under `external_id` (a Stripe object's id, an admin's idempotency key)."""
        async with self._engine.connect() as conn:
            row = (await conn.execute(sa.select(CREDITS).where(CREDITS.c.external_id == external_id))).first()
        return None if row is None else entry_view(row)

    async def apply(self, row: Any) -> None:
        """Tells the limiter of a committed credit row (idempotent by row id): a grant with its expiry
        (none of it is spent after that), an expiry row as its grant's end."""
        if self._limiter is not None and row.kind != "usage":
            expires = aware(row.expires_at).timestamp() if row.kind == "grant" and row.expires_at is not None else None  # type: ignore[union-attr]
            ends = int(row.grant_id) if row.kind == "expiry" and row.grant_id is not None else None
            await self._limiter.credit(int(row.account_id), int(row.id), int(row.amount_nanos), expires_at=expires, ends_grant=ends)

    async def sync_recent(self, window: timedelta = timedelta(minutes=10)) -> int:
        """Applies credit rows written lately anywhere (the CLI, another instance); repeats add nothing."""
        if self._limiter is None:
            return 0
        async with self._engine.connect() as conn:
            rows = (await conn.execute(sa.select(CREDITS).where(CREDITS.c.created_at >= utcnow() - window, CREDITS.c.kind != "usage"))).all()
        for row in rows:
            await self.apply(row)
        return len(rows)

    async def balance(self, account_id: int) -> dict[str, Any] | None:
        async with self._engine.connect() as conn:
            account = (await conn.execute(sa.select(ACCOUNTS).where(ACCOUNTS.c.id == account_id))).first()
            if account is None:
                return None
            since = aware(account.prepaid_since)
            credits = int((await conn.execute(sa.select(sa.func.coalesce(sa.func.sum(CREDITS.c.amount_nanos), 0)).where(
                CREDITS.c.account_id == account_id, CREDITS.c.kind != "usage"))).scalar_one())
            usage, posted = await _spent(conn, account_id, since)
            grants = await _grants(conn, account_id)
        ledger_sum = credits - posted
        balance = credits - usage
        return {
            "object": "credit_balance", "account_id": account_id, "billing_mode": account.billing_mode,
            "prepaid_since": iso(since), "balance_nanos": balance, "balance": usd(balance),
            "ledger_sum_nanos": ledger_sum, "unposted_usage_nanos": ledger_sum - balance,
            "grants": [{"id": g["id"], "remaining_nanos": g["remaining"], "remaining": usd(g["remaining"]),
                        "expires_at": iso(g["expires_at"])} for g in grants if g["remaining"] > 0 and not g["expired"]],
        }

    async def statement(self, account_id: int, start: datetime, end: datetime) -> dict[str, Any] | None:
        """A prepaid account's month, computed now (the close's document is billing/invoices/statements.py, and
        this is the same reading): opening balance, the credit rows (not usage) of the month, its
        usage per model (rows admitted in it), closing balance. Nothing is due: usage was paid from
        the balance. `start` names the month."""
        period = Period.containing(start)
        async with self._engine.connect() as conn:
            since = await _since(conn, account_id)
            if since is None:
                return None
            month = await figures(conn, account_id, since, period)
        return {
            "object": "credit_statement", "account_id": account_id, "start": period.start.isoformat(), "end": period.end.isoformat(),
            "opening_balance_nanos": month["opening"], "opening_balance": usd(month["opening"]),
            "late_nanos": month["late"], "credits_nanos": month["credits"], "credits": month["content"]["credits"],
            "usage": month["content"]["usage"], "usage_nanos": month["usage"],
            "closing_balance_nanos": month["closing"], "closing_balance": usd(month["closing"]), "amount_due": "0.00",
        }

    async def entries(self, account_id: int, limit: int = 100) -> list[dict[str, Any]]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(sa.select(CREDITS).where(CREDITS.c.account_id == account_id)
                                       .order_by(CREDITS.c.id.desc()).limit(limit))).all()
        return [entry_view(r) for r in rows]

    async def post_usage(self, account_id: int, now: datetime | None = None) -> list[dict[str, Any]]:
        """Posts the account's usage not yet in the credit ledger: the ledger rows above its mark
        (billing.credits.models.CreditUsageMark), so a batch reads only new rows however large the
        account. A row's cost goes to the grants that had not expired when it was admitted (earliest
        expiry first), then to purchased credit. One batch per account at a time (row lock, and a
        conditional update of the mark: a batch that lost a race to another process adds nothing)."""
        try:
            return await self._post_usage(account_id, now or utcnow())
        except (_LostRace, IntegrityError):  # another process posted this range (or made the mark) meanwhile
            return []

    async def _post_usage(self, account_id: int, now: datetime) -> list[dict[str, Any]]:
        async with self._engine.begin() as conn:
            account = (await conn.execute(sa.select(ACCOUNTS.c.prepaid_since).where(ACCOUNTS.c.id == account_id).with_for_update())).first()
            if account is None or account.prepaid_since is None:
                return []
            mark = (await conn.execute(sa.select(MARKS).where(MARKS.c.account_id == account_id).with_for_update())).first()
            if mark is None:
                await conn.execute(MARKS.insert().values(account_id=account_id, posted_nanos=0))
                mark = (await conn.execute(sa.select(MARKS).where(MARKS.c.account_id == account_id))).one()
            top = int((await conn.execute(sa.select(sa.func.coalesce(sa.func.max(LEDGER.c.id), 0)))).scalar_one())
            if not self.settle:
                target, seen_at = top, now  # nothing can commit below an id already seen
            elif mark.frontier_id is not None and aware(mark.frontier_at) <= now - self.settle:  # type: ignore[operator]
                target, seen_at = int(mark.frontier_id), aware(mark.frontier_at)
            else:
                target, seen_at = None, None
            values: dict[str, Any] = {}
            if self.settle and (target is not None or mark.frontier_id is None):
                values.update(frontier_id=top, frontier_at=now)  # the next batch posts up to here
            rows: list[Any] = []
            returned: list[Any] = []
            if target is not None and (mark.posted_id is None or target > mark.posted_id):
                since = aware(account.prepaid_since)
                assert since is not None
                if mark.posted_id is None:  # the first batch through a mark: usage rows posted before marks count
                    legacy = -int((await conn.execute(sa.select(sa.func.coalesce(sa.func.sum(CREDITS.c.amount_nanos), 0)).where(
                        CREDITS.c.account_id == account_id, CREDITS.c.kind == "usage"))).scalar_one())
                else:
                    legacy = int(mark.posted_nanos)
                parts, back = await self._allocate(conn, account_id, since, mark.posted_id, target, legacy if mark.posted_id is None else 0)
                rows = [(await conn.execute(CREDITS.insert().values(
                    account_id=account_id, kind="usage", amount_nanos=-take, grant_id=gid, usage_until=seen_at, created_at=utcnow(),
                ).returning(*CREDITS.c))).one() for gid, take in parts]
                # What an expiry removed that usage admitted before it then used: given back by an `expiry`
                # row of its own, so the grant pays for what its holds held (and the balance stays >= 0).
                returned = [(await conn.execute(CREDITS.insert().values(
                    account_id=account_id, kind="expiry", amount_nanos=nanos, grant_id=gid, created_at=utcnow(),
                    reason=f"grant {gid}: usage admitted before it expired", external_id=f"expiry:{gid}:back:{target}",
                ).returning(*CREDITS.c))).one() for gid, nanos in back]
                values.update(posted_id=target, posted_at=seen_at, posted_nanos=legacy + sum(take for _, take in parts))
            if values:
                same = sa.and_(MARKS.c.account_id == account_id,
                               MARKS.c.posted_id.is_(None) if mark.posted_id is None else MARKS.c.posted_id == mark.posted_id,
                               MARKS.c.frontier_id.is_(None) if mark.frontier_id is None else MARKS.c.frontier_id == mark.frontier_id)
                if (await conn.execute(MARKS.update().where(same).values(**values))).rowcount != 1:
                    raise _LostRace()  # rolls the batch back (SQLite has no row locks: the mark is the guard)
        for row in returned:
            await self.apply(row)
        return [entry_view(r) for r in rows + returned]

    async def _allocate(self, conn: AsyncConnection, account_id: int, since: datetime, above: int | None, upto: int,
                        already: int) -> tuple[list[tuple[int | None, int]], list[tuple[int, int]]]:
        """The cost of the ledger rows with ids in (above, upto], less `already` (posted before marks),
        as (grant id or None, nanos), and what expiries removed that this usage used, as (grant id,
        nanos) to give back. A row may use the grants that had not expired when it was admitted (its
        quota hold was taken against them then): earliest expiry first, then purchased credit. A row
        that reaches the ledger after its grant's expiry row (it was still running) uses what that
        expiry removed."""
        grants = await _grants(conn, account_id)
        for grant in grants:
            grant["usable"] = grant["remaining"] + grant["expired_nanos"]  # less: what its expiry removed, usable again
        cuts = sorted({g["expires_at"] for g in grants if g["expires_at"] is not None})
        segment: Any = sa.case(*[(LEDGER.c.admitted_at < cut, i) for i, cut in enumerate(cuts)], else_=len(cuts)) if cuts else sa.literal(0)
        query = sa.select(segment.label("seg"), sa.func.coalesce(sa.func.sum(LEDGER.c.cost_nanos), 0).label("cost")).where(
            LEDGER.c.account_id == account_id, spends_balance(since), LEDGER.c.id <= upto)
        if above is not None:
            query = query.where(LEDGER.c.id > above)
        costs = sorted((int(r.seg), int(r.cost)) for r in (await conn.execute(query.group_by(segment))).all())
        taken: dict[int | None, int] = {}
        back: dict[int, int] = {}
        for seg, cost in costs:
            cost, already = cost - min(cost, already), already - min(cost, already)
            for grant in grants:  # earliest expiry first; a row admitted in segment `seg` may use grants expiring after it
                if cost == 0:
                    break
                if grant["usable"] <= 0 or (grant["expires_at"] is not None and (seg >= len(cuts) or grant["expires_at"] < cuts[seg])):
                    continue
                take = min(cost, grant["usable"])
                grant["usable"] -= take
                taken[grant["id"]] = taken.get(grant["id"], 0) + take
                cost -= take
                rest = min(take, max(grant["remaining"], 0))  # from the grant's unexpired rest first
                grant["remaining"] -= rest
                if take > rest:  # the rest of it from what its expiry removed: given back
                    back[grant["id"]] = back.get(grant["id"], 0) + take - rest
            if cost:
                taken[None] = taken.get(None, 0) + cost
        if already:  # posted before marks and more than these rows cost: never happens with an exact ledger
            log.warning("account %s: %d nano-USD of usage posted before marks exceed the ledger", account_id, already)
        return [(gid, take) for gid, take in taken.items() if take > 0], sorted(back.items())

    async def expire_grants(self, now: datetime | None = None) -> list[dict[str, Any]]:
        """Removes the unused rest of every grant that has expired, by an `expiry` row (once per grant:
        its external_id is unique), once the account's usage recorded before the expiry instant is
        posted (usage admitted after it never uses the grant; usage admitted before it that lands later
        is given back what it used by `post_usage`)."""
        now = now or utcnow()
        done = CREDITS.alias("done")
        async with self._engine.connect() as conn:
            due = (await conn.execute(sa.select(CREDITS.c.id, CREDITS.c.account_id, CREDITS.c.expires_at).where(
                CREDITS.c.kind == "grant", CREDITS.c.expires_at <= now,
                ~sa.exists().where(done.c.kind == "expiry", done.c.grant_id == CREDITS.c.id),
            ))).all()
        made = []
        for grant in due:
            await self.post_usage(int(grant.account_id), now)
            async with self._engine.connect() as conn:
                posted_at = (await conn.execute(sa.select(MARKS.c.posted_at).where(MARKS.c.account_id == grant.account_id))).scalar()
                if posted_at is None or aware(posted_at) < aware(grant.expires_at):  # type: ignore[operator]
                    continue  # usage recorded before the expiry is not all posted yet: a later round expires it
                remaining = next((g["remaining"] for g in await _grants(conn, int(grant.account_id)) if g["id"] == grant.id), 0)
            if remaining <= 0:  # all of it used before it expired: no expiry row; its end is told all the same
                if self._limiter is not None and int(grant.id) not in self._ended:
                    await self._limiter.credit(int(grant.account_id), None, 0, ends_grant=int(grant.id))
                    self._ended.add(int(grant.id))
                continue
            row = await self.add(int(grant.account_id), "expiry", -remaining, reason=f"grant {grant.id} expired",
                                 external_id=f"expiry:{grant.id}", now=now, grant_id=int(grant.id))
            if row is not None:
                made.append(row)
        return made


async def _grants(conn: AsyncConnection, account_id: int, at: datetime | None = None) -> list[dict[str, Any]]:
    """The account's grants, earliest expiry first, with what is left of each."""
    at = at or utcnow()
    used: dict[Any, int] = {}
    expired: dict[Any, int] = {}
    for gid, kind, total in (await conn.execute(sa.select(CREDITS.c.grant_id, CREDITS.c.kind, sa.func.sum(CREDITS.c.amount_nanos)).where(
            CREDITS.c.account_id == account_id, CREDITS.c.grant_id.is_not(None)).group_by(CREDITS.c.grant_id, CREDITS.c.kind))).all():
        used[gid] = used.get(gid, 0) + int(total)
        if kind == "expiry":
            expired[gid] = expired.get(gid, 0) - int(total)  # removed by its expiry, less what was given back
    rows = (await conn.execute(sa.select(CREDITS).where(CREDITS.c.account_id == account_id, CREDITS.c.kind == "grant"))).all()
    out = [{"id": int(r.id), "expires_at": aware(r.expires_at), "remaining": int(r.amount_nanos) + used.get(r.id, 0),
            "expired_nanos": expired.get(r.id, 0),
            "expired": r.expires_at is not None and aware(r.expires_at) <= at} for r in rows]  # type: ignore[operator]
    far = datetime.max.replace(tzinfo=timezone.utc)
    return sorted(out, key=lambda g: (g["expires_at"] or far, g["id"]))
