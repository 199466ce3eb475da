"""Monthly close: one invoice per account and period, priced from the ledger's tokens.

    ledger rows -> usage per (model, price in force)   one aggregate query per account and range
                -> lines per (model, direction, price) each amount rounded half up to cents once
                -> invoice                            total = sum of the line amounts

The ledger is the source of truth: amounts come from tokens x the price version (and account
override) each row was admitted at, which the row names (`price_version_id`, `override_id`: the
versions the admitting gateway's price book had in force at its `admitted_at`, so the invoice bills
what the quotas and balances counted, even where that book had not yet seen a newer version; rows
from before migration 0025 name none and are priced by the versions in force at `admitted_at`).
A request that runs across a price change or a month end belongs to the instant it started.
Amounts never come from the rows' `cost_nanos`; except response-cache hits (`cached` rows): a hit costs the hit price in force
when it was served times the normal cost, recorded only in its `cost_nanos`, so its line is the sum of
those (see docs/billing.md). Billed rows
have status completed or cancelled (tokens really generated); error rows are not billed.

A prepaid account's usage is not invoiced; its month gets a statement instead (billing/invoices/statements.py),
made by the same run.

Late usage: a row that lands after its period was closed is billed once, in the next invoice
closed for that account, as an adjustment line dated with its own period. The close finds it by
comparing the ledger's current tokens for each recently closed period with the tokens already
on invoice lines for that period (no per-row marks). See docs/billing.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from billing.config import BillingConfig
from billing.invoices.documents import invoice_fields, list_credit_notes_on
from billing.invoices.models import BillingPeriod, Invoice, InvoiceLine
from billing.ledger.records import BILLED_STATUSES, spends_balance
from billing.models import Account, LedgerEntry, utcnow
from billing.invoices.periods import Period
from billing.prices.book import EXACT, EffectivePrice, PriceBook
from billing.invoices.statements import STATEMENTS, close_statement

log = logging.getLogger("tollgate.invoicing")

LEDGER = LedgerEntry.__table__
ACCOUNTS = Account.__table__
PERIODS = BillingPeriod.__table__
INVOICES = Invoice.__table__
LINES = InvoiceLine.__table__
# cached: prompt tokens at the price's cached-input price; cached_response: response-cache hits (prompt + completion)
DIRECTIONS = ("input", "cached", "output", "batch_input", "batch_output", "cached_response")
DIRECTION_NAMES = {"input": "input", "cached": "cached input", "output": "output", "batch_input": "batch input",
                   "batch_output": "batch output", "cached_response": "cached response"}
HIT = "cached_response"
NANOS_PER_CENT = Decimal(10_000_000)
CLOSE_LOCK_KEY = 0x746F6C6C67617465  # "tollgate": one monthly close at a time across instances
MILLION = Decimal(1_000_000)


class PeriodNotEnded(ValueError):
    pass


class CloseInProgress(RuntimeError):
    """Another instance holds the close lock (only raised when not waiting for it)."""


def line_amount_cents(tokens: int, unit_price: Decimal | None) -> int:
    """The rounding rule: tokens x USD per million / 1e6, in cents, rounded half up, once per line."""
    if unit_price is None:
        return 0
    usd = EXACT.divide(EXACT.multiply(Decimal(tokens), unit_price), MILLION)
    return int(EXACT.multiply(usd, Decimal(100)).quantize(Decimal(1), ROUND_HALF_UP, EXACT))


def nanos_cents(nanos: int) -> int:
    """A cost in nano-USD in cents, rounded half up once (a response-cache hit line)."""
    return int(EXACT.divide(Decimal(nanos), NANOS_PER_CENT).quantize(Decimal(1), ROUND_HALF_UP, EXACT))


def format_cents(cents: int) -> str:
    sign = "-" if cents < 0 else ""
    return f"{sign}{abs(cents) // 100}.{abs(cents) % 100:02d}"


# usage ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PriceKey:
    """What makes two usage slices one line: the same model, direction, period and price."""

    usage_period: str
    model: str
    direction: str
    price_version_id: int | None
    override_id: int | None
    unit_price: Decimal | None


@dataclass
class PricedTokens:
    key: PriceKey
    tokens: int
    price: EffectivePrice | None
    nanos: int = 0  # cached_response: the hits' cost_nanos (their hit price applied at admission)
    prompt: int = 0  # cached_response: the split of `tokens`, for the description
    completion: int = 0


async def priced_usage(
    conn: AsyncConnection, book: PriceBook, account_id: int, start: datetime, end: datetime
) -> dict[PriceKey, PricedTokens]:
    """Billable tokens of one account in [start, end), split wherever a price or month changes,
    summed per line key. The caller refreshes the price book first."""
    cuts = sorted(set(book.breakpoints(account_id, start, end)) | set(_month_starts(start, end)))
    bounds = [start, *cuts]
    created = LEDGER.c.admitted_at  # the instant that prices a row and names its month
    segment: Any = sa.case(*[(created < cut, i) for i, cut in enumerate(cuts)], else_=len(cuts)) if cuts else sa.literal(0)
    rows = (
        sa.select(
            LEDGER.c.model.label("model"),
            segment.label("seg"),
            LEDGER.c.prompt_tokens.label("prompt"),
            LEDGER.c.completion_tokens.label("completion"),
            sa.case((LEDGER.c.cached_tokens > LEDGER.c.prompt_tokens, LEDGER.c.prompt_tokens),
                    else_=sa.func.coalesce(LEDGER.c.cached_tokens, 0)).label("cached"),
            # Lines of a batch are priced at the batch price and get lines of their own.
            sa.case((LEDGER.c.api == "batch", 1), else_=0).label("batch"),
            # A response-cache hit costs what its row's cost_nanos says (the hit price then in force).
            sa.case((LEDGER.c.cached.is_(True), 1), else_=0).label("hit"),
            sa.case((LEDGER.c.cached.is_(True), sa.func.coalesce(LEDGER.c.cost_nanos, 0)), else_=0).label("nanos"),
            LEDGER.c.price_version_id.label("vid"),
            LEDGER.c.override_id.label("oid"),
        )
        .where(
            LEDGER.c.account_id == account_id,
            created >= start,
            created < end,
            LEDGER.c.status.in_(BILLED_STATUSES),
            # a prepaid account's usage was paid from its balance (billing/credits/balance.py): never invoiced
            ~sa.exists().where(ACCOUNTS.c.id == LEDGER.c.account_id, ACCOUNTS.c.prepaid_since.is_not(None),
                               spends_balance(ACCOUNTS.c.prepaid_since)),
        )
        .subquery()
    )
    query = sa.select(
        rows.c.model, rows.c.seg, sa.func.sum(rows.c.prompt).label("prompt"), sa.func.sum(rows.c.completion).label("completion"),
        sa.func.sum(rows.c.cached).label("cached"), rows.c.batch, rows.c.hit, sa.func.sum(rows.c.nanos).label("nanos"),
        rows.c.vid, rows.c.oid,
    ).group_by(rows.c.model, rows.c.seg, rows.c.batch, rows.c.hit, rows.c.vid, rows.c.oid)
    out: dict[PriceKey, PricedTokens] = {}
    for row in (await conn.execute(query)).all():
        at = bounds[int(row.seg)]
        price = _price(book, account_id, row.model, at, row.vid, row.oid)
        if row.hit:  # priced at admission (normal price x hit price, batch or not): its own line
            prompt, completion = int(row.prompt or 0), int(row.completion or 0)
            if prompt + completion == 0 and not row.nanos:  # hits not delivered whole: nothing served
                continue
            key = _key(str(Period.containing(at)), row.model, HIT, price)
            slot = out.setdefault(key, PricedTokens(key, 0, price))
            slot.tokens += prompt + completion
            slot.prompt, slot.completion = slot.prompt + prompt, slot.completion + completion
            slot.nanos += int(row.nanos or 0)
            continue
        if row.batch and price is not None:
            price = price.for_batch()
        # Cached prompt tokens get their own line where the price has a cached-input price.
        cached = int(row.cached or 0) if price is not None and price.cached_input_per_million is not None else 0
        directions = (("input", int(row.prompt or 0) - cached), ("cached", cached), ("output", int(row.completion or 0)))
        if row.batch:
            directions = (("batch_input", int(row.prompt or 0)), ("batch_output", int(row.completion or 0)))
        for direction, tokens in directions:
            if tokens == 0:
                continue
            key = _key(str(Period.containing(at)), row.model, direction, price)
            slot = out.setdefault(key, PricedTokens(key, 0, price))
            slot.tokens += tokens
    return out


def _price(book: PriceBook, account_id: int, model: str, at: datetime, vid: int | None, oid: int | None) -> EffectivePrice | None:
    """What one slice's rows are billed at (`PriceBook.billed`; `at` is the slice's start), or the
    price in force at `at` where they name a version the book does not hold."""
    try:
        return book.billed(account_id, model, at, vid, oid)
    except KeyError:  # a version the book does not hold (never deleted: not seen)
        log.error("account %s: %s rows name price version %s / override %s, which the price book does not hold; "
                  "priced by their admission instant", account_id, model, vid, oid)
        return book.price_for(account_id, model, at)


def _key(period: str, model: str, direction: str, price: EffectivePrice | None) -> PriceKey:
    if price is None:
        return PriceKey(period, model, direction, None, None, None)
    if direction == HIT:  # no one unit price: the amount is the hits' recorded cost
        return PriceKey(period, model, direction, price.price_version_id, price.override_id, None)
    unit = {"input": price.input_per_million, "cached": price.cached_input_per_million, "output": price.output_per_million,
            "batch_input": price.input_per_million, "batch_output": price.output_per_million}[direction]
    return PriceKey(period, model, direction, price.price_version_id, price.override_id, unit)


def _month_starts(start: datetime, end: datetime) -> list[datetime]:
    out, month = [], Period.containing(start).next()
    while month.start < end:
        out.append(month.start)
        month = month.next()
    return out


@dataclass
class Billed:
    tokens: int = 0
    cents: int = 0


async def billed_tokens(conn: AsyncConnection, account_id: int, periods: list[str]) -> dict[PriceKey, Billed]:
    """Tokens (and cents) already on this account's invoice lines, per line key, for the given usage periods."""
    if not periods:
        return {}
    query = (
        sa.select(
            LINES.c.usage_period, LINES.c.model, LINES.c.direction, LINES.c.price_version_id,
            LINES.c.override_id, LINES.c.unit_price, sa.func.sum(LINES.c.tokens).label("tokens"),
            sa.func.sum(LINES.c.amount_cents).label("cents"),
        )
        .join(INVOICES, INVOICES.c.id == LINES.c.invoice_id)
        .where(INVOICES.c.account_id == account_id, LINES.c.usage_period.in_(periods))
        .group_by(
            LINES.c.usage_period, LINES.c.model, LINES.c.direction, LINES.c.price_version_id,
            LINES.c.override_id, LINES.c.unit_price,
        )
    )
    out: dict[PriceKey, Billed] = defaultdict(Billed)
    for row in (await conn.execute(query)).all():
        # Decimals equal in value hash alike: NUMERIC(30, 9) read back matches a computed price.
        unit = None if row.unit_price is None else Decimal(row.unit_price)
        key = PriceKey(row.usage_period, row.model, row.direction, row.price_version_id, row.override_id, unit)
        out[key].tokens += int(row.tokens)
        out[key].cents += int(row.cents)
    return out


# lines ------------------------------------------------------------------------------------------
@dataclass
class LineDraft:
    kind: str  # usage | adjustment
    usage_period: str
    model: str
    direction: str
    tokens: int
    unit_price: Decimal | None
    amount_cents: int
    price_version_id: int | None
    override_id: int | None
    description: str
    price: EffectivePrice | None = field(default=None, repr=False)


def _describe(kind: str, key: PriceKey, tokens: int, price: EffectivePrice | None, period: Period,
              split: tuple[int, int] | None = None, free: bool = False) -> str:
    what = f"{key.model}, {DIRECTION_NAMES[key.direction]} tokens: {tokens:,}"
    if key.direction == HIT:
        what = f"{key.model}, cached responses (served from the response cache), tokens: {tokens:,}"
        if split is not None:
            what += f" ({split[0]:,} prompt + {split[1]:,} completion)"
    if price is None:
        text = f"{what}, no price in force (not charged)"
    elif key.direction == HIT:
        text = f"{what}, at the cache-hit price in force when each was served" + (" (free)" if free else "")
    elif key.unit_price is None:
        text = f"{what}, no price in force (not charged)"
    else:
        text = f"{what} x ${format(key.unit_price, 'f')} per 1M tokens"
        notes = []
        if price.override is not None:
            if price.override.kind == "price":
                notes.append("account price")
            else:
                notes.append(f"account multiplier x{format(price.override.multiplier, 'f')}")
        if price.version is not None and price.version.effective_from > Period.parse(key.usage_period).start:
            notes.append(f"price from {price.version.effective_from:%Y-%m-%d %H:%M} UTC")
        if price.override is not None and price.override.effective_from > Period.parse(key.usage_period).start:
            notes.append(f"override from {price.override.effective_from:%Y-%m-%d %H:%M} UTC")
        if notes:
            text += f" ({'; '.join(notes)})"
    if kind == "adjustment":
        text = f"Late usage from {key.usage_period}, recorded after that period closed: {text}"
    return text


def _order(key: PriceKey, price: EffectivePrice | None) -> tuple[Any, ...]:
    started = max(
        [v.effective_from for v in (price.version, price.override) if v is not None] if price else [],
        default=Period.parse(key.usage_period).start,
    )
    return (key.usage_period, key.model, started, DIRECTIONS.index(key.direction))


def usage_lines(usage: dict[PriceKey, PricedTokens], period: Period) -> list[LineDraft]:
    slots = sorted(usage.values(), key=lambda s: _order(s.key, s.price))
    return [_line("usage", s.key, s.tokens, s.price, period, s) for s in slots]


def _line(kind: str, key: PriceKey, tokens: int, price: EffectivePrice | None, period: Period,
          hits: PricedTokens | None = None, billed_cents: int = 0) -> LineDraft:
    """`tokens`: what this line adds (shown on it); `hits`: all the key's usage so far (its tokens,
    and for cache hits their nanos); `billed_cents`: what earlier lines of the key already billed.
    The amount is the key's total rounded once less what was billed, so late usage split over
    several invoices is never rounded twice (an adjustment of 500 tokens worth half a cent after
    500 billed as one cent at close adds 0, not 1)."""
    if key.direction == HIT:  # the hits' cost_nanos, less what earlier lines of the key billed, rounded once
        amount = (nanos_cents(hits.nanos) if hits is not None else 0) - billed_cents
        split = (hits.prompt, hits.completion) if hits is not None and kind == "usage" else None
        description = _describe(kind, key, tokens, price, period, split, hits is None or hits.nanos == 0)
    else:
        so_far = hits.tokens if hits is not None else tokens
        # never below 0: an older invoice that rounded a late delta up is made good by later usage of the key
        amount = max(0, line_amount_cents(so_far, key.unit_price) - billed_cents)
        description = _describe(kind, key, tokens, price, period)
    return LineDraft(
        kind=kind,
        usage_period=key.usage_period,
        model=key.model,
        direction=key.direction,
        tokens=tokens,
        unit_price=key.unit_price,
        amount_cents=amount,
        price_version_id=key.price_version_id,
        override_id=key.override_id,
        description=description,
        price=price,
    )


async def adjustment_lines(
    conn: AsyncConnection, book: PriceBook, account_id: int, closed: list[Period], period: Period
) -> list[LineDraft]:
    """Tokens of closed earlier periods that reached the ledger after their invoice was made."""
    if not closed:
        return []
    now_usage: dict[PriceKey, PricedTokens] = {}
    for start, end in _ranges(closed):
        now_usage.update(await priced_usage(conn, book, account_id, start, end))
    billed = await billed_tokens(conn, account_id, [str(p) for p in closed])
    out = []
    for slot in sorted(now_usage.values(), key=lambda s: _order(s.key, s.price)):
        done = billed.get(slot.key, Billed())
        delta = slot.tokens - done.tokens
        if delta < 0:
            log.warning("account %s: ledger has fewer tokens than billed for %s (%s)", account_id, slot.key, delta)
        if delta > 0:
            out.append(_line("adjustment", slot.key, delta, slot.price, period, slot, done.cents))
    return out


def _ranges(periods: list[Period]) -> list[tuple[datetime, datetime]]:
    """Consecutive months merged into one range: one query for a run of closed months."""
    out: list[tuple[datetime, datetime]] = []
    for p in sorted(periods):
        if out and out[-1][1] == p.start:
            out[-1] = (out[-1][0], p.end)
        else:
            out.append((p.start, p.end))
    return out


# invoices ---------------------------------------------------------------------------------------
def _price_versions(lines: list[LineDraft]) -> list[dict[str, Any]]:
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for line in lines:
        if line.price is not None:
            seen.setdefault((line.model, line.price_version_id, line.override_id), line.price.view())
    return list(seen.values())


async def close_account(
    db: AsyncEngine, book: PriceBook, account_id: int, period: Period, closed_before: list[Period], *, now: datetime,
    config: BillingConfig | None = None,
) -> tuple[int | None, bool]:
    """The account's invoice for the period: (id, created). (None, False) when nothing to bill.
    Idempotent: an invoice already there is returned unchanged."""
    try:
        async with db.begin() as conn:
            existing = await _invoice_id(conn, account_id, period)
            if existing is not None:
                return existing, False
            if not await _has_usage(conn, account_id, min([period, *closed_before]).start, period.end):
                return None, False
            usage = await priced_usage(conn, book, account_id, period.start, period.end)
            lines = usage_lines(usage, period)
            lines += await adjustment_lines(conn, book, account_id, closed_before, period)
            if not lines:
                return None, False
            return await _insert_invoice(conn, account_id, period, lines, now, config), True
    except IntegrityError:  # another instance made it first: a repeat is success
        async with db.connect() as conn:
            existing = await _invoice_id(conn, account_id, period)
        if existing is None:
            raise
        return existing, False


async def _invoice_id(conn: AsyncConnection, account_id: int, period: Period) -> int | None:
    query = sa.select(INVOICES.c.id).where(INVOICES.c.account_id == account_id, INVOICES.c.period == str(period))
    value = (await conn.execute(query)).scalar_one_or_none()
    return None if value is None else int(value)


async def _has_usage(conn: AsyncConnection, account_id: int, start: datetime, end: datetime) -> bool:
    query = sa.select(
        sa.exists().where(
            LEDGER.c.account_id == account_id,
            LEDGER.c.admitted_at >= start,
            LEDGER.c.admitted_at < end,
            LEDGER.c.status.in_(BILLED_STATUSES),
        )
    )
    return bool((await conn.execute(query)).scalar())


async def _insert_invoice(
    conn: AsyncConnection, account_id: int, period: Period, lines: list[LineDraft], now: datetime, config: BillingConfig | None
) -> int:
    name = (await conn.execute(sa.select(ACCOUNTS.c.name).where(ACCOUNTS.c.id == account_id))).scalar_one()
    amounts = [line.amount_cents for line in lines]
    document = await invoice_fields(conn, config, account_id, name, amounts, now)  # number, snapshots, dates, tax
    due = document.amount_due_cents
    values = dict(
        **document.values,
        account_id=account_id,
        period=str(period),
        period_start=period.start,
        period_end=period.end,
        status="open" if due > 0 else "paid",
        price_versions=json.dumps(_price_versions(lines)),
        created_at=now,
        paid_at=None if due > 0 else now,
    )
    invoice_id = int((await conn.execute(INVOICES.insert().values(**values).returning(INVOICES.c.id))).scalar_one())
    await list_credit_notes_on(conn, account_id, invoice_id)
    await conn.execute(
        LINES.insert(),
        [
            dict(
                invoice_id=invoice_id,
                position=i,
                kind=line.kind,
                usage_period=line.usage_period,
                model=line.model,
                direction=line.direction,
                tokens=line.tokens,
                unit_price=line.unit_price,
                amount_cents=line.amount_cents,
                price_version_id=line.price_version_id,
                override_id=line.override_id,
                description=line.description,
            )
            for i, line in enumerate(lines, start=1)
        ],
    )
    return invoice_id


# the monthly run --------------------------------------------------------------------------------
@dataclass
class CloseResult:
    period: str
    status: str
    accounts: int = 0
    created: list[int] = field(default_factory=list)
    existing: list[int] = field(default_factory=list)
    total_cents: int = 0
    statements: list[int] = field(default_factory=list)  # prepaid accounts' statements of the period

    def view(self) -> dict[str, Any]:
        return {
            "object": "billing_period",
            "period": self.period,
            "status": self.status,
            "accounts": self.accounts,
            "invoices_created": len(self.created),
            "invoices_existing": len(self.existing),
            "invoice_ids": sorted(self.created + self.existing),
            "total_cents": self.total_cents,
            "total": format_cents(self.total_cents),
            "statement_ids": sorted(self.statements),
        }


Progress = Callable[[int, int], None]


@contextlib.asynccontextmanager
async def close_lock(db: AsyncEngine, *, wait: bool = True) -> AsyncIterator[None]:
    """One close at a time across instances: a Postgres advisory lock held on its own connection.
    SQLite is single-instance; there the unique (account, period) is the guard."""
    if db.dialect.name != "postgresql":
        yield
        return
    async with db.connect() as conn:
        if wait:
            await conn.execute(sa.select(sa.func.pg_advisory_lock(CLOSE_LOCK_KEY)))
        elif not (await conn.execute(sa.select(sa.func.pg_try_advisory_lock(CLOSE_LOCK_KEY)))).scalar():
            raise CloseInProgress("another instance is closing a billing period")
        await conn.commit()
        try:
            yield
        finally:
            await conn.execute(sa.select(sa.func.pg_advisory_unlock(CLOSE_LOCK_KEY)))
            await conn.commit()


async def close_period(
    db: AsyncEngine,
    book: PriceBook,
    period: Period,
    *,
    now: datetime | None = None,
    progress: Progress | None = None,
    lookback_months: int = 3,
    wait: bool = True,
    config: BillingConfig | None = None,
) -> CloseResult:
    """Closes a finished month for every account. Safe to re-run and to run on several instances:
    a closed period returns its invoices; an interrupted one resumes where it stopped."""
    now = now or utcnow()
    if period.end > now:
        raise PeriodNotEnded(f"period {period} has not ended yet (it ends {period.end.isoformat()})")
    async with close_lock(db, wait=wait):
        return await close_period_locked(db, book, period, now=now, progress=progress, lookback_months=lookback_months, config=config)


async def close_period_locked(
    db: AsyncEngine, book: PriceBook, period: Period, *, now: datetime, progress: Progress | None = None, lookback_months: int = 3,
    config: BillingConfig | None = None,
) -> CloseResult:
    """`close_period` for a caller that already holds `close_lock`. `config`: the seller, terms and
    due days the invoices are issued with (None: a usage statement, due in 30 days)."""
    for unfinished in await _periods(db, status="closing"):
        if unfinished != period:  # an earlier run stopped midway: finish it first
            await _run(db, book, unfinished, now, None, lookback_months, config)
    return await _run(db, book, period, now, progress, lookback_months, config)


async def _periods(db: AsyncEngine, *, status: str | None = None) -> list[Period]:
    query = sa.select(PERIODS.c.period).order_by(PERIODS.c.period)
    if status is not None:
        query = query.where(PERIODS.c.status == status)
    async with db.connect() as conn:
        return [Period.parse(p) for p in (await conn.execute(query)).scalars()]


async def period_status(db: AsyncEngine, period: Period) -> dict[str, Any] | None:
    async with db.connect() as conn:
        row = (await conn.execute(sa.select(PERIODS).where(PERIODS.c.period == str(period)))).first()
    if row is None:
        return None
    return {
        "object": "billing_period",
        "period": row.period,
        "status": row.status,
        "accounts_total": row.accounts_total,
        "accounts_done": row.accounts_done,
        "started_at": _iso(row.started_at),
        "closed_at": _iso(row.closed_at),
    }


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).isoformat()


async def _run(
    db: AsyncEngine, book: PriceBook, period: Period, now: datetime, progress: Progress | None, lookback_months: int,
    config: BillingConfig | None = None,
) -> CloseResult:
    status = await period_status(db, period)
    if status is not None and status["status"] == "closed":
        return await _result(db, period, [], "closed")
    await book.refresh(force=True)
    async with db.connect() as conn:
        accounts = [int(a) for a in (await conn.execute(sa.select(ACCOUNTS.c.id).order_by(ACCOUNTS.c.id))).scalars()]
    await _start_period(db, period, len(accounts), now)
    earliest = period.minus(lookback_months)
    closed_before = [p for p in await _periods(db, status="closed") if earliest <= p < period]
    created: list[int] = []
    for done, account_id in enumerate(accounts, start=1):
        invoice_id, made = await close_account(db, book, account_id, period, closed_before, now=now, config=config)
        if made and invoice_id is not None:
            created.append(invoice_id)
        await close_statement(db, account_id, period, now=now, config=config)  # a prepaid account's month (no amount due)
        async with db.begin() as conn:
            await conn.execute(PERIODS.update().where(PERIODS.c.period == str(period)).values(accounts_done=done))
        if progress is not None:
            progress(done, len(accounts))
        await asyncio.sleep(0)  # the run shares the loop with request serving
    async with db.begin() as conn:
        await conn.execute(
            PERIODS.update().where(PERIODS.c.period == str(period)).values(status="closed", closed_at=utcnow())
        )
    log.info("closed billing period %s: %d invoices created", period, len(created))
    return await _result(db, period, created, "closed")


async def _start_period(db: AsyncEngine, period: Period, accounts: int, now: datetime) -> None:
    values = dict(period=str(period), status="closing", accounts_total=accounts, accounts_done=0, started_at=now)
    insert: Any = postgresql.insert(PERIODS) if db.dialect.name == "postgresql" else sqlite.insert(PERIODS)
    async with db.begin() as conn:
        await conn.execute(insert.values(**values).on_conflict_do_nothing(index_elements=["period"]))
        await conn.execute(PERIODS.update().where(PERIODS.c.period == str(period)).values(accounts_total=accounts))


async def _result(db: AsyncEngine, period: Period, created: list[int], status: str) -> CloseResult:
    async with db.connect() as conn:
        rows = (await conn.execute(sa.select(INVOICES.c.id, INVOICES.c.total_cents).where(INVOICES.c.period == str(period)))).all()
        accounts = (await conn.execute(sa.select(PERIODS.c.accounts_total).where(PERIODS.c.period == str(period)))).scalar()
        statements = [int(s) for s in (await conn.execute(sa.select(STATEMENTS.c.id).where(STATEMENTS.c.period == str(period)))).scalars()]
    made = set(created)
    return CloseResult(
        period=str(period),
        status=status,
        accounts=int(accounts or 0),
        created=[int(r.id) for r in rows if r.id in made],
        existing=[int(r.id) for r in rows if r.id not in made],
        total_cents=sum(int(r.total_cents) for r in rows),
        statements=statements,
    )
