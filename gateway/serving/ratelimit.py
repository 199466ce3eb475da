"""OpenAI's x-ratelimit-* headers, from what a quota reservation (or refusal) says is left.

billing/quota reports (requests, tokens) left this minute on each limited scope; the headers show
the tightest scope where an rpm / tpm limit is set.
"""

from __future__ import annotations

import math

from billing.quota import Hold, QuotaExceeded, Scope


def ratelimit_headers(scopes: tuple[Scope, ...], remaining: tuple[tuple[int, int], ...], now: float) -> dict[str, str]:
    headers: dict[str, str] = {}
    reset = f"{max(1, math.ceil(60 - now % 60))}s"
    for kind, index, limit_attr in (("requests", 0, "rpm"), ("tokens", 1, "tpm")):
        best: tuple[int, int] | None = None
        for scope, rem in zip(scopes, remaining):
            limit = getattr(scope.limits, limit_attr)
            if limit is not None and (best is None or rem[index] < best[1]):
                best = (limit, rem[index])
        if best is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(best[0])
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, best[1]))
            headers[f"x-ratelimit-reset-{kind}"] = reset
    return headers


def hold_headers(hold: Hold | None) -> dict[str, str]:
    """The headers of an admitted request (none when nothing was reserved)."""
    if hold is None or not hold.remaining:
        return {}
    return ratelimit_headers(hold.scopes, hold.remaining, hold.at)


def refusal_headers(exc: QuotaExceeded) -> dict[str, str]:
    """Retry-After and the x-ratelimit-* headers of a refused request. A balance or a monthly limit
    does not clear within a retry: `x-should-retry: false`, which the OpenAI and Anthropic SDKs obey
    (they retry every other 429, waiting Retry-After)."""
    headers = {"Retry-After": str(exc.retry_after), **ratelimit_headers(exc.scopes, exc.remaining, exc.at)}
    if exc.error_type == "insufficient_quota":
        headers["x-should-retry"] = "false"
    return headers
