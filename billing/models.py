"""Table models. Rows stay small: the ledger holds ids and counts, never copies of prices or prompts."""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal

import sqlalchemy as sa
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def as_utc(dt: datetime) -> datetime:
    """A time given to be stored, in UTC: one without an offset is taken as UTC. SQLite keeps a
    time's clock reading and drops its offset, so a time is converted before it is stored."""
    return dt.replace(tzinfo=timezone.utc) if dt.tzinfo is None else dt.astimezone(timezone.utc)


# The instants a caller may give (API, CLI): what the database and datetime both hold, in UTC.
EARLIEST = datetime(1970, 1, 1, tzinfo=timezone.utc)
LATEST = datetime(9999, 12, 1, tzinfo=timezone.utc)


def given_instant(dt: datetime) -> datetime:
    """A caller's time in UTC (as_utc), ValueError outside EARLIEST..LATEST."""
    try:
        utc = as_utc(dt)
    except OverflowError:  # 0001-01-01T00:00:00+14:00 is before the first UTC instant datetime holds
        utc = None
    if utc is None or not EARLIEST <= utc <= LATEST:
        raise ValueError(f"must be between {EARLIEST.isoformat()} and {LATEST.isoformat()}")
    return utc


class Account(SQLModel, table=True):
    __tablename__ = "accounts"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(sa_column=sa.Column(sa.String(200), nullable=False, unique=True))
    # JSON object of limits (billing.quota.limits.Limits); NULL means none.
    limits: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    created_at: datetime = Field(
        default_factory=utcnow, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False)
    )
    # The plan's scheduling class (engines/wrappers/scheduler.py), e.g. "batch"; NULL means the top class.
    priority: str | None = Field(default=None, sa_column=sa.Column(sa.String(32), nullable=True))
    # postpaid (monthly invoice) | prepaid (spends a balance of credit; billing/credits/balance.py)
    billing_mode: str = Field(default="postpaid", sa_column=sa.Column(sa.String(16), nullable=False, server_default="postpaid"))
    # When it became prepaid: its usage from then on is debited from its balance.
    prepaid_since: datetime | None = Field(default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True))


class ApiKey(SQLModel, table=True):
    __tablename__ = "api_keys"

    id: int | None = Field(default=None, primary_key=True)
    account_id: int = Field(
        sa_column=sa.Column(sa.Integer, sa.ForeignKey("accounts.id"), nullable=False, index=True)
    )
    name: str | None = Field(default=None, sa_column=sa.Column(sa.String(200), nullable=True))
    prefix: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))
    # HMAC-SHA256(server secret, key), hex. The key itself is never stored.
    key_hash: str = Field(sa_column=sa.Column(sa.String(64), nullable=False, unique=True))
    is_admin: bool = Field(default=False, sa_column=sa.Column(sa.Boolean, nullable=False, default=False))
    # JSON list of model ids this key may use; NULL means every model.
    models: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    expires_at: datetime | None = Field(
        default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True)
    )
    revoked_at: datetime | None = Field(
        default=None, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=True)
    )
    limits: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    created_at: datetime = Field(
        default_factory=utcnow, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False)
    )


class Price(SQLModel, table=True):
    """A price version: per model, USD per million tokens, in force from `effective_from`.
    Versions are only ever added; the one in force at a request's time prices it."""

    __tablename__ = "prices"
    __table_args__ = (sa.UniqueConstraint("model", "effective_from", name="uq_prices_model_effective"),)

    id: int | None = Field(default=None, primary_key=True)
    model: str = Field(sa_column=sa.Column(sa.String(128), nullable=False))
    input_per_million: Decimal = Field(sa_column=sa.Column(sa.Numeric(18, 3), nullable=False))
    output_per_million: Decimal = Field(sa_column=sa.Column(sa.Numeric(18, 3), nullable=False))
    # Prompt tokens served from the engine's prefix cache (ledger cached_tokens); NULL: billed as input.
    cached_input_per_million: Decimal | None = Field(default=None, sa_column=sa.Column(sa.Numeric(18, 3), nullable=True))
    # What a line of a batch pays (api = batch); NULL: the normal price.
    batch_input_per_million: Decimal | None = Field(default=None, sa_column=sa.Column(sa.Numeric(18, 3), nullable=True))
    batch_output_per_million: Decimal | None = Field(default=None, sa_column=sa.Column(sa.Numeric(18, 3), nullable=True))
    currency: str = Field(default="USD", sa_column=sa.Column(sa.String(3), nullable=False, default="USD"))
    effective_from: datetime = Field(sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False))
    created_at: datetime = Field(
        default_factory=utcnow, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False)
    )


class LedgerEntry(SQLModel, table=True):
    __tablename__ = "ledger_entries"
    __table_args__ = (
        sa.Index("ix_ledger_account_created", "account_id", "created_at"),
        sa.Index("ix_ledger_account_admitted", "account_id", "admitted_at"),
        # One row per request: the key holds admitted_at, Postgres' partition key (billing/ledger/partitions.py).
        sa.UniqueConstraint("request_id", "admitted_at", name="uq_ledger_request_admitted"),
        # A batch's rows (its usage); partial: the ledger's other rows are not in it.
        sa.Index("ix_ledger_batch", "batch_id", postgresql_where=sa.text("batch_id IS NOT NULL"),
                 sqlite_where=sa.text("batch_id IS NOT NULL")),
    )

    id: int | None = Field(
        default=None,
        sa_column=sa.Column(
            sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True
        ),
    )
    request_id: str = Field(sa_column=sa.Column(sa.String(64), nullable=False))
    account_id: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    key_id: int = Field(sa_column=sa.Column(sa.Integer, nullable=False, index=True))
    model: str = Field(sa_column=sa.Column(sa.String(128), nullable=False))
    prompt_tokens: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    completion_tokens: int = Field(sa_column=sa.Column(sa.Integer, nullable=False))
    status: str = Field(sa_column=sa.Column(sa.String(16), nullable=False))  # completed|cancelled|error|interrupted (in flight when the gateway died)
    finish_reason: str | None = Field(default=None, sa_column=sa.Column(sa.String(16), nullable=True))
    estimated: bool = Field(default=False, sa_column=sa.Column(sa.Boolean, nullable=False, default=False))
    # Cost in nano-USD (1e-9) at the price in force when the request ran; NULL when unpriced.
    cost_nanos: int | None = Field(default=None, sa_column=sa.Column(sa.BigInteger, nullable=True))
    queue_ms: float | None = Field(default=None, sa_column=sa.Column(sa.Float, nullable=True))
    cached: bool = Field(default=False, sa_column=sa.Column(sa.Boolean, nullable=False, default=False, server_default=sa.false()))  # served from the response cache
    # Prompt tokens the engine served from its prefix (KV) cache, as the engine or the upstream's
    # usage.prompt_tokens_details.cached_tokens said; NULL when it did not say. Informational:
    # prompt_tokens (and the cost) include them.
    cached_tokens: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))
    # The API the request came through: chat | completions | embeddings | messages; NULL before migration 0007_api.
    api: str | None = Field(default=None, sa_column=sa.Column(sa.String(16), nullable=True))
    ttft_ms: float | None = Field(default=None, sa_column=sa.Column(sa.Float, nullable=True))
    total_ms: float = Field(sa_column=sa.Column(sa.Float, nullable=False))
    # The batch the request was a line of (api = batch; billing/batches/models.py); NULL otherwise.
    batch_id: str | None = Field(default=None, sa_column=sa.Column(sa.String(40), nullable=True))
    # Admitted for a key whose account was postpaid then: its hold held no prepaid balance, so the
    # row is invoiced even if the account is prepaid by its admission instant (billing/ledger/records.py).
    # NULL on rows written before migration 0022: the finish instant decides for them, as it did then.
    postpaid: bool | None = Field(default=False, sa_column=sa.Column(sa.Boolean, nullable=True, default=False))
    # The price the admission priced it at (billing/prices/book.py: EffectivePrice), which invoices bill
    # it at: the base version's id and the account override's. A gateway's price book may not have
    # a version yet that is in force at admitted_at (another process added it within the book's
    # refresh, or with a start in the last minute); the invoice bills what the quotas counted. Both
    # NULL: written before migration 0025 (priced by admitted_at). price_version_id 0 (no version
    # has it) with no override: admitted with no price in force, not charged.
    price_version_id: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))
    override_id: int | None = Field(default=None, sa_column=sa.Column(sa.Integer, nullable=True))
    created_at: datetime = Field(
        default_factory=utcnow, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False)
    )
    # When the request was admitted (its price looked up): the instant that prices it and decides its
    # hour, day and month everywhere (invoices, usage, quotas). created_at is when it finished.
    admitted_at: datetime = Field(
        default_factory=utcnow, sa_column=sa.Column(sa.DateTime(timezone=True), nullable=False)
    )


from billing.ledger.aggregate_models import DashboardSession, LatencyHour, UsageHour  # noqa: E402,F401  (registers the aggregate tables)
from billing.invoices import models as invoice_models  # noqa: E402,F401  (registers the invoice and billing tables)
from billing import stored_responses as response_models  # noqa: E402,F401  (registers stored_responses, the Responses API's store)
from billing.credits import models as credit_models  # noqa: E402,F401  (registers credit_entries, the prepaid credit ledger)
from billing.alerts import models as alert_models  # noqa: E402,F401  (registers the spend alert tables)
from billing.batches import models as batch_models  # noqa: E402,F401  (registers the Batch API's files, batches and lines)
