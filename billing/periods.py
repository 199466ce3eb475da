"""Billing periods: calendar months in UTC, written "2026-11"."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

_PERIOD = re.compile(r"^(\d{4})-(\d{2})$")


class InvalidPeriod(ValueError):
    pass


@dataclass(frozen=True, order=True)
class Period:
    year: int
    month: int

    @classmethod
    def parse(cls, text: str) -> "Period":
        match = _PERIOD.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise InvalidPeriod(f"period must look like 2026-11 (year-month), got {text!r}")
        year, month = int(match.group(1)), int(match.group(2))
        if not 1 <= month <= 12 or year < 1970:
            raise InvalidPeriod(f"period {text!r} is not a month")
        return cls(year, month)

    @classmethod
    def containing(cls, when: datetime) -> "Period":
        when = when.astimezone(timezone.utc) if when.tzinfo else when
        return cls(when.year, when.month)

    @property
    def start(self) -> datetime:
        return datetime(self.year, self.month, 1, tzinfo=timezone.utc)

    @property
    def end(self) -> datetime:
        return self.next().start

    def next(self) -> "Period":
        return Period(self.year + self.month // 12, self.month % 12 + 1)

    def prev(self) -> "Period":
        return Period(self.year - (self.month == 1), (self.month - 2) % 12 + 1)

    def minus(self, months: int) -> "Period":
        index = self.year * 12 + self.month - 1 - months
        return Period(index // 12, index % 12 + 1)

    def __str__(self) -> str:
        return f"{self.year:04d}-{self.month:02d}"
