"""Limits set per key and per account (an account's caps all its keys together).

    rpm             requests per minute
    tpm             tokens (prompt + completion) per minute
    max_concurrent  requests in flight
    monthly_tokens  tokens per calendar month (UTC)
    monthly_spend   USD per calendar month (exact decimal, at most 9 places), priced by the price book
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from decimal import Decimal, InvalidOperation
from typing import Any

from billing.decimals import plain_decimal

NANOS_PER_USD = 10**9
INT_LIMITS = ("rpm", "tpm", "max_concurrent", "monthly_tokens")
MAX_INT_LIMIT = 2**53 - 1  # exact in Redis' Lua numbers


class InvalidLimits(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    monthly_tokens: int | None = None
    monthly_spend: Decimal | None = None

    @property
    def empty(self) -> bool:
        return (self.rpm is None and self.tpm is None and self.max_concurrent is None
                and self.monthly_tokens is None and self.monthly_spend is None)

    @property
    def monthly_spend_nanos(self) -> int | None:
        return None if self.monthly_spend is None else int(self.monthly_spend * NANOS_PER_USD)

    def to_json(self) -> str | None:
        view = self.view()
        return json.dumps(view) if view else None

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = format(value, "f") if isinstance(value, Decimal) else value  # never "1E-7"
        return out

    @classmethod
    def from_json(cls, raw: str | None) -> "Limits":
        if not raw:
            return cls()
        stored = json.loads(raw)
        spend = stored.get("monthly_spend") if isinstance(stored, dict) else None
        if isinstance(spend, str):  # ours: written before view() wrote plain decimals, it may read "1E-7" or "0E-9"
            stored["monthly_spend"] = format(Decimal(spend), "f")
        return cls().patched(stored)

    def patched(self, changes: Any) -> "Limits":
        """Applies a PATCH-style object: a value sets a limit, null removes it, absent keys stay."""
        if not isinstance(changes, dict):
            raise InvalidLimits("limits must be an object", "limits")
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InvalidLimits(f"unknown limit {unknown[0]!r}; known: {', '.join(sorted(known))}", f"limits.{unknown[0]}")
        updates: dict[str, Any] = {}
        for name, value in changes.items():
            updates[name] = None if value is None else _parse(name, value)
        return replace(self, **updates)


def _parse(name: str, value: Any) -> int | Decimal:
    param = f"limits.{name}"
    if name in INT_LIMITS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidLimits(f"{name} must be a non-negative integer or null", param)
        if value < 0 or value > MAX_INT_LIMIT:
            raise InvalidLimits(f"{name} must be between 0 and {MAX_INT_LIMIT}", param)
        return value
    if isinstance(value, bool) or isinstance(value, float) or not isinstance(value, (int, str)):
        raise InvalidLimits(f"{name} must be a decimal string like \"25.00\" (or an integer), not a float", param)
    try:
        amount = plain_decimal(value)
    except InvalidOperation:
        raise InvalidLimits(f"{name} must be a decimal number of USD", param) from None
    if not amount.is_finite() or amount < 0:
        raise InvalidLimits(f"{name} must be a non-negative amount of USD", param)
    # Compared in USD, before any arithmetic: "1e999999" * 10**9 overflows the decimal context, and
    # 1e400 cannot be quantized at all.
    if amount > Decimal(MAX_INT_LIMIT).scaleb(-9):
        raise InvalidLimits(f"{name} is too large", param)
    if amount != amount.quantize(Decimal("1e-9")):
        raise InvalidLimits(f"{name} may have at most 9 decimal places", param)
    return amount
