"""The `tollgate` command line."""

from __future__ import annotations

import argparse
from datetime import datetime

from billing.models import given_instant
from gateway.http.requests import MAX_ID


def bounded(low: int, high: int, what: str = "a whole number"):  # type: ignore[no-untyped-def]
    """An argparse type: an integer from `low` to `high`, or argparse's own error naming the range."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not {what}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{raw} is not from {low} to {high}")
        return value

    return parse


db_id = bounded(1, MAX_ID, "an id")  # ids are 32-bit in the database


def port_number(raw: str) -> int:
    """An argparse type: a TCP port, 1 to 65535 (uvicorn took 70000 modulo 65536, and 0 as unset)."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a port number (1 to 65535)")
    return value


def iso_time(raw: str) -> datetime:
    """An argparse type: an ISO 8601 time, in UTC (one without an offset is UTC), within what the API
    takes (billing.models.given_instant), or argparse's own error saying why."""
    try:
        value = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an ISO 8601 time") from None
    try:
        return given_instant(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{raw!r} {exc}") from None
