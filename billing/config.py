"""Billing settings: the monthly close, the grace period, Stripe (optional), and the seller
identity printed on invoices (TOLLGATE_SELLER_*; without a legal name the documents are usage
statements, not invoices).

Read from the settings' `extra` mapping, which falls back to the environment variables of the
same names (TOLLGATE_BILLING_*, TOLLGATE_STRIPE_*). Without a Stripe key, billing still closes
and renders invoices locally.
"""

from __future__ import annotations

import math

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COLLECTION_METHODS = ("send_invoice", "charge_automatically")


def _bounded(name: str, value: float, minimum: float | None, maximum: float | None, positive: bool) -> None:
    if positive and not value > 0:
        raise SystemExit(f"{name} must be more than 0, got {value:g}")
    if minimum is not None and value < minimum:
        raise SystemExit(f"{name} must be at least {minimum:g}, got {value:g}")
    if maximum is not None and value > maximum:
        raise SystemExit(f"{name} must be at most {maximum:g}, got {value:g}")


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int | None = None, maximum: int | None = None,
            positive: bool = False) -> int:
    """The integer setting `name`; unset or empty: `default`; not an integer, or outside the bounds
    given: exit naming it (a nonsense value is a mistake to say, never one to quietly replace)."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise SystemExit(f"{name} must be an integer, got {raw!r}") from exc
    _bounded(name, value, minimum, maximum, positive)
    return value


def env_float(env: Mapping[str, str], name: str, default: float, *, minimum: float | None = None, maximum: float | None = None,
              positive: bool = False) -> float:
    """The number setting `name`, as env_int reads an integer; never NaN or infinite."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise SystemExit(f"{name} must be a number, got {raw!r}") from exc
    if not math.isfinite(value):
        raise SystemExit(f"{name} must be a finite number, got {raw!r}")
    _bounded(name, value, minimum, maximum, positive)
    return value


ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """The on/off setting `name`: 1/true/yes/on or 0/false/no/off, any case; unset or empty:
    `default`; anything else: exit naming it (a misspelt "flase" must not quietly mean on)."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise SystemExit(f"{name} must be on or off (1/true/yes/on, 0/false/no/off), got {raw!r}")


@dataclass(frozen=True)
class Seller:
    """Who issues the invoices. Empty legal name: no seller identity, so documents are usage statements."""

    legal_name: str = ""
    address: tuple[str, ...] = ()  # lines, as printed
    country: str = ""
    tax_id: str = ""
    email: str = ""
    logo: Path | None = None  # a PNG or JPEG shown on HTML and PDF
    invoice_prefix: str = "INV"
    credit_note_prefix: str = "CN"

    @property
    def identified(self) -> bool:
        return bool(self.legal_name)

    @property
    def key(self) -> str:
        """What numbers are counted per: the seller's tax id, else its legal name."""
        return self.tax_id or self.legal_name or "usage-statement"

    def snapshot(self) -> dict[str, Any] | None:
        if not self.identified:
            return None
        return {"legal_name": self.legal_name, "address": list(self.address), "country": self.country,
                "tax_id": self.tax_id or None, "email": self.email or None,
                "logo": str(self.logo) if self.logo else None}

    @classmethod
    def from_mapping(cls, env: Mapping[str, str]) -> "Seller":
        logo = env.get("TOLLGATE_SELLER_LOGO") or None
        if logo and not Path(logo).is_file():
            raise SystemExit(f"TOLLGATE_SELLER_LOGO: no such file {logo!r}")
        if logo and Path(logo).suffix.lower() not in (".png", ".jpg", ".jpeg"):
            raise SystemExit("TOLLGATE_SELLER_LOGO must be a .png or .jpg file")
        address = (env.get("TOLLGATE_SELLER_ADDRESS") or "").replace("\\n", "\n").replace("|", "\n")
        prefix = env.get("TOLLGATE_INVOICE_PREFIX") or "INV"
        credit_prefix = env.get("TOLLGATE_CREDIT_NOTE_PREFIX") or "CN"
        for name, value in (("TOLLGATE_INVOICE_PREFIX", prefix), ("TOLLGATE_CREDIT_NOTE_PREFIX", credit_prefix)):
            if not (1 <= len(value) <= 12 and value.replace("-", "").isalnum()):
                raise SystemExit(f"{name} must be 1 to 12 letters, digits or dashes, got {value!r}")
        return cls(
            legal_name=(env.get("TOLLGATE_SELLER_NAME") or "").strip(),
            address=tuple(line.strip() for line in address.splitlines() if line.strip()),
            country=(env.get("TOLLGATE_SELLER_COUNTRY") or "").strip().upper(),
            tax_id=(env.get("TOLLGATE_SELLER_TAX_ID") or "").strip(),
            email=(env.get("TOLLGATE_SELLER_EMAIL") or "").strip(),
            logo=Path(logo) if logo else None,
            invoice_prefix=prefix,
            credit_note_prefix=credit_prefix,
        )


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
    seller: Seller = field(default_factory=Seller)

    @property
    def payment_terms(self) -> str:
        if self.collection_method == "charge_automatically":
            return "Charged automatically to the payment method on file"
        return f"Net {self.days_until_due} days" if self.days_until_due else "Due on receipt"

    @property
    def sends_for_payment(self) -> bool:
        """Invoices are sent to be paid by a due date (no payment attempt that could fail), and
        their payments reach us (Stripe's webhooks): an unpaid one past it makes the account
        delinquent. Without webhooks a paid invoice would stay open here, so due dates count not."""
        return self.collection_method == "send_invoice" and self.stripe_enabled and bool(self.stripe_webhook_secret)

    @property
    def stripe_enabled(self) -> bool:
        return bool(self.stripe_api_key)

    @classmethod
    def from_mapping(cls, env: Mapping[str, str]) -> "BillingConfig":
        method = env.get("TOLLGATE_STRIPE_COLLECTION_METHOD") or "send_invoice"
        if method not in COLLECTION_METHODS:
            raise SystemExit(f"TOLLGATE_STRIPE_COLLECTION_METHOD must be one of {', '.join(COLLECTION_METHODS)}")
        return cls(
            auto_close=env_flag(env, "TOLLGATE_BILLING_AUTO_CLOSE", True),
            close_delay_seconds=env_float(env, "TOLLGATE_BILLING_CLOSE_DELAY_SECONDS", 3600.0, minimum=0),
            check_seconds=env_float(env, "TOLLGATE_BILLING_CHECK_SECONDS", 300.0, positive=True),
            lookback_months=env_int(env, "TOLLGATE_BILLING_LOOKBACK_MONTHS", 3, minimum=0),
            grace_seconds=env_float(env, "TOLLGATE_BILLING_GRACE_SECONDS", 7 * 86400.0, minimum=0),
            state_refresh_seconds=env_float(env, "TOLLGATE_BILLING_STATE_REFRESH_SECONDS", 1.0, positive=True),
            # A secret read from a file into the environment ends in a newline, which no header may hold.
            stripe_api_key=(env.get("TOLLGATE_STRIPE_API_KEY") or "").strip() or None,
            stripe_webhook_secret=(env.get("TOLLGATE_STRIPE_WEBHOOK_SECRET") or "").strip() or None,
            stripe_api_base=env.get("TOLLGATE_STRIPE_API_BASE") or None,
            stripe_max_retries=env_int(env, "TOLLGATE_STRIPE_MAX_RETRIES", 2, minimum=0),
            collection_method=method,
            days_until_due=env_int(env, "TOLLGATE_STRIPE_DAYS_UNTIL_DUE", 30, minimum=0),
            send_invoices=env_flag(env, "TOLLGATE_STRIPE_SEND_INVOICES", True),
            sync_after_close=env_flag(env, "TOLLGATE_STRIPE_SYNC_AFTER_CLOSE", True),
            seller=Seller.from_mapping(env),
        )
