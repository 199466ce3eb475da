"""What one admitted request holds, and the one place it lets go of it.

    Meter.admit()       takes, in order: the engine's place (`engine.admit()`), the ledger's
                        backlog check, the price, the quota hold (the worst case) and the journal
                        entry (the provisional `interrupted` row). A refusal at any step gives back
                        what the steps before it took, and leaves no row.
    Admission.settle()  the request's one ledger row, its quota settled with what it used, its
                        place in the engine freed: exactly once, however often it is called.
    Admission.row()     that row, built here from what the admission holds: who (principal, model,
                        request id), when (admitted_at), at what price, and the request's `Usage`.

Every metered request comes through here: chat and text completions, Anthropic Messages, OpenAI
Responses, response-cache hits and embeddings. The response's `finally` (gateway/serving/generation_response.py) or
the route's own (embeddings) calls `settle()`; streams also call it right before their last chunk
leaves, so that a client that saw the end has its row.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal

from billing.keys.store import Principal
from billing.ledger.records import BILLED_STATUSES
from billing.ledger.writer import LedgerWriter, UsageRecord
from billing.models import utcnow
from billing.prices.book import UNPRICED, EffectivePrice, PriceBook
from billing.quota import Hold, Limiter, QuotaExceeded, QuotaUnavailable, Scope
from billing.quota.base import group_tag
from engines.base import FINISH_CANCELLED, FINISH_ERROR, FINISH_UPSTREAM_CANCELLED, Engine, EngineOverloadedError, EngineRequest
from gateway.batches.line import BatchLine
from gateway.http.errors import APIError, EngineOverloaded, RateLimited, ServiceUnavailable
from gateway.serving.ratelimit import hold_headers, refusal_headers

log = logging.getLogger("tollgate.metering")



@dataclass(kw_only=True)
class Usage:
    """What a request's ledger row says of it besides who and when, filled in as it runs: the API it
    came through, what it used, how it ended. A Generation (gateway/serving/completions.py) is one."""

    api: str = "chat"  # as its ledger row says: chat | completions | messages | responses | embeddings | batch
    batch_id: str | None = None  # the batch it is a line of (api = batch): priced at the batch price
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens the engine served from its prefix cache, when it says
    estimated: bool = False
    finish_reason: str | None = None
    recorded_finish: str | None = None  # the row's finish_reason when the engine's source ended it early (timeout, cancelled)
    started: float = field(default_factory=time.perf_counter)
    ttft_ms: float | None = None
    queue_ms: float | None = None
    cut: bool = False  # the server ended it (drain deadline): its row says `interrupted`
    hit: bool = False  # answered from the response cache: billed its reserved share, and only if delivered whole
    whole: bool = False  # billed whole or not at all (embeddings): nothing unless completed
    unrun: bool = False  # no engine had it (EngineOutput.unrun): its row counts no token, so it costs nothing


def final_status(usage: Usage) -> str:
    if usage.finish_reason == FINISH_ERROR:
        return "error"
    if usage.finish_reason in (None, FINISH_CANCELLED):
        return "interrupted" if usage.cut else "cancelled"  # cut: the server ended it (drain), not the client
    if usage.recorded_finish == FINISH_UPSTREAM_CANCELLED:
        return "interrupted"  # the upstream ended it while the client was there
    return "completed"


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

    __slots__ = ("meter", "request_id", "principal", "model", "usage", "slot", "hold", "price", "nanos", "admitted_at", "journaled",
                 "settled", "_cut")

    def __init__(
        self, meter: "Meter", request_id: str, principal: Principal, model: str, usage: Usage, cut: Callable[[], None] | None,
    ) -> None:
        self.meter = meter
        self.request_id = request_id
        self.principal = principal
        self.model = model
        self.usage = usage
        self.slot: Engine | None = None  # the engine that holds a place for it
        self.hold: Hold | None = None
        self.price: EffectivePrice | None = None
        self.nanos = 0  # the worst case reserved (a cache hit's whole cost)
        self.admitted_at: datetime = None  # type: ignore[assignment]  # Meter.admit sets it once the engine has its place: it prices the request, names its period
        self.journaled = False
        self.settled = False
        self._cut = cut

    @property
    def headers(self) -> dict[str, str]:
        """The quota's rate-limit headers for the response."""
        return hold_headers(self.hold)

    @property
    def _stamp(self) -> tuple[int | None, int | None]:
        """The ids of the price it was admitted at, for its row (UsageRecord.price_version_id,
        override_id): what invoices bill it at. UNPRICED: no price in force; None, None: no price book."""
        price = self.price
        if price is not None:
            return price.price_version_id, price.override_id
        return (UNPRICED, None) if self.meter.prices is not None else (None, None)

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
            row = self.row(outcome) if self.journaled else None
            try:
                if self.hold is not None and meter.limiter is not None:
                    # A task: it runs after this call, once the row below is journaled and queued.
                    used = row.prompt_tokens + row.completion_tokens if row is not None else 0
                    hold = meter.hold_now(self) or self.hold
                    meter.limiter.settle_later(hold, used, (row.cost_nanos or 0) if row is not None else 0)
            finally:
                if row is not None:
                    meter.ledger.record(row)  # never raises (its journal's and listeners' failures are logged)
        finally:
            if self.slot is not None:
                self.slot.release(self.request_id)
            meter.ended(self)
        return True

    def row(self, status: str | None = None) -> UsageRecord:
        """The request's ledger row with `status` (None: the one its usage says); `interrupted` while
        it runs (the journal's). A cache hit not delivered whole is billed nothing, nor is a row
        invoices do not bill (`error`, `interrupted`: cost 0, its tokens still counted). A prepaid
        account's row costs at most the hold."""
        record = self._row(status)
        if record.cost_nanos and record.status not in BILLED_STATUSES:
            record.cost_nanos = 0
        elif record.cost_nanos and self.principal.prepaid and record.cost_nanos > self.nanos:
            # A prepaid balance is never charged more than the request's hold, so it never goes below
            # zero. Only an estimated prompt can pass it (a pass-through pool without `tokenizer:`
            # reserves an estimate; the upstream's usage is exact): the row keeps the upstream's
            # tokens, and the operator bears the estimate's error.
            record.cost_nanos = self.nanos
        return record

    def _row(self, status: str | None) -> UsageRecord:
        usage = self.usage
        if usage.whole:
            return self._whole_row(status or "cancelled")  # ended without its result: the client left
        if usage.unrun:  # no engine had it: nothing used, nothing billed, nothing counted against its quota
            record = self._record(status or final_status(usage))
            return dataclasses.replace(record, prompt_tokens=0, completion_tokens=0, cached_tokens=None, cost_nanos=0 if self.price else None)
        if not usage.hit:
            return self._record(status or final_status(usage))
        if status is None and usage.finish_reason is not None:
            return dataclasses.replace(self._record("completed"), cached=True, cost_nanos=self.nanos if self.price else None)
        usage.completion_tokens = 0
        record = self._record(status if status == "interrupted" else "cancelled")
        return dataclasses.replace(record, prompt_tokens=0, completion_tokens=0, cached=True, cost_nanos=0 if self.price else None)

    def _record(self, status: str) -> UsageRecord:
        usage, price = self.usage, self.price
        version_id, override_id = self._stamp
        finish = FINISH_CANCELLED if status == "cancelled" else usage.recorded_finish or usage.finish_reason
        return UsageRecord(
            request_id=self.request_id,
            account_id=self.principal.account_id,
            key_id=self.principal.key_id,
            model=self.model,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            status=status,
            finish_reason=finish,
            total_ms=(time.perf_counter() - usage.started) * 1000.0,
            queue_ms=usage.queue_ms,
            ttft_ms=usage.ttft_ms,
            estimated=usage.estimated,
            cached_tokens=usage.cached_tokens,
            cost_nanos=price.cost_nanos(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) if price else None,
            api=usage.api,
            batch_id=usage.batch_id,
            postpaid=not self.principal.prepaid,
            price_version_id=version_id,
            override_id=override_id,
            admitted_at=self.admitted_at,
        )

    def _whole_row(self, status: str) -> UsageRecord:
        """Input tokens at the input price while running (the journal's); after, all if completed, else nothing."""
        usage, price = self.usage, self.price
        version_id, override_id = self._stamp
        done = status in ("completed", "interrupted")
        final = status != "interrupted"
        tokens = usage.prompt_tokens if done else 0
        return UsageRecord(
            request_id=self.request_id, account_id=self.principal.account_id, key_id=self.principal.key_id, model=self.model,
            prompt_tokens=tokens, completion_tokens=0, status=status, finish_reason="stop" if status == "completed" else None,
            total_ms=(time.perf_counter() - usage.started) * 1000.0 if final else 0.0,
            cost_nanos=(price.cost_nanos(tokens, 0) if done else 0) if price is not None else None, api=usage.api,
            batch_id=usage.batch_id, postpaid=not self.principal.prepaid, price_version_id=version_id, override_id=override_id,
            created_at=utcnow() if final else self.admitted_at, admitted_at=self.admitted_at,
        )

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
        # Limits seen to change since this process started (KeyStore.on_limits_changed), by key and by
        # account: a request admitted without a hold on a scope limited since settles its usage there.
        self._limits_now: dict[tuple[str, int], Scope] = {}

    def limits_changed(self, principal: Principal) -> None:
        if len(self._limits_now) > 200_000:
            self._limits_now.clear()
        self._limits_now[("key", principal.key_id)] = Scope("key", principal.key_id, principal.key_limits)
        self._limits_now[("account", principal.account_id)] = Scope("account", principal.account_id, principal.account_limits,
                                                                    principal.prepaid)

    def hold_now(self, admission: Admission) -> Hold | None:
        """For a request admitted without a hold on its key's or its account's scope that is limited
        now: its hold with that scope added (reserving nothing there), to settle its usage there too;
        None when there is none."""
        old = admission.hold
        if not self._limits_now or old is None:
            return None
        principal = admission.principal
        scopes = [self._limits_now.get(("key", principal.key_id)) or Scope("key", principal.key_id, principal.key_limits),
                  self._limits_now.get(("account", principal.account_id)) or Scope("account", principal.account_id, principal.account_limits)]
        held = {s.name for s in old.scopes}
        added = tuple(s for s in scopes if s.limited and s.name not in held)
        if not added:
            return None
        return dataclasses.replace(old, scopes=old.scopes + added, tag=old.tag or group_tag(scopes))

    async def admit(
        self,
        request_id: str,
        principal: Principal,
        model: str,
        usage: Usage,
        *,
        tokens: int,
        cost: Callable[[EffectivePrice], int],
        slot: tuple[Engine, EngineRequest] | None = None,
        cut: Callable[[], None] | None = None,
        line: BatchLine | None = None,
    ) -> Admission:
        """Admits a request that may use up to `tokens` tokens and `cost(price)` nano-USD, or raises
        the 429/503 that says why not. `usage`: what its ledger row is made of (Admission.row); `slot`:
        the engine (and request) it takes a place in; `cut`: what stops it at the drain deadline;
        `line`: a line of a batch, priced at the batch price, marked admitted in the database once
        its hold is taken and before its row is journaled (refused when the line is no longer its
        runner's: then it has no row, and runs nowhere twice)."""
        admission = Admission(self, request_id, principal, model, usage, cut)
        try:
            if slot is not None:
                engine, engine_request = slot
                try:
                    engine.admit(engine_request)
                except EngineOverloadedError as refused:
                    raise overloaded(refused) from None
                admission.slot = engine
            admission.admitted_at = utcnow()  # once the engine has a place for it: the rest is billing's
            if self.ledger.refusing:
                raise ServiceUnavailable("Usage metering is backed up; retry shortly.", code="ledger_backlog", headers={"Retry-After": "5"})
            if self.prices is not None:
                # The account's override (custom price or multiplier) applies when it has one.
                admission.price = await self.prices.current_for(principal.account_id, model, admission.admitted_at)
                if line is not None and admission.price is not None:
                    admission.price = admission.price.for_batch()
            admission.nanos = cost(admission.price) if admission.price is not None else 0
            provisional = admission.row("interrupted")  # priced: the row is known before the hold
            # A batch line keeps its request id (its one row) whoever runs it, but each run holds
            # under an id of its own: a run refused after its hold settles that hold, and the quota
            # refuses a second settle of one id, so a later run under the same id went uncounted.
            hold_id = request_id if line is None else f"{request_id}/{secrets.token_hex(6)}"
            admission.hold = await self._reserve(hold_id, principal, tokens, admission.nanos, admission.admitted_at)
            if admission.hold is not None and hold_id != request_id:
                admission.hold.row_id = request_id  # its usage is filed under its row's id until the row is written
            if line is not None and not await line.mark_admitted():
                raise ServiceUnavailable("This batch line is no longer this runner's.", code="batch_line_taken")
            self._live[request_id] = admission
            self._idle.clear()
            # Journaled: a crash from here on still leaves an `interrupted` row and a hold to release.
            self.ledger.admitted(provisional, admission.hold.to_json() if admission.hold else None)
            admission.journaled = True
            if line is not None:
                line.admitted = True
        except BaseException:
            admission.settle()  # gives back what the steps before took; no row
            raise
        return admission

    async def _reserve(self, request_id: str, principal: Principal, tokens: int, nanos: int, at: datetime) -> Hold | None:
        """Reserves `tokens` and `nanos` on the key and its account, or refuses. `at`: the admission
        instant, which names the month and minute the hold counts in, as it names the row's."""
        if self.limiter is None:
            return None
        scopes = [Scope("key", principal.key_id, principal.key_limits),
                  Scope("account", principal.account_id, principal.account_limits, principal.prepaid)]
        try:
            return await self.limiter.reserve(request_id, scopes, tokens, nanos, now=at.timestamp())
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

    def unheld_keys(self) -> set[int]:
        """The keys of running requests that hold on their key's scope or their account's not (it had
        no limits when they were admitted): where a limit set elsewhere must be learnt before they end."""
        return {a.principal.key_id for a in self._live.values() if a.hold is not None and len(a.hold.scopes) < 2}

    def ended(self, admission: Admission) -> None:
        if self._live.get(admission.request_id) is admission:
            del self._live[admission.request_id]
            if not self._live:
                self._idle.set()

    async def drain(self, timeout: float = 10.0) -> None:
        """Waits for background settlements (shutdown and tests)."""
        if self.limiter is not None:
            await self.limiter.drain(timeout)

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
