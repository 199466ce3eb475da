"""Quotas and rate limits with no overspend under concurrency.

Admission reserves the worst case (prompt tokens + max_tokens, and its price) on every scope
(the key and its account) in ONE atomic step: everything is reserved or nothing is. Settlement
commits the actual usage and releases the rest; it is idempotent by request_id. Holds expire by
themselves, so a crashed gateway's reservations free up; a live gateway renews the holds of its
requests still running (`Limiter.renew`), so a request longer than the hold time keeps its own. When a scope's counters are missing
(Redis restarted or flushed, a new process, limits just changed) they are rebuilt from the
ledger before more traffic is admitted.

Modules:
  base.py           Scope, Hold, the refusals, LedgerTotals, and the `Limiter` interface
  memory.py         MemoryLimiter: one process, state in dicts (the embedded default)
  redis_limiter.py  RedisLimiter: Lua scripts on Redis, shared by every gateway process
  scripts.py        the scripts (lua/*.lua, read at import) and the one client that runs them

The x-ratelimit-* headers a hold or a refusal implies are built in gateway/serving/ratelimit.py.
"""

from billing.quota.base import (
    BALANCE,
    MONTHLY,
    UNLIMITED,
    Hold,
    LedgerTotals,
    Limiter,
    QuotaExceeded,
    QuotaUnavailable,
    Scope,
    ScopeTotals,
    minute_of,
    month_of,
    month_start,
    retry_after,
    seconds_to_next_month,
    usd,
)
from billing.quota.memory import MemoryLimiter
from billing.quota.redis_limiter import SETTLE_LINGER, CircuitBreaker, RedisLimiter
from billing.quota.scripts import CREDIT_LUA, REHOLD_LUA, RESERVE_LUA, SEED_LUA, SETTLE_LUA, ScriptClient

__all__ = [
    "BALANCE", "CREDIT_LUA", "MONTHLY", "REHOLD_LUA", "RESERVE_LUA", "SEED_LUA", "SETTLE_LINGER", "SETTLE_LUA", "UNLIMITED",
    "CircuitBreaker", "Hold", "LedgerTotals", "Limiter", "MemoryLimiter", "QuotaExceeded", "QuotaUnavailable",
    "RedisLimiter", "Scope", "ScopeTotals", "ScriptClient", "minute_of", "month_of", "month_start", "retry_after",
    "seconds_to_next_month", "usd",
]
