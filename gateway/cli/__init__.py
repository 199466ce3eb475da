"""The `tollgate` command line."""

from __future__ import annotations

import argparse

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
