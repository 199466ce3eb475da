"""The price book: versions of per-model prices (USD per million tokens), each in force from its
`effective_from`. Past versions are never edited; a request is priced by the version in force
when it was admitted, as this process's book has it (reloaded every `refresh_seconds`), and its
ledger row keeps that version's and override's ids, which invoices bill (`stamped`).

Per-account overrides are versioned the same way, per (account, model) where model may be "*"
(every model): a custom price for one model, a multiplier of the base price (a reseller's group
ratio), or `clear` (the override ends). `price_for(account, model, when)` applies, in order: the
account's override for that model, else its "*" multiplier, else the base version.

Money is exact: base prices are Decimal with at most 3 decimal places per million tokens, so a
token's base price is a whole number of nano-USD (1e-9), the unit quotas and the ledger count in.
Multipliers have at most 6 places, so an effective price has at most 9; `EffectivePrice.cost_nanos`
rounds half up to whole nano-USD once per request.

A version may set a cached-input price: prompt tokens the engine served from its prefix cache
(the ledger's `cached_tokens`) cost that instead of the input price. Without one, or when the
engine did not say, every prompt token costs the input price.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import decimal
import functools
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.decimals import plain_decimal
from billing.invoices.models import ANY_MODEL, BillingPeriod, PriceOverride
from billing.models import Price, utcnow

log = logging.getLogger("tollgate.prices")
PRICES = Price.__table__
OVERRIDES = PriceOverride.__table__
PERIODS = BillingPeriod.__table__
NANOS_PER_MILLION_UNIT = 1000  # USD per 1e6 tokens -> nano-USD per token
MAX_PRICE_PLACES = 3
MAX_MULTIPLIER_PLACES = 6
PAST_SLACK = timedelta(seconds=60)
# Enough digits for tokens (< 1e15) x prices (< 1e15, 9 places) without any rounding.
EXACT = decimal.Context(prec=80)
# A ledger row's price_version_id when its admission found no price in force (no version has id 0).
UNPRICED = 0


class InvalidPrice(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the field it names, for the API's error


class PriceConflict(InvalidPrice):
    """A version for the same model (and account) already starts at that instant."""


def parse_price(value: Any, field: str) -> Decimal:
    """A non-negative USD-per-million price with at most 3 decimal places; floats are refused."""
    if isinstance(value, bool) or isinstance(value, float) or value is None:
        raise InvalidPrice(f"{field} must be a decimal string or integer, e.g. \"0.150\"", field)
    try:
        price = plain_decimal(value)
    except InvalidOperation:
        raise InvalidPrice(f"{field} must be a decimal number", field) from None
    if not price.is_finite() or price < 0:
        raise InvalidPrice(f"{field} must be a non-negative number", field)
    if price >= Decimal(10) ** 15:  # before quantize, which cannot hold huge values
        raise InvalidPrice(f"{field} is too large", field)
    if price != price.quantize(Decimal(1).scaleb(-MAX_PRICE_PLACES)):
        raise InvalidPrice(f"{field} may have at most {MAX_PRICE_PLACES} decimal places (USD per million tokens)", field)
    return price


@dataclass(frozen=True)
class PriceVersion:
    id: int
    model: str
    input_per_million: Decimal
    output_per_million: Decimal
    currency: str
    effective_from: datetime
    cached_input_per_million: Decimal | None = None
    batch_input_per_million: Decimal | None = None  # a batch line's price; None: the normal one
    batch_output_per_million: Decimal | None = None
    created_at: datetime | None = None  # when it was added (later than effective_from: backdated)

    def cost_nanos(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> int:
        per_in = int(self.input_per_million * NANOS_PER_MILLION_UNIT)
        per_out = int(self.output_per_million * NANOS_PER_MILLION_UNIT)
        cached = cached_part(prompt_tokens, cached_tokens, self.cached_input_per_million)
        per_cached = int(self.cached_input_per_million * NANOS_PER_MILLION_UNIT) if cached else 0
        return (prompt_tokens - cached) * per_in + cached * per_cached + completion_tokens * per_out

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "price",
            "model": self.model,
            "input_per_million": str(self.input_per_million),
            "output_per_million": str(self.output_per_million),
            "cached_input_per_million": _str(self.cached_input_per_million),
            "batch_input_per_million": _str(self.batch_input_per_million),
            "batch_output_per_million": _str(self.batch_output_per_million),
            "currency": self.currency,
            "effective_from": self.effective_from.isoformat(),
        }


def cached_part(prompt_tokens: int, cached_tokens: int | None, cached_price: Decimal | None) -> int:
    """The prompt tokens priced at the cached-input price: none without one or when the engine did not say."""
    if cached_price is None or not cached_tokens or cached_tokens < 0:
        return 0
    return min(cached_tokens, prompt_tokens)


def parse_multiplier(value: Any, field: str = "multiplier") -> Decimal:
    """A positive multiplier with at most 6 decimal places; floats are refused."""
    if isinstance(value, bool) or isinstance(value, float) or value is None:
        raise InvalidPrice(f"{field} must be a decimal string or integer, e.g. \"0.85\"", field)
    try:
        multiplier = plain_decimal(value)
    except InvalidOperation:
        raise InvalidPrice(f"{field} must be a decimal number", field) from None
    if not multiplier.is_finite() or multiplier <= 0:
        raise InvalidPrice(f"{field} must be a positive number", field)
    if multiplier >= 1_000_000:
        raise InvalidPrice(f"{field} is too large", field)
    if multiplier != multiplier.quantize(Decimal(1).scaleb(-MAX_MULTIPLIER_PLACES)):
        raise InvalidPrice(f"{field} may have at most {MAX_MULTIPLIER_PLACES} decimal places", field)
    return multiplier


@dataclass(frozen=True)
class OverrideVersion:
    id: int
    account_id: int
    model: str  # or "*"
    kind: str  # price | multiplier | clear
    input_per_million: Decimal | None
    output_per_million: Decimal | None
    multiplier: Decimal | None
    effective_from: datetime
    cached_input_per_million: Decimal | None = None  # a custom price's; None: cached tokens at its input price
    created_at: datetime | None = None  # when it was added (later than effective_from: backdated)

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "price_override",
            "account_id": self.account_id,
            "model": self.model,
            "kind": self.kind,
            "input_per_million": _str(self.input_per_million),
            "output_per_million": _str(self.output_per_million),
            "cached_input_per_million": _str(self.cached_input_per_million),
            "multiplier": _str(self.multiplier),
            "effective_from": self.effective_from.isoformat(),
        }


@dataclass(frozen=True)
class EffectivePrice:
    """The price an account's request pays: a base version, possibly overridden. Offers the same
    `cost_nanos` as `PriceVersion`, so either can price a request."""

    model: str
    input_per_million: Decimal
    output_per_million: Decimal
    currency: str
    version: PriceVersion | None  # None under a custom price override
    override: OverrideVersion | None
    cached_input_per_million: Decimal | None = None  # None: cached prompt tokens cost the input price
    batch_input_per_million: Decimal | None = None  # what a batch line pays; None: input_per_million
    batch_output_per_million: Decimal | None = None
    batched: bool = False  # this is the batch price (`for_batch()`)

    def for_batch(self) -> "EffectivePrice":
        """The price a line of a batch pays: the batch price where the version has one, else this
        one; cached prompt tokens of a batch line pay its input price."""
        if self.batched:
            return self
        return dataclasses.replace(
            self,
            input_per_million=self.input_per_million if self.batch_input_per_million is None else self.batch_input_per_million,
            output_per_million=self.output_per_million if self.batch_output_per_million is None else self.batch_output_per_million,
            cached_input_per_million=None,
            batched=True,
        )

    @property
    def price_version_id(self) -> int | None:
        return self.version.id if self.version else None

    @property
    def override_id(self) -> int | None:
        return self.override.id if self.override else None

    @property
    def id(self) -> int | None:
        return self.price_version_id

    @functools.cached_property
    def _whole_nanos(self) -> tuple[int, int, int] | None:
        """Nano-units per input, output and cached-input token when all are whole numbers (every
        base price: 3 decimal places), else None (a multiplier can leave fractions of a nano-unit)."""
        units = [EXACT.multiply(p, Decimal(NANOS_PER_MILLION_UNIT))
                 for p in (self.input_per_million, self.output_per_million, self.cached_input_per_million or Decimal(0))]
        if all(u == u.to_integral_value() for u in units):
            return int(units[0]), int(units[1]), int(units[2])
        return None

    def cost_nanos(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> int:
        cached = cached_part(prompt_tokens, cached_tokens, self.cached_input_per_million)
        whole = self._whole_nanos
        if whole is not None:  # integer arithmetic, the same exact result
            return (prompt_tokens - cached) * whole[0] + completion_tokens * whole[1] + cached * whole[2]
        exact = EXACT.add(
            EXACT.multiply(Decimal(prompt_tokens - cached), self.input_per_million),
            EXACT.multiply(Decimal(completion_tokens), self.output_per_million),
        )
        if cached:
            assert self.cached_input_per_million is not None
            exact = EXACT.add(exact, EXACT.multiply(Decimal(cached), self.cached_input_per_million))
        return int(EXACT.multiply(exact, Decimal(NANOS_PER_MILLION_UNIT)).quantize(Decimal(1), ROUND_HALF_UP, EXACT))

    def view(self) -> dict[str, Any]:
        return {
            "object": "effective_price",
            "model": self.model,
            "input_per_million": format(self.input_per_million, "f"),
            "output_per_million": format(self.output_per_million, "f"),
            "cached_input_per_million": _str(self.cached_input_per_million),
            "currency": self.currency,
            "price_version": self.version.view() if self.version else None,
            "override": self.override.view() if self.override else None,
        }


def _tidy(value: Decimal) -> Decimal:
    """Exact (a base price has 3 places, a multiplier 6), shown with 3 to 9 places."""
    exact = value.quantize(Decimal("1e-9"), context=EXACT)
    places = max(3, -int(exact.normalize(EXACT).as_tuple().exponent))
    return exact.quantize(Decimal(1).scaleb(-places), context=EXACT)


def _str(value: Decimal | None) -> str | None:
    return None if value is None else format(value, "f")


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def _override(row: Any) -> OverrideVersion:
    def dec(value: Any, places: str) -> Decimal | None:
        return None if value is None else Decimal(value).quantize(Decimal(places))

    return OverrideVersion(
        id=row.id,
        account_id=row.account_id,
        model=row.model,
        kind=row.kind,
        input_per_million=dec(row.input_per_million, "0.001"),
        output_per_million=dec(row.output_per_million, "0.001"),
        multiplier=dec(row.multiplier, "0.000001"),
        effective_from=_aware(row.effective_from),
        cached_input_per_million=dec(row.cached_input_per_million, "0.001"),
        created_at=_aware(row.created_at) if getattr(row, "created_at", None) is not None else None,
    )


def _compose(model: str, base: PriceVersion | None, override: OverrideVersion | None) -> EffectivePrice | None:
    """A base version under an account's override (a custom price, a multiplier; None: none)."""
    if override is not None and override.kind == "price":
        assert override.input_per_million is not None and override.output_per_million is not None
        return EffectivePrice(model, override.input_per_million, override.output_per_million, "USD", None, override,
                              override.cached_input_per_million)
    if base is None:
        return None
    if override is None:
        return EffectivePrice(model, base.input_per_million, base.output_per_million, base.currency, base, None,
                              base.cached_input_per_million, base.batch_input_per_million, base.batch_output_per_million)
    assert override.multiplier is not None
    multiplier = override.multiplier

    def scaled(value: Decimal | None) -> Decimal | None:
        return None if value is None else _tidy(EXACT.multiply(value, multiplier))

    return EffectivePrice(
        model,
        _tidy(EXACT.multiply(base.input_per_million, multiplier)),
        _tidy(EXACT.multiply(base.output_per_million, multiplier)),
        base.currency,
        base,
        override,
        scaled(base.cached_input_per_million),
        scaled(base.batch_input_per_million),
        scaled(base.batch_output_per_million),
    )


_FOREVER = datetime.max.replace(tzinfo=timezone.utc)


def _backdated(version: PriceVersion | OverrideVersion) -> bool:
    return version.created_at is not None and version.created_at - version.effective_from > PAST_SLACK


def _in_force(versions: list[Any] | None, when: datetime) -> Any:
    return _around(versions, when)[0]


def _around(versions: list[Any] | None, when: datetime) -> tuple[Any, datetime]:
    """(the version in force at `when`, or None; the instant the next one takes effect, or _FOREVER)."""
    if not versions:
        return None, _FOREVER
    starts = [v.effective_from for v in versions]
    i = bisect.bisect_right(starts, _aware(when))
    return (versions[i - 1] if i else None), (starts[i] if i < len(starts) else _FOREVER)


def _version(row: Any) -> PriceVersion:
    return PriceVersion(
        id=row.id,
        model=row.model,
        input_per_million=Decimal(row.input_per_million).quantize(Decimal("0.001")),
        output_per_million=Decimal(row.output_per_million).quantize(Decimal("0.001")),
        currency=row.currency,
        effective_from=_aware(row.effective_from),
        cached_input_per_million=(
            None if row.cached_input_per_million is None else Decimal(row.cached_input_per_million).quantize(Decimal("0.001"))
        ),
        batch_input_per_million=_places(getattr(row, "batch_input_per_million", None)),
        batch_output_per_million=_places(getattr(row, "batch_output_per_million", None)),
        created_at=_aware(row.created_at) if getattr(row, "created_at", None) is not None else None,
    )


def _places(value: Any) -> Decimal | None:
    return None if value is None else Decimal(value).quantize(Decimal("0.001"))


class PriceBook:
    """Price versions cached in memory, reloaded at most every `refresh_seconds`."""

    def __init__(self, engine: AsyncEngine, *, refresh_seconds: float = 5.0) -> None:
        self._engine = engine
        self._refresh_seconds = refresh_seconds
        self._loaded_at = float("-inf")
        self._loading: asyncio.Future[None] | None = None
        self._by_model: dict[str, list[PriceVersion]] = {}
        self._overrides: dict[tuple[int, str], list[OverrideVersion]] = {}
        self._by_id: dict[int, PriceVersion] = {}
        self._override_by_id: dict[int, OverrideVersion] = {}
        # (account, model) -> (what it pays now, the next instant a version of its takes effect):
        # one EffectivePrice per pair until then or the next reload, not one per request.
        self._current: dict[tuple[int, str], tuple[EffectivePrice | None, datetime]] = {}

    async def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._loaded_at < self._refresh_seconds:
            return
        if force:
            await self._load(force=True)
            return
        # Requests that find the book stale together share one read.
        if self._loading is None or self._loading.done():
            self._loading = asyncio.ensure_future(self._load(force=False))
        await asyncio.shield(self._loading)

    async def _load(self, force: bool) -> None:
        try:
            async with self._engine.connect() as conn:
                rows = (await conn.execute(sa.select(PRICES).order_by(PRICES.c.model, PRICES.c.effective_from))).all()
                override_rows = (await conn.execute(sa.select(OVERRIDES).order_by(OVERRIDES.c.effective_from))).all()
        except Exception as exc:
            if force or self._loaded_at == float("-inf"):
                raise
            # The database is unreachable: serving goes on at the prices already loaded; retry in a second.
            log.warning("price book not refreshed, keeping the loaded prices: %s", type(exc).__name__)
            self._loaded_at = time.monotonic() - self._refresh_seconds + 1.0
            return
        by_model: dict[str, list[PriceVersion]] = {}
        for row in rows:
            by_model.setdefault(row.model, []).append(_version(row))
        overrides: dict[tuple[int, str], list[OverrideVersion]] = {}
        for row in override_rows:
            overrides.setdefault((row.account_id, row.model), []).append(_override(row))
        self._by_model = by_model
        self._overrides = overrides
        self._by_id = {v.id: v for vs in by_model.values() for v in vs}
        self._override_by_id = {v.id: v for vs in overrides.values() for v in vs}
        self._current = {}
        self._loaded_at = time.monotonic()

    def price_at(self, model: str, when: datetime) -> PriceVersion | None:
        """The base version in force for `model` at `when` (no account overrides)."""
        result: PriceVersion | None = _in_force(self._by_model.get(model), when)
        return result

    def price_for(self, account_id: int, model: str, when: datetime) -> EffectivePrice | None:
        """What `account_id` pays for `model` at `when`: its override for the model, else its "*"
        multiplier, else the base version. None when nothing prices the model then."""
        specific = self._active_override(account_id, model, when)
        return _compose(model, self.price_at(model, when), specific or self._active_override(account_id, ANY_MODEL, when))

    def stamped(self, model: str, version_id: int | None, override_id: int | None) -> EffectivePrice | None:
        """The price a ledger row was admitted at, from the ids it keeps (`EffectivePrice`'s
        price_version_id and override_id; UNPRICED and None: none). Versions are never deleted, so
        the book has every id a row names once it was reloaded after the admission; KeyError if not."""
        base = None if version_id in (None, UNPRICED) else self._by_id[version_id]
        return _compose(model, base, None if override_id is None else self._override_by_id[override_id])

    def billed(self, account_id: int, model: str, at: datetime, version_id: int | None, override_id: int | None) -> EffectivePrice | None:
        """What invoices bill a ledger row at (billing/invoices/close.py): the price it was admitted
        at (its ids), except the one in force at `at` for a row from before migration 0025 (no ids)
        and for a row a version backdated later re-prices (what `--backdate` is for: an open
        period's rows at the price they should have had). KeyError for an id the book does not hold."""
        if (version_id is None and override_id is None) or self.backdated_over(account_id, model, at):
            return self.price_for(account_id, model, at)
        return self.stamped(model, version_id, override_id)

    def _active_override(self, account_id: int, model: str, when: datetime) -> OverrideVersion | None:
        version: OverrideVersion | None = _in_force(self._overrides.get((account_id, model)), when)
        return None if version is None or version.kind == "clear" else version

    def breakpoints(self, account_id: int, start: datetime, end: datetime) -> list[datetime]:
        """Instants strictly inside (start, end) where some price this account pays may change, and
        where a backdated version was added (`backdated_over` changes there)."""
        start, end = _aware(start), _aware(end)
        versions = [*(v for vs in self._by_model.values() for v in vs),
                    *(v for (acct, _), vs in self._overrides.items() if acct == account_id for v in vs)]
        instants = {v.effective_from for v in versions} | {v.created_at for v in versions if _backdated(v)}
        return sorted(t for t in instants if start < t < end)

    def backdated_over(self, account_id: int, model: str, at: datetime) -> bool:
        """Whether a version added with `backdate` (its start more than PAST_SLACK before it was
        added) may price (account, model) at `at` and was added after `at`: requests admitted then
        were priced before it existed, and it is there to re-price them (an open period's invoice)."""
        at = _aware(at)
        return any(_backdated(v) and v.effective_from <= at < v.created_at for versions in (
            self._by_model.get(model), self._overrides.get((account_id, model)), self._overrides.get((account_id, ANY_MODEL)))
            for v in versions or ())

    def models(self) -> list[str]:
        return sorted(self._by_model)

    async def current_for(self, account_id: int, model: str, at: datetime | None = None) -> EffectivePrice | None:
        """The price in force now, or at `at` (a request's admission instant, which its ledger row keeps)."""
        if time.monotonic() - self._loaded_at >= self._refresh_seconds:
            if self._loaded_at == float("-inf"):
                await self.refresh()  # nothing to price with yet
            elif self._loading is None or self._loading.done():
                # Stale: re-read in the background and price with the book in hand meanwhile (as a
                # failed read does too). Awaiting the read here made a burst that came after a quiet
                # spell wait for one database round trip behind every request of the burst.
                self._loading = asyncio.ensure_future(self._load(force=False))
        now = at or utcnow()
        pair = (account_id, model)
        hit = self._current.get(pair)
        if hit is not None and now < hit[1]:
            return hit[0]
        price = self.price_for(account_id, model, now)
        self._current[pair] = (price, self._next_change(account_id, model, now))
        return price

    def _next_change(self, account_id: int, model: str, now: datetime) -> datetime:
        """The first instant after `now` at which a version that can price (account, model) takes
        effect: its base price, its override for the model, its "*" multiplier."""
        return min(_around(versions, now)[1] for versions in (
            self._by_model.get(model), self._overrides.get((account_id, model)), self._overrides.get((account_id, ANY_MODEL))))

    async def overrides(self, account_id: int) -> list[OverrideVersion]:
        await self.refresh(force=True)
        found = [v for (acct, _), vs in self._overrides.items() if acct == account_id for v in vs]
        return sorted(found, key=lambda v: (v.model, v.effective_from))

    async def current(self, model: str) -> PriceVersion | None:
        await self.refresh()
        return self.price_at(model, utcnow())

    async def list(self, model: str | None = None) -> list[PriceVersion]:
        await self.refresh(force=True)
        out = [v for m, vs in sorted(self._by_model.items()) if model in (None, m) for v in vs]
        return out

    async def add(
        self,
        model: str,
        input_per_million: Any,
        output_per_million: Any,
        effective_from: datetime | None = None,
        *,
        backdate: bool = False,
        cached_input_per_million: Any = None,
        batch_input_per_million: Any = None,
        batch_output_per_million: Any = None,
    ) -> PriceVersion:
        """Adds a version. Scheduling in the past is refused (past versions are never rewritten),
        unless `backdate`, which still refuses any instant inside a closed billing period."""
        now = utcnow()
        start = _aware(effective_from) if effective_from else now
        if not model or len(model) > 128:
            raise InvalidPrice("model must be a model id of 1 to 128 characters", "model")
        values = dict(
            model=model,
            input_per_million=parse_price(input_per_million, "input_per_million"),
            output_per_million=parse_price(output_per_million, "output_per_million"),
            cached_input_per_million=(
                None if cached_input_per_million is None else parse_price(cached_input_per_million, "cached_input_per_million")
            ),
            batch_input_per_million=None if batch_input_per_million is None else parse_price(batch_input_per_million, "batch_input_per_million"),
            batch_output_per_million=(
                None if batch_output_per_million is None else parse_price(batch_output_per_million, "batch_output_per_million")
            ),
            currency="USD",
            effective_from=start,
            created_at=now,
        )
        try:
            async with self._engine.begin() as conn:
                await _check_start(conn, start, now, backdate)
                row = (await conn.execute(PRICES.insert().values(**values).returning(*PRICES.c))).one()
        except IntegrityError:
            raise PriceConflict(f"a price for {model!r} already starts at {start.isoformat()}") from None
        await self.refresh(force=True)
        return _version(row)

    async def add_override(
        self,
        account_id: int,
        model: str,
        *,
        input_per_million: Any = None,
        output_per_million: Any = None,
        multiplier: Any = None,
        clear: bool = False,
        effective_from: datetime | None = None,
        backdate: bool = False,
        cached_input_per_million: Any = None,
    ) -> OverrideVersion:
        """Adds a version of an account's override: custom prices (both directions, and optionally a
        cached-input price), a multiplier, or `clear`. Same time rules as `add`. Model "*" takes a
        multiplier or clear only."""
        now = utcnow()
        start = _aware(effective_from) if effective_from else now
        if not model or len(model) > 128:
            raise InvalidPrice("model must be a model id of 1 to 128 characters, or \"*\"", "model")
        has_prices = input_per_million is not None or output_per_million is not None
        if cached_input_per_million is not None and not has_prices:
            raise InvalidPrice("cached_input_per_million goes with a custom price (input_per_million and output_per_million)")
        if sum([has_prices, multiplier is not None, bool(clear)]) != 1:
            raise InvalidPrice("give exactly one of: input_per_million and output_per_million, multiplier, or clear")
        values: dict[str, Any] = dict(account_id=account_id, model=model, effective_from=start, created_at=now)
        if has_prices:
            if model == ANY_MODEL:
                raise InvalidPrice('a custom price needs one model; "*" takes a multiplier')
            values.update(
                kind="price",
                input_per_million=parse_price(input_per_million, "input_per_million"),
                output_per_million=parse_price(output_per_million, "output_per_million"),
                cached_input_per_million=(None if cached_input_per_million is None
                                          else parse_price(cached_input_per_million, "cached_input_per_million")),
            )
        elif multiplier is not None:
            values.update(kind="multiplier", multiplier=parse_multiplier(multiplier))
        else:
            values.update(kind="clear")
        try:
            async with self._engine.begin() as conn:
                await _check_start(conn, start, now, backdate)
                row = (await conn.execute(OVERRIDES.insert().values(**values).returning(*OVERRIDES.c))).one()
        except IntegrityError:
            # The unique (account, model, effective_from), or an account that does not exist.
            raise PriceConflict(f"an override of {model!r} for this account already starts at {start.isoformat()}") from None
        await self.refresh(force=True)
        return _override(row)


async def _check_start(conn: Any, start: datetime, now: datetime, backdate: bool) -> None:
    """Past instants are refused; with `backdate`, only those inside a closed (or closing) period."""
    if start >= now - PAST_SLACK:
        return
    if not backdate:
        raise InvalidPrice("effective_from must not be in the past: billed periods are never re-priced", "effective_from")
    latest_end = (await conn.execute(sa.select(sa.func.max(PERIODS.c.period)))).scalar_one_or_none()
    if latest_end is not None:
        year, month = (int(x) for x in latest_end.split("-"))
        closed_until = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=timezone.utc)
        if start < closed_until:
            raise InvalidPrice(f"effective_from falls in billing period {latest_end} or earlier, which is closed", "effective_from")
