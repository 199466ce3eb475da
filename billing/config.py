"""Billing settings: the monthly close, the grace period, and Stripe (optional).

Read from the settings' `extra` mapping, which falls back to the environment variables of the
same names (TOLLGATE_BILLING_*, TOLLGATE_STRIPE_*). Without a Stripe key, billing still closes
and renders invoices locally.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

COLLECTION_METHODS = ("send_invoice", "charge_automatically")


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise SystemExit(f"{name} must be an integer, got {raw!r}") from exc


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise SystemExit(f"{name} must be a number, got {raw!r}") from exc


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    return raw.lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class BillingConfig:
    auto_close: bool = True  # the server closes each month after it ends
    close_delay_seconds: float = 3600.0  # wait after month end so late ledger batches land first
    check_seconds: float = 300.0  # how often the scheduler looks for work
    lookback_months: int = 3  # late usage this many months back becomes an adjustment
    grace_seconds: float = 7 * 86400.0  # past_due -> suspended after this
    state_refresh_seconds: float = 1.0  # how stale the in-memory suspended list may be
    stripe_api_key: str | None = None
    stripe_webhook_secret: str | None = None
    stripe_api_base: str | None = None  # None: Stripe's own; tests point it at a fake
    stripe_max_retries: int = 2
    collection_method: str = "send_invoice"
    days_until_due: int = 30
    send_invoices: bool = True  # email the finalized invoice through Stripe (send_invoice only)
    sync_after_close: bool = True

    @property
    def stripe_enabled(self) -> bool:
        return bool(self.stripe_api_key)

    @classmethod
    def from_mapping(cls, env: Mapping[str, str]) -> "BillingConfig":
        method = env.get("TOLLGATE_STRIPE_COLLECTION_METHOD") or "send_invoice"
        if method not in COLLECTION_METHODS:
            raise SystemExit(f"TOLLGATE_STRIPE_COLLECTION_METHOD must be one of {', '.join(COLLECTION_METHODS)}")
        return cls(
            auto_close=_bool(env, "TOLLGATE_BILLING_AUTO_CLOSE", True),
            close_delay_seconds=_float(env, "TOLLGATE_BILLING_CLOSE_DELAY_SECONDS", 3600.0),
            check_seconds=_float(env, "TOLLGATE_BILLING_CHECK_SECONDS", 300.0),
            lookback_months=_int(env, "TOLLGATE_BILLING_LOOKBACK_MONTHS", 3),
            grace_seconds=_float(env, "TOLLGATE_BILLING_GRACE_SECONDS", 7 * 86400.0),
            state_refresh_seconds=_float(env, "TOLLGATE_BILLING_STATE_REFRESH_SECONDS", 1.0),
            stripe_api_key=env.get("TOLLGATE_STRIPE_API_KEY") or None,
            stripe_webhook_secret=env.get("TOLLGATE_STRIPE_WEBHOOK_SECRET") or None,
            stripe_api_base=env.get("TOLLGATE_STRIPE_API_BASE") or None,
            stripe_max_retries=_int(env, "TOLLGATE_STRIPE_MAX_RETRIES", 2),
            collection_method=method,
            days_until_due=_int(env, "TOLLGATE_STRIPE_DAYS_UNTIL_DUE", 30),
            send_invoices=_bool(env, "TOLLGATE_STRIPE_SEND_INVOICES", True),
            sync_after_close=_bool(env, "TOLLGATE_STRIPE_SYNC_AFTER_CLOSE", True),
        )
