"""Quota and ledger for requests that do not run through `CompletionService.metered()`:
embeddings and response-cache hits. The same limiter, price book and ledger, the same rules:
reserve the worst case before any work, settle the actual use after, one ledger row per request.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from billing.keys import Principal
from billing.prices import EffectivePrice
from billing.quota import Hold, QuotaExceeded, QuotaUnavailable, Scope
from gateway.ratelimit import refusal_headers
from gateway.errors import RateLimited, ServiceUnavailable

log = logging.getLogger("tollgate.metering")
_settling: set[asyncio.Task[Any]] = set()


async def price_of(state: Any, model: str, account_id: int, at: datetime | None = None) -> EffectivePrice | None:
    """What `account_id` pays for `model` now (or at `at`, the request's admission): its override,
    else its multiplier, else the base price (the same rule completions and invoices use)."""
    prices = getattr(state, "prices", None)
    return await prices.current_for(account_id, model, at) if prices is not None else None


def share_of(nanos: int, share: Decimal) -> int:
    """`share` of a cost in whole nano-USD, rounded half up once."""
    return int((Decimal(nanos) * share).quantize(Decimal(1), ROUND_HALF_UP))


def refuse_if_backlogged(state: Any) -> None:
    if state.ledger.refusing:
        raise ServiceUnavailable("Usage metering is backed up; retry shortly.", code="ledger_backlog", headers={"Retry-After": "5"})


async def reserve(state: Any, principal: Principal, request_id: str, tokens: int, nanos: int) -> Hold | None:
    """Reserves `tokens` and `nanos` on the key and its account, or raises the 429/503 that
    completions raise for the same refusal."""
    limiter = getattr(state, "limiter", None)
    if limiter is None:
        return None
    scopes = [Scope("key", principal.key_id, principal.key_limits),
              Scope("account", principal.account_id, principal.account_limits, principal.prepaid)]
    try:
        return await limiter.reserve(request_id, scopes, tokens, nanos)
    except QuotaExceeded as exc:
        service = getattr(state, "service", None)
        for callback in getattr(service, "on_quota_rejected", []):
            callback(exc.limit)
        err = RateLimited(str(exc), code=exc.limit, headers=refusal_headers(exc))
        err.error_type = exc.error_type
        raise err from None
    except QuotaUnavailable:
        raise ServiceUnavailable("Quota service is unavailable; retry shortly.", code="quota_unavailable", headers={"Retry-After": "1"}) from None


def settle(state: Any, hold: Hold | None, tokens: int, nanos: int) -> None:
    """Commits the actual use in the background (never awaited in a `finally`)."""
    limiter = getattr(state, "limiter", None)
    if limiter is None or hold is None:
        return
    task = asyncio.get_running_loop().create_task(limiter.settle(hold, tokens, nanos, background=True))
    _settling.add(task)
    task.add_done_callback(_settled)


def _settled(task: asyncio.Task[Any]) -> None:
    _settling.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("quota settlement failed: %s", type(task.exception()).__name__)


async def drain(timeout: float = 10.0) -> None:
    if _settling:
        await asyncio.wait(list(_settling), timeout=timeout)
