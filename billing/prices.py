"""The price book: versions of per-model prices (USD per million tokens), each in force from its
`effective_from`. Past versions are never edited; a request is priced by the version in force
when it ran.

Money is exact: prices are Decimal with at most 3 decimal places per million tokens, so a
token's price is a whole number of nano-USD (1e-9), the unit quotas and the ledger count in.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.models import Price, utcnow

PRICES = Price.__table__
NANOS_PER_MILLION_UNIT = 1000  # USD per 1e6 tokens -> nano-USD per token
MAX_PRICE_PLACES = 3


class InvalidPrice(ValueError):
    pass


def parse_price(value: Any, field: str) -> Decimal:
    """A non-negative USD-per-million price with at most 3 decimal places; floats are refused."""
    if isinstance(value, bool) or isinstance(value, float) or value is None:
        raise InvalidPrice(f"{field} must be a decimal string or integer, e.g. \"0.150\"")
    try:
        price = Decimal(str(value))
    except InvalidOperation:
        raise InvalidPrice(f"{field} must be a decimal number") from None
    if not price.is_finite() or price < 0:
        raise InvalidPrice(f"{field} must be a non-negative number")
    if price != price.quantize(Decimal(1).scaleb(-MAX_PRICE_PLACES)):
        raise InvalidPrice(f"{field} may have at most {MAX_PRICE_PLACES} decimal places (USD per million tokens)")
    if price >= Decimal(10) ** 15:
        raise InvalidPrice(f"{field} is too large")
    return price


@dataclass(frozen=True)
class PriceVersion:
    id: int
    model: str
    input_per_million: Decimal
    output_per_million: Decimal
    currency: str
    effective_from: datetime

    def cost_nanos(self, prompt_tokens: int, completion_tokens: int) -> int:
        per_in = int(self.input_per_million * NANOS_PER_MILLION_UNIT)
        per_out = int(self.output_per_million * NANOS_PER_MILLION_UNIT)
        return prompt_tokens * per_in + completion_tokens * per_out

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "price",
            "model": self.model,
            "input_per_million": str(self.input_per_million),
            "output_per_million": str(self.output_per_million),
            "currency": self.currency,
            "effective_from": self.effective_from.isoformat(),
        }


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def _version(row: Any) -> PriceVersion:
    return PriceVersion(
        id=row.id,
        model=row.model,
        input_per_million=Decimal(row.input_per_million).quantize(Decimal("0.001")),
        output_per_million=Decimal(row.output_per_million).quantize(Decimal("0.001")),
        currency=row.currency,
        effective_from=_aware(row.effective_from),
    )


class PriceBook:
    """Price versions cached in memory, reloaded at most every `refresh_seconds`."""

    def __init__(self, engine: AsyncEngine, *, refresh_seconds: float = 5.0) -> None:
        self._engine = engine
        self._refresh_seconds = refresh_seconds
        self._loaded_at = float("-inf")
        self._by_model: dict[str, list[PriceVersion]] = {}

    async def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._loaded_at < self._refresh_seconds:
            return
        async with self._engine.connect() as conn:
            rows = (await conn.execute(sa.select(PRICES).order_by(PRICES.c.model, PRICES.c.effective_from))).all()
        by_model: dict[str, list[PriceVersion]] = {}
        for row in rows:
            by_model.setdefault(row.model, []).append(_version(row))
        self._by_model = by_model
        self._loaded_at = time.monotonic()

    def price_at(self, model: str, when: datetime) -> PriceVersion | None:
        versions = self._by_model.get(model)
        if not versions:
            return None
        i = bisect.bisect_right([v.effective_from for v in versions], _aware(when))
        return versions[i - 1] if i else None

    async def current(self, model: str) -> PriceVersion | None:
        await self.refresh()
        return self.price_at(model, utcnow())

    async def list(self, model: str | None = None) -> list[PriceVersion]:
        await self.refresh(force=True)
        out = [v for m, vs in sorted(self._by_model.items()) if model in (None, m) for v in vs]
        return out

    async def add(
        self, model: str, input_per_million: Any, output_per_million: Any, effective_from: datetime | None = None
    ) -> PriceVersion:
        """Adds a version. Scheduling in the past is refused: past versions are never rewritten."""
        now = utcnow()
        start = _aware(effective_from) if effective_from else now
        if start < now.replace(microsecond=0) and effective_from is not None and (now - start).total_seconds() > 60:
            raise InvalidPrice("effective_from must not be in the past: billed periods are never re-priced")
        values = dict(
            model=model,
            input_per_million=parse_price(input_per_million, "input_per_million"),
            output_per_million=parse_price(output_per_million, "output_per_million"),
            currency="USD",
            effective_from=start,
            created_at=now,
        )
        async with self._engine.begin() as conn:
            row = (await conn.execute(PRICES.insert().values(**values).returning(*PRICES.c))).one()
        await self.refresh(force=True)
        return _version(row)
