"""How prepaid credit reads outside the database: nano-USD as USD strings, a credit row as JSON.

Shared by the credit book (billing/credits/balance.py) and the monthly statement (billing/invoices/statements.py),
which also reads the credit book's month: kept apart so that neither imports the other for these.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

NANOS_PER_USD = 10**9


def usd(nanos: int) -> str:
    sign = "-" if nanos < 0 else ""
    return f"{sign}{abs(nanos) // NANOS_PER_USD}.{abs(nanos) % NANOS_PER_USD:09d}"


def aware(dt: datetime | None) -> datetime | None:
    """A database timestamp as UTC (SQLite hands them back naive)."""
    return None if dt is None else dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def iso(dt: datetime | None) -> str | None:
    value = aware(dt)
    return None if value is None else value.isoformat()


def entry_view(row: Any) -> dict[str, Any]:
    return {
        "id": int(row.id), "object": "credit_entry", "account_id": row.account_id, "kind": row.kind,
        "amount_nanos": int(row.amount_nanos), "amount": usd(int(row.amount_nanos)),
        "grant_id": row.grant_id, "expires_at": iso(row.expires_at), "usage_until": iso(row.usage_until),
        "reason": row.reason, "admin_key_id": row.admin_key_id, "external_id": row.external_id,
        "created_at": iso(row.created_at),
    }
