"""Amounts given over the API as a JSON integer or a plain decimal string ("12.50", "-3", ".5"),
read exactly. Python's Decimal also reads "1_000", " 1 ", "1e3", "NaN" and "-0": spellings no
client means as an amount, and "-0" prints as "-0.000"; those are refused, and zero is zero."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_PLAIN = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")


def plain_decimal(value: Any) -> Decimal:
    """The amount `value` (an int, a Decimal, or a string as above) says; InvalidOperation for anything else."""
    if isinstance(value, bool) or not (isinstance(value, (int, Decimal)) or (isinstance(value, str) and _PLAIN.fullmatch(value))):
        raise InvalidOperation(f"not a plain decimal: {value!r}")
    amount = Decimal(value)
    return amount if amount else abs(amount)  # "-0.00" is 0.00
