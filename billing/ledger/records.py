"""What one admitted request leaves in the ledger: `UsageRecord`, the row the writer queues.

Its own module so that the writer (billing/ledger/writer.py) and the aggregates (billing/ledger/aggregates.py) both
depend on it and not on each other (an import cycle otherwise).
`billing.ledger.writer.UsageRecord` remains the name callers use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from billing.models import LedgerEntry, as_utc, utcnow

__all__ = ["BILLED_STATUSES", "UsageRecord", "spends_balance"]

# The rows invoices bill (tokens really delivered; a cancelled row holds what was generated until the
# client left). Any other row (`error`, `interrupted`) costs nothing: its cost_nanos is 0, so what a
# prepaid balance, a spend limit and a statement take of it is what an invoice bills, nothing.
BILLED_STATUSES = ("completed", "cancelled")


def spends_balance(since: Any) -> Any:
    """Whether a ledger row is a prepaid balance's (SQL): admitted at or after `since`, the account's
    `prepaid_since` (a value or its column), for a key the account was prepaid for (not `postpaid`).
    These are the rows whose quota holds counted against the balance: a request admitted before the
    switch, or authenticated just before it (a key cached for a second, another process), held none
    and is invoiced, however late it finishes. A row written before migration 0022 (`postpaid` NULL)
    stays under the rule it was posted and invoiced under: finished at or after `since`."""
    c = LedgerEntry.__table__.c
    return sa.or_(sa.and_(c.postpaid.is_(False), c.admitted_at >= since),
                  sa.and_(c.postpaid.is_(None), c.created_at >= since))


@dataclass
class UsageRecord:
    request_id: str
    account_id: int
    key_id: int
    model: str
    prompt_tokens: int
    completion_tokens: int
    status: str
    finish_reason: str | None
    total_ms: float
    queue_ms: float | None = None
    ttft_ms: float | None = None
    estimated: bool = False
    cost_nanos: int | None = None
    cached: bool = False  # served from the response cache
    cached_tokens: int | None = None  # prompt tokens served from the engine's prefix cache, when it said
    api: str | None = None  # chat | completions | embeddings | messages | responses | batch
    batch_id: str | None = None  # the batch it was a line of (api = batch)
    postpaid: bool = False  # admitted for a key whose account was postpaid then: never a prepaid balance's
    # The price it was admitted at, which invoices bill (billing/models.py: LedgerEntry); None, None:
    # unstamped (priced by admitted_at); billing.prices.book.UNPRICED, None: admitted with no price in force.
    price_version_id: int | None = None
    override_id: int | None = None
    created_at: datetime = field(default_factory=utcnow)  # when it finished
    # When it was admitted (its price looked up): prices it and decides its hour, day and month.
    # None: derived as created_at minus total_ms (what migration 0010 backfilled).
    admitted_at: datetime | None = None

    def __post_init__(self) -> None:
        # One instant whatever offset it came with: hours, days and months are UTC's everywhere (the
        # aggregates' hour cache keys on the clock reading, and SQLite keeps no offset).
        self.created_at = as_utc(self.created_at)
        if self.admitted_at is None:
            self.admitted_at = self.created_at - timedelta(milliseconds=self.total_ms or 0.0)
        else:
            self.admitted_at = as_utc(self.admitted_at)
        if self.cached_tokens is not None and not 0 <= self.cached_tokens <= self.prompt_tokens:
            # part of the prompt, as invoices and statements count it: the aggregates and dashboards too
            self.cached_tokens = max(0, min(self.cached_tokens, self.prompt_tokens))

