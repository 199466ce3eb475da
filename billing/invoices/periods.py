"""Periods: one type for every span of time billing and usage read, `[start, end)` in UTC.

A billing period is a calendar month, written "2026-11" (`Period.parse`, `Period.month`,
`Period.containing`); the aggregates' readers take any span of whole hours (`Period.covering`,
`Period.last_days`), the hourly tables' resolution. Both are `Period(start, end)`: one type, so a
month can be handed to a usage query as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import MAXYEAR, MINYEAR, datetime, timedelta, timezone

_PERIOD = re.compile(r"^(\d{4})-(\d{2})$")


class InvalidPeriod(ValueError):
    pass


def _hour(at: datetime) -> datetime:
    at = at if at.tzinfo else at.replace(tzinfo=timezone.utc)
    return at.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)


@dataclass(frozen=True, order=True)
class Period:
    start: datetime
    end: datetime

    # months (billing periods) ------------------------------------------------------------------
    @classmethod
    def month(cls, year: int, month: int) -> "Period":
        if not 1 <= month <= 12:
            raise InvalidPeriod(f"month {month} is not 1 to 12")
        if not MINYEAR <= year or (year, month) > (MAXYEAR, 11):  # 9999-12 would end in the year 10000
            raise InvalidPeriod(f"month {year:04d}-{month:02d} is out of range (0001-01 to {MAXYEAR}-11)")
        start = datetime(year, month, 1, tzinfo=timezone.utc)
        return cls(start, datetime(start.year + start.month // 12, start.month % 12 + 1, 1, tzinfo=timezone.utc))

    @classmethod
    def parse(cls, text: str) -> "Period":
        match = _PERIOD.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise InvalidPeriod(f"period must look like 2026-11 (year-month), got {text!r}")
        year, month = int(match.group(1)), int(match.group(2))
        if not 1 <= month <= 12 or year < 1970:
            raise InvalidPeriod(f"period {text!r} is not a month")
        return cls.month(year, month)

    @classmethod
    def containing(cls, when: datetime) -> "Period":
        """The month `when` falls in (a naive datetime is read as UTC)."""
        when = when.astimezone(timezone.utc) if when.tzinfo else when
        return cls.month(when.year, when.month)

    @property
    def is_month(self) -> bool:
        start = self.start
        if (start.day, start.hour, start.minute, start.second, start.microsecond) != (1, 0, 0, 0, 0):
            return False
        try:
            return self.end == Period.month(start.year, start.month).end
        except InvalidPeriod:  # 9999-12: no month ends in the year 10000
            return False

    @property
    def year(self) -> int:
        return self._as_month().start.year

    @property
    def month_number(self) -> int:
        return self._as_month().start.month

    def next(self) -> "Period":
        return self.minus(-1)

    def prev(self) -> "Period":
        return self.minus(1)

    def minus(self, months: int) -> "Period":
        start = self._as_month().start
        index = start.year * 12 + start.month - 1 - months
        return Period.month(index // 12, index % 12 + 1)

    def _as_month(self) -> "Period":
        if not self.is_month:
            raise ValueError(f"{self!r} is not a calendar month")
        return self

    # spans of whole hours (the aggregates' resolution) -------------------------------------------
    @classmethod
    def covering(cls, start: datetime, end: datetime) -> "Period":
        """The whole hours that cover [start, end): at least one. InvalidPeriod when they are not all
        representable (from 0001-01-01 to 9999-12-31 UTC)."""
        try:
            first = _hour(start)
            last = _hour(end)
            if last < end.astimezone(timezone.utc):
                last += timedelta(hours=1)
            return cls(first, max(last, first + timedelta(hours=1)))
        except OverflowError:
            raise InvalidPeriod(f"the hours covering {start.isoformat()} to {end.isoformat()} are out of range") from None

    @classmethod
    def last_days(cls, days: int, now: datetime | None = None) -> "Period":
        """`days` days of whole hours up to the end of the current hour."""
        now = now or datetime.now(timezone.utc)
        end = _hour(now) + timedelta(hours=1)
        return cls(end - timedelta(days=days), end)

    def __str__(self) -> str:
        if self.is_month:
            return f"{self.start.year:04d}-{self.start.month:02d}"
        return f"{self.start.isoformat()}/{self.end.isoformat()}"
