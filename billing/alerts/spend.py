"""Spend alerts: a rule watches one metric of an account (or of one key) and notifies once per crossing.

    monthly_spend   nano-USD this month (the ledger's cost), >= threshold or >= percent of the monthly_spend limit
    monthly_tokens  tokens this month, >= threshold or >= percent of the monthly_tokens limit
    balance_below   a prepaid balance < threshold (nano-USD)

A crossing is recorded as one `alert_events` row, unique on (rule, crossing): the month for the
monthly metrics (by the rows' `admitted_at`, as invoices count them), `below-<n>` for a balance,
where n counts the times the balance was seen back at or above the threshold after a crossing (so
only a rise above re-arms the rule; a top-up that leaves it below does not). Whoever inserts
the row (any process) delivers it; everyone else's insert does nothing. Delivery is a POST of the
event as JSON to the rule's URL, signed like Stripe's webhooks:

    Tollgate-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>

retried with exponential backoff; every attempt is a row in `alert_deliveries`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import time
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlsplit

import httpx
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.alerts.models import ALERT_METRICS, AlertDelivery, AlertEvent, AlertRule
from billing.credits.balance import MAX_NANOS, CreditBook, CreditError, usd
from billing.credits.views import aware
from billing.quota.limits import Limits
from billing.models import Account, ApiKey, LedgerEntry, utcnow

log = logging.getLogger("tollgate.alerts")
RULES, EVENTS, DELIVERIES = AlertRule.__table__, AlertEvent.__table__, AlertDelivery.__table__
LEDGER, ACCOUNTS, KEYS = LedgerEntry.__table__, Account.__table__, ApiKey.__table__
SIGNATURE_HEADER = "Tollgate-Signature"


def sign(secret: str, body: bytes, timestamp: int) -> str:
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def verify(secret: str, body: bytes, header: str, tolerance: float = 300.0) -> bool:
    """What a receiver does: the HMAC over the raw body, and a recent timestamp."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    return abs(time.time() - timestamp) <= tolerance and hmac.compare_digest(sign(secret, body, timestamp), header)


# How long after a month has ended its late rows can still make its crossing (a request admitted at
# its end and still running, a journal replayed after an outage): the month is read this long.
LATE_ROWS = timedelta(days=3)


def _month_start(now: datetime) -> datetime:
    return datetime(now.year, now.month, 1, tzinfo=timezone.utc)


def rule_view(row: Any) -> dict[str, Any]:
    return {"id": row.id, "object": "alert_rule", "account_id": row.account_id, "key_id": row.key_id, "metric": row.metric,
            "threshold": row.threshold, "percent": row.percent, "url": row.url}


def event_view(row: Any) -> dict[str, Any]:
    return {"id": row.id, "object": "alert_event", "rule_id": row.rule_id, "account_id": row.account_id, "crossing": row.crossing,
            "value": int(row.value), "threshold": int(row.threshold), "message": row.message,
            "delivered_at": row.delivered_at.isoformat() if row.delivered_at else None, "created_at": row.created_at.isoformat()}


class AlertService:
    def __init__(self, engine: AsyncEngine, credits: CreditBook, *, attempts: int = 5, backoff: float = 0.5, timeout: float = 5.0) -> None:
        self._engine = engine
        self._credits = credits
        self.attempts = attempts
        self.backoff = backoff
        self._http = httpx.AsyncClient(timeout=timeout)
        self._delivering: set[asyncio.Task[Any]] = set()

    async def add_rule(self, account_id: int, metric: str, *, url: str, threshold: int | None = None, percent: int | None = None,
                       key_id: int | None = None, secret: str | None = None) -> dict[str, Any]:
        if metric not in ALERT_METRICS:
            raise CreditError(f"metric must be one of: {', '.join(ALERT_METRICS)}", "metric")
        if (threshold is None) == (percent is None) or (percent is not None and (metric == "balance_below" or not 1 <= percent <= 1000)):
            raise CreditError("give threshold, or percent (1-1000) of a monthly limit", "threshold")
        if threshold is not None and not 0 <= threshold <= MAX_NANOS:
            raise CreditError(f"threshold must be between 0 and {MAX_NANOS}", "threshold")
        if not _deliverable(url):
            raise CreditError("url must be an http(s) URL with a host, without spaces or control characters", "url")
        secret = secret or "whsec_tg_" + secrets.token_hex(24)
        async with self._engine.begin() as conn:
            if key_id is not None and (await conn.execute(sa.select(KEYS.c.id).where(KEYS.c.id == key_id, KEYS.c.account_id == account_id))).first() is None:
                raise CreditError(f"the account has no key {key_id}", "key_id")
            row = (await conn.execute(RULES.insert().values(
                account_id=account_id, key_id=key_id, metric=metric, threshold=threshold, percent=percent, url=url, secret=secret,
                created_at=utcnow()).returning(*RULES.c))).one()
        return {**rule_view(row), "secret": secret}  # shown once, like a key

    async def rules(self, account_id: int) -> list[dict[str, Any]]:
        async with self._engine.connect() as conn:
            return [rule_view(r) for r in await conn.execute(sa.select(RULES).where(RULES.c.account_id == account_id).order_by(RULES.c.id))]

    async def events(self, account_id: int, limit: int = 50) -> list[dict[str, Any]]:
        async with self._engine.connect() as conn:
            rows = await conn.execute(sa.select(EVENTS).where(EVENTS.c.account_id == account_id).order_by(EVENTS.c.id.desc()).limit(limit))
            return [event_view(r) for r in rows]

    async def check(self, now: datetime | None = None) -> list[int]:
        """Evaluates every rule; records and starts delivering each new crossing. Returns the new events' ids."""
        now = now or utcnow()
        async with self._engine.connect() as conn:
            rules = (await conn.execute(sa.select(RULES).order_by(RULES.c.id))).all()
        made = []
        for rule in rules:
            for seen in await self._crossings(rule, now):
                event_id = await self._record(rule, *seen, now)
                if event_id is None:
                    continue
                made.append(event_id)
                task = asyncio.get_running_loop().create_task(self.deliver(event_id))
                self._delivering.add(task)
                task.add_done_callback(self._delivering.discard)
        return made

    async def _crossings(self, rule: Any, now: datetime) -> list[tuple[str, int, int, str]]:
        """Each (crossing key, value, threshold, message) of the rule's metric past its threshold now. A
        monthly metric is read for this month and, for `LATE_ROWS` after it ended, the month before: a
        row admitted in that month may reach the ledger after it (a request still running at its end),
        and the crossing it makes is that month's, as invoices count it. A rule made after that month
        ended says nothing of it."""
        if rule.metric == "balance_below":
            seen = await self._balance_crossing(rule)
            return [] if seen is None else [seen]
        start = _month_start(now)
        late = now - start < LATE_ROWS and aware(rule.created_at) < start
        months = [start] + ([_month_start(start - timedelta(days=1))] if late else [])
        return [seen for month in months if (seen := await self._month_crossing(rule, month)) is not None]

    async def _balance_crossing(self, rule: Any) -> tuple[str, int, int, str] | None:
        owner = f"key {rule.key_id}" if rule.key_id else f"account {rule.account_id}"
        balance = await self._credits.balance(rule.account_id)
        if balance is None or balance["billing_mode"] != "prepaid":
            return None
        if balance["balance_nanos"] >= rule.threshold:
            await self._rearm(rule)
            return None
        return (f"below-{rule.rearmed}", balance["balance_nanos"], rule.threshold,
                f"The prepaid balance of {owner} is ${usd(balance['balance_nanos'])}, below ${usd(rule.threshold)}.")

    async def _month_crossing(self, rule: Any, start: datetime) -> tuple[str, int, int, str] | None:
        """The crossing of the month that begins at `start`, if its metric is past the threshold."""
        owner = f"key {rule.key_id}" if rule.key_id else f"account {rule.account_id}"
        column = LEDGER.c.key_id if rule.key_id else LEDGER.c.account_id
        measure = sa.func.sum(LEDGER.c.cost_nanos) if rule.metric == "monthly_spend" else sa.func.sum(LEDGER.c.prompt_tokens + LEDGER.c.completion_tokens)
        async with self._engine.connect() as conn:
            end = _month_start(start + timedelta(days=32))
            # the month a row counts in is the one it was admitted in (as invoices and quotas count it)
            value = int((await conn.execute(sa.select(sa.func.coalesce(measure, 0)).where(
                column == (rule.key_id or rule.account_id), LEDGER.c.admitted_at >= start, LEDGER.c.admitted_at < end))).scalar_one())
            threshold = rule.threshold
            if rule.percent is not None:
                table = KEYS if rule.key_id else ACCOUNTS
                raw = (await conn.execute(sa.select(table.c.limits).where(table.c.id == (rule.key_id or rule.account_id)))).scalar()
                limits = Limits.from_json(raw)
                limit = limits.monthly_spend_nanos if rule.metric == "monthly_spend" else limits.monthly_tokens
                if limit is None:
                    return None
                # the least whole unit at or past percent% of the limit (rounded up: 15% of 10 tokens is 1.5, so
                # 2 tokens cross it, not 1)
                threshold = -(-limit * rule.percent // 100)
        if value < threshold:
            return None
        shown = (lambda n: f"${usd(n)}") if rule.metric == "monthly_spend" else (lambda n: f"{n:,} tokens")
        what = "spend" if rule.metric == "monthly_spend" else "token use"
        pct = f" ({rule.percent}% of its limit)" if rule.percent is not None else ""
        return (f"{start:%Y-%m}", value, threshold,
                f"The monthly {what} of {owner} for {start:%Y-%m} is {shown(value)}, past {shown(threshold)}{pct}.")

    async def _rearm(self, rule: Any) -> None:
        """The balance is back at or above the threshold: the next fall below is a new crossing. Only
        after a crossing of the current arming, and once across processes (the update is conditional)."""
        async with self._engine.begin() as conn:
            await conn.execute(RULES.update().where(
                RULES.c.id == rule.id, RULES.c.rearmed == rule.rearmed,
                sa.exists().where(EVENTS.c.rule_id == rule.id, EVENTS.c.crossing == f"below-{rule.rearmed}"),
            ).values(rearmed=rule.rearmed + 1))

    async def _record(self, rule: Any, crossing: str, value: int, threshold: int, message: str, now: datetime) -> int | None:
        """The event row, or None when another process (or an earlier check) recorded this crossing."""
        values = dict(rule_id=rule.id, account_id=rule.account_id, crossing=crossing, value=value, threshold=threshold,
                      message=message, created_at=now)
        async with self._engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                from sqlalchemy.dialects.postgresql import insert
            else:
                from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
            got = (await conn.execute(insert(EVENTS).values(**values).on_conflict_do_nothing(
                index_elements=["rule_id", "crossing"]).returning(EVENTS.c.id))).scalar()
        return None if got is None else int(got)

    async def deliver(self, event_id: int) -> bool:
        """POSTs the event to its rule's URL, signed; retries with backoff; logs every attempt."""
        async with self._engine.connect() as conn:
            event = (await conn.execute(sa.select(EVENTS).where(EVENTS.c.id == event_id))).one()
            rule = (await conn.execute(sa.select(RULES).where(RULES.c.id == event.rule_id))).one()
        body = json.dumps({"type": "tollgate.alert", "id": event.id, "rule_id": rule.id, "account_id": rule.account_id,
                           "key_id": rule.key_id, "metric": rule.metric, "crossing": event.crossing, "value": int(event.value),
                           "threshold": int(event.threshold), "message": event.message,
                           "created_at": event.created_at.isoformat()}, separators=(",", ":")).encode()
        for attempt in range(1, self.attempts + 1):
            status, error = None, None
            try:
                response = await self._http.post(rule.url, content=body, headers={
                    "content-type": "application/json", SIGNATURE_HEADER: sign(rule.secret, body, int(time.time()))})
                status = response.status_code
            except Exception as exc:  # unreachable, refused, a URL httpx cannot use: logged, retried
                error = type(exc).__name__
            ok = status is not None and 200 <= status < 300
            async with self._engine.begin() as conn:
                await conn.execute(DELIVERIES.insert().values(event_id=event_id, attempt=attempt, status_code=status, error=error,
                                                              created_at=utcnow()))
                if ok:
                    await conn.execute(EVENTS.update().where(EVENTS.c.id == event_id).values(delivered_at=utcnow()))
            if ok:
                return True
            if attempt < self.attempts:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))  # backoff between attempts, not test synchronisation
        log.warning("alert %s not delivered after %d attempts", event_id, self.attempts)
        return False

    async def drain(self) -> None:
        if self._delivering:
            await asyncio.gather(*self._delivering, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._delivering):
            task.cancel()
        await self._http.aclose()


def _deliverable(url: str) -> bool:
    """Whether an alert can be posted to `url`: http(s), a host, no whitespace or control characters."""
    if len(url) > 2000 or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        return False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port out of range)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)
