"""What the routes use, built once in the lifespan (gateway/wiring.py): the app's `state`, typed.

`Gateway.state` is one `Services`: a handler reads `request.app.state.keys` and the type says
what it gets. A part that is optional is None when it is off (no embedding model, no billing
yet while starting); every field exists from the start, so nothing is read with
`getattr(..., None)`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from billing.alerts.spend import AlertService
    from billing.batches.store import BatchStore
    from billing.batches.files import FileStore
    from gateway.batches.runner import BatchRunner
    from billing.stripe.checkout import CheckoutService
    from billing.credits.balance import CreditBook
    from billing.keys.store import KeyStore
    from billing.ledger.writer import LedgerWriter
    from billing.prices.book import PriceBook
    from billing.quota import Limiter
    from gateway.billing import Billing
    from gateway.config import Settings
    from gateway.api.openai.embeddings import EmbeddingService
    from gateway.http.metrics import Metrics
    from gateway.api.openai.responses import ResponseStore
    from gateway.serving.cache import CacheConfig, ResponseCache
    from gateway.serving.completions import CompletionService
    from gateway.dashboard.sessions import SessionStore
    from sqlalchemy.ext.asyncio import AsyncEngine


@dataclass(eq=False)
class Services:
    settings: Settings = None  # type: ignore[assignment]  # set before the app serves (lifespan)
    db: AsyncEngine = None  # type: ignore[assignment]
    read_db: AsyncEngine = None  # type: ignore[assignment]  # a replica for dashboards and /v1/usage, else db
    keys: KeyStore = None  # type: ignore[assignment]
    ledger: LedgerWriter = None  # type: ignore[assignment]
    prices: PriceBook = None  # type: ignore[assignment]
    limiter: Limiter = None  # type: ignore[assignment]
    service: CompletionService = None  # type: ignore[assignment]  # the engines, and the Meter every admission goes through
    metrics: Metrics = None  # type: ignore[assignment]
    sessions: SessionStore = None  # type: ignore[assignment]
    billing: Billing | None = None
    credits: CreditBook | None = None
    alerts: AlertService | None = None
    checkout: CheckoutService | None = None
    credits_task: asyncio.Task[None] | None = None
    embeddings: EmbeddingService | None = None  # set before start: the service to serve (tests)
    embeddings_loading: asyncio.Task[None] | None = None
    response_cache: ResponseCache | None = None
    response_cache_config: CacheConfig | None = None  # set before start: the cache's settings (tests)
    response_store: ResponseStore | None = None
    files: FileStore | None = None  # the Batch API's (None: TOLLGATE_BATCHES=off)
    batch_store: BatchStore | None = None
    batch_runner: BatchRunner | None = None
    load_failures: dict[str, str] = field(default_factory=dict)  # model -> why it failed to load (/readyz)
    model_loads: list[asyncio.Task[None]] = field(default_factory=list)  # the background loads (tests wait on them)
    fatal: str | None = None  # why `tollgate serve` stops with exit 1
    stop_server: Callable[[], None] | None = None  # set by `tollgate serve`
