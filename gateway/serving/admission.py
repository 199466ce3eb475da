"""What one admitted request holds, and the one place it lets go of it.

    Meter.admit()       takes, in order: the engine's place (`engine.admit()`), the ledger's
                        backlog check, the price, the quota hold (the worst case) and the journal
                        entry (the provisional `interrupted` row). A refusal at any step gives back
                        what the steps before it took, and leaves no row.
    Admission.settle()  the request's one ledger row, its quota settled with what it used, its
                        place in the engine freed: exactly once, however often it is called.

Every metered request comes through here: chat and text completions, Anthropic Messages, OpenAI
Responses, response-cache hits and embeddings. The response's `finally` (gateway/serving/generation_response.py) or
the route's own (embeddings) calls `settle()`; streams also call it right before their last chunk
leaves, so that a client that saw the end has its row.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from billing.keys.store import Principal
from billing.ledger.writer import LedgerWriter, UsageRecord
from billing.models import utcnow
from billing.prices.book import EffectivePrice, PriceBook
from billing.quota import Hold, Limiter, QuotaExceeded, QuotaUnavailable, Scope
from engines.base import Engine, EngineOverloadedError, EngineRequest
from gateway.http.errors import APIError, EngineOverloaded, RateLimited, ServiceUnavailable
from gateway.serving.ratelimit import hold_headers, refusal_headers

log = logging.getLogger("tollgate.metering")

# row(admission, status) -> the request's ledger row with that status (None: the status its state says)
RowOf = Callable[["Admission", "str | None"], UsageRecord]


def share_of(nanos: int, share: Decimal) -> int:
    """`share` of a cost in whole nano-USD, rounded half up once."""
    return int((Decimal(nanos) * share).quantize(Decimal(1), ROUND_HALF_UP))


def overloaded(refused: EngineOverloadedError) -> APIError:
    """The scheduler's refusal as the client sees it: 429 when the caller's own queued requests
    are the wait, else 503; both with Retry-After."""
    headers = {"Retry-After": str(refused.retry_after)}
    if refused.own_backlog:
        return RateLimited(str(refused), code="too_many_queued_requests", headers=headers)
    return EngineOverloaded(str(refused), headers=headers)


class Admission:
    """Everything one admitted request holds: its place in the engine (`slot`), its quota `hold`,
    its journal entry. Made only by `Meter.admit()`; ended only by `settle()`."""

    __slots__ = ("meter", "request_id", "principal", "slot", "hold", "price", "admitted_at", "journaled", "settled", "_row", "_cut")

    def __init__(
        self, meter: "Meter", request_id: str, principal: Principal, row: RowOf, cut: Callable[[], None] | None, admitted_at: datetime,
    ) -> None:
        self.meter = meter
        self.request_id = request_id
        self.principal = principal
        self.slot: Engine | None = None  # the engine that holds a place for it
        self.hold: Hold | None = None
        self.price: EffectivePrice | None = None
        self.admitted_at = admitted_at  # when admission began: prices it, names its period
        self.journaled = False
        self.settled = False
        self._row = row
        self._cut = cut

    @property
    def headers(self) -> dict[str, str]:
        """The quota's rate-limit headers for the response."""
        return hold_headers(self.hold)

    def settle(self, outcome: str | None = None) -> bool:
        """Ends the request: its one ledger row (with status `outcome`, or the one its state says),
        its quota settled with what the row says it used (in the background: never awaited in a
        `finally`), its engine place given back. Only the first call does anything; returns
        whether this one did. A request refused before its journal entry gets no row."""
        if self.settled:
            return False
        self.settled = True
        meter = self.meter
        try:
            row = self._row(self, outcome) if self.journaled else None
            if row is not None:
                meter.ledger.record(row)
            if self.hold is not None:
                used = row.prompt_tokens + row.completion_tokens if row is not None else 0
                meter.settle_later(self.hold, used, (row.cost_nanos or 0) if row is not None else 0)
        finally:
            if self.slot is not None:
                self.slot.release(self.request_id)
            meter.ended(self)
        return True

    def cut(self) -> bool:
        """The server's drain deadline: stops the work (its row then says `interrupted`)."""
        if self._cut is None:
            return False
        self._cut()
        return True


class Meter:
    """The ledger, the limiter and the price book as one request sees them, and the requests
    admitted and not yet settled (graceful drain waits on these)."""

    def __init__(self, ledger: LedgerWriter, *, limiter: Limiter | None = None, prices: PriceBook | None = None) -> None:
        self.ledger = ledger
        self.limiter = limiter
        self.prices = prices
        self.on_quota_rejected: list[Callable[[str], None]] = []  # callbacks(limit_name) for metrics
        self._live: dict[str, Admission] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._settling: set[asyncio.Task[Any]] = set()

    async def admit(
        self,
        request_id: str,
        principal: Principal,
        model: str,
        *,
        tokens: int,
        cost: Callable[[EffectivePrice], int],
        row: RowOf,
        slot: tuple[Engine, EngineRequest] | None = None,
        cut: Callable[[], None] | None = None,
        batch: bool = False,
    ) -> Admission:
        """Admits a request that may use up to `tokens` tokens and `cost(price)` nano-USD, or raises
        the 429/503 that says why not. `row(admission, status)` is its ledger row; `slot`: the
        engine (and request) it takes a place in; `cut`: what stops it at the drain deadline; `batch`:
        a line of a batch, priced at the batch price."""
        admission = Admission(self, request_id, principal, row, cut, utcnow())
        try:
            if slot is not None:
                engine, engine_request = slot
                try:
                    engine.admit(engine_request)
                except EngineOverloadedError as refused:
                    raise overloaded(refused) from None
                admission.slot = engine
            if self.ledger.refusing:
                raise ServiceUnavailable("Usage metering is backed up; retry shortly.", code="ledger_backlog", headers={"Retry-After": "5"})
            if self.prices is not None:
                # The account's override (custom price or multiplier) applies when it has one.
                admission.price = await self.prices.current_for(principal.account_id, model, admission.admitted_at)
                if batch and admission.price is not None:
                    admission.price = admission.price.for_batch()
            nanos = cost(admission.price) if admission.price is not None else 0
            admission.hold = await self._reserve(request_id, principal, tokens, nanos)
            provisional = row(admission, "interrupted")
            self._live[request_id] = admission
            self._idle.clear()
            # Journaled: a crash from here on still leaves an `interrupted` row and a hold to release.
            self.ledger.admitted(provisional, admission.hold.to_json() if admission.hold else None)
            admission.journaled = True
        except BaseException:
            admission.settle()  # gives back what the steps before took; no row
            raise
        return admission

    async def _reserve(self, request_id: str, principal: Principal, tokens: int, nanos: int) -> Hold | None:
        """Reserves `tokens` and `nanos` on the key and its account, or refuses."""
        if self.limiter is None:
            return None
        scopes = [Scope("key", principal.key_id, principal.key_limits),
                  Scope("account", principal.account_id, principal.account_limits, principal.prepaid)]
        try:
            return await self.limiter.reserve(request_id, scopes, tokens, nanos)
        except QuotaExceeded as exc:
            for callback in self.on_quota_rejected:
                callback(exc.limit)
            err = RateLimited(str(exc), code=exc.limit, headers=refusal_headers(exc))
            err.error_type = exc.error_type
            raise err from None
        except QuotaUnavailable:
            raise ServiceUnavailable(
                "Quota service is unavailable; retry shortly.", code="quota_unavailable", headers={"Retry-After": "1"}
            ) from None

    def settle_later(self, hold: Hold, tokens: int, nanos: int) -> None:
        """Commits actual use in the background: never awaited inside a `finally`."""
        if self.limiter is None:
            return
        task = asyncio.get_running_loop().create_task(self.limiter.settle(hold, tokens, nanos, background=True))
        self._settling.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self._settling.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("quota settlement failed: %s", type(task.exception()).__name__)

    def ended(self, admission: Admission) -> None:
        if self._live.get(admission.request_id) is admission:
            del self._live[admission.request_id]
            if not self._live:
                self._idle.set()

    async def drain(self, timeout: float = 10.0) -> None:
        """Waits for background settlements (shutdown and tests)."""
        if self._settling:
            await asyncio.wait(list(self._settling), timeout=timeout)

    def live_count(self) -> int:
        return len(self._live)

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every admitted request has been settled within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def cut_live(self) -> int:
        """Stops every running generation (graceful drain's deadline); returns how many."""
        return sum(1 for admission in list(self._live.values()) if admission.cut())
