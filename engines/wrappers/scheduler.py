"""Fair scheduling and admission control in front of an engine (docs/scheduling.md).

`ScheduledEngine` wraps one engine (a model's own engine, a fallback, an `openai` pool) and lets
at most `capacity` requests into it; by default the engine's own `slots()`: its batch size, or
for a pool its replicas in rotation times their concurrency. The rest wait here, in the
gateway, not inside the engine:

    order      priority class first (`interactive` before `batch`), then fair share across
               accounts: the account with the fewest tokens served goes next (virtual time,
               charged at dispatch with an estimate and corrected when the request ends),
               first come first served within an account
    reserve    the last `reserve` slots only take a top-class request whose account has nothing
               running here: a light account gets in at once however heavy the others are
    admission  a request whose expected wait exceeds its class's `max_wait`, or that finds
               `max_queue` requests waiting, is refused before it is queued, with Retry-After;
               one admitted holds its place until it arrives (a burst sees itself coming)
    cancel     a waiting request whose client left is dropped; the engine never sees it
    hand-off   a request in its last step (max_tokens - 1 generated) gives its slot to the next one,
               which is then inside the engine when it ends (engines with a hard limit, such as a
               pool, still take it only once they have room)

Time in the queue is added to `EngineOutput.queue_ms` (so the ledger row records it), recorded
per class into the metric children the gateway hands over (`count_into`: the histogram and counter
of gateway/http/metrics.py, which the scheduler only observes and increments) and told to listeners.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from engines.base import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, Engine, EngineOutput, EngineOverloadedError, EngineRequest
from engines.wrappers.fallback import FallbackEngine

log = logging.getLogger("tollgate.engines.scheduler")

UNLIMITED = 1 << 30
EWMA = 0.2  # weight of the newest sample in the running averages
HOLD_S = 3.0  # a place taken by admit() lapses if the request does not arrive by then (and release() never came)
MAX_REMEMBERED_ACCOUNTS = 10_000


@dataclass(frozen=True)
class PriorityClass:
    name: str
    max_wait: float  # seconds; a request expected to wait longer is refused


DEFAULT_CLASSES = (PriorityClass("interactive", 30.0), PriorityClass("batch", 600.0))


def parse_classes(text: str) -> tuple[PriorityClass, ...]:
    """`interactive:30,batch:600` -> the classes, highest priority first. Raises ValueError."""
    classes: list[PriorityClass] = []
    for part in (p.strip() for p in text.split(",")):
        name, colon, wait = part.partition(":")
        name = name.strip()
        if not name or not colon:
            raise ValueError(f"{part!r}: expected name:max_wait_seconds, e.g. interactive:30")
        try:
            max_wait = float(wait)
        except ValueError:
            raise ValueError(f"{part!r}: the longest wait {wait.strip()!r} is not a number of seconds") from None
        if not max_wait > 0:
            raise ValueError(f"{part!r}: the longest wait must be above 0 seconds")
        if any(c.name == name for c in classes):
            raise ValueError(f"class {name!r} is given twice")
        classes.append(PriorityClass(name, max_wait))
    return tuple(classes)


class Observer(Protocol):
    """A histogram's child (prometheus_client's `Histogram.labels(...)`)."""

    def observe(self, amount: float) -> None: ...


class Incrementer(Protocol):
    """A counter's child (prometheus_client's `Counter.labels(...)`)."""

    def inc(self, amount: float = 1) -> None: ...


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__
class QueueEvent:
    """What listeners hear: a request left the queue for the engine, or its client left first."""

    kind: str  # "dispatched" | "abandoned"
    model: str
    priority: str
    wait_s: float
    request_id: str
    account_id: int | None


class _Ticket:
    """A request's place in the queue, then its slot in the engine."""

    __slots__ = ("request_id", "account", "rank", "cost", "kv_tokens", "seq", "enqueued", "dispatched", "granted", "state")

    def __init__(self, request: EngineRequest, rank: int, cost: int, seq: int, now: float) -> None:
        self.request_id = request.request_id
        self.account = request.account_id
        self.rank = rank
        self.cost = cost  # tokens charged to the account's fair share at dispatch (an estimate)
        self.kv_tokens = len(request.prompt_token_ids or ()) + request.max_tokens  # worst case
        self.seq = seq
        self.enqueued = now
        self.dispatched: float | None = None
        # Made when it has to wait: True, run; False, dropped. None: it went straight in.
        self.granted: asyncio.Future[bool] | None = None
        self.state = "waiting"  # -> running -> done, or -> dropped


class ScheduledEngine(Engine):
    def __init__(
        self,
        inner: Engine,
        *,
        capacity: int | None = None,
        capacity_tokens: int | None = None,
        reserve: int = 1,
        classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES,
        max_queue: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not classes:
            raise ValueError("the scheduler needs at least one priority class")
        self.inner = inner
        self.classes = classes
        self._rank = {c.name: i for i, c in enumerate(classes)}
        self._capacity = capacity
        self._capacity_tokens = capacity_tokens
        self._reserve = max(0, reserve)
        self.max_queue = max_queue
        self._clock = clock
        self._lines: list[dict[Any, deque[_Ticket]]] = [{} for _ in classes]  # per class: account -> waiting
        self._waiting = [0] * len(classes)
        self._tickets: dict[str, _Ticket] = {}  # waiting or running, by request id
        self._held: dict[str, tuple[Any, int, float]] = {}  # admitted, not yet arrived: id -> (account, rank, lapses at)
        self._running = 0
        self._running_tokens = 0
        self._ending = 0  # handed their slot on, still in the engine for their last step
        self._in_flight: dict[Any, int] = {}  # account -> requests running
        self._served: dict[Any, float] = {}  # account -> virtual time: tokens served
        self._vclock = 0.0  # the virtual time of the latest dispatch; idle accounts come back at it
        self._seq = 0
        self.hold_s: float | None = None  # running average of how long a request holds its slot
        self._completion: float | None = None  # running average of completion tokens
        self.listeners: list[Callable[[QueueEvent], None]] = []
        self._waited: tuple[Observer, ...] = ()  # per class: see count_into
        self._abandoned: tuple[Incrementer, ...] = ()

    # the wrapped engine, as the gateway asks of it (Engine's declarations; the backend's own
    # specifics are its own: `unwrapped()`) --------------------------------------------------------
    @property
    def model_id(self) -> str:  # type: ignore[override]
        return self.inner.model_id

    @property
    def context_length(self) -> int:  # type: ignore[override]
        return self.inner.context_length

    @property
    def vocab_size(self) -> int | None:  # type: ignore[override]
        return self.inner.vocab_size

    @property
    def owned_by(self) -> str:  # type: ignore[override]
        return self.inner.owned_by

    @property
    def passthrough(self) -> bool:  # type: ignore[override]
        return self.inner.passthrough

    @property
    def max_choices(self) -> int:  # type: ignore[override]
        return self.inner.max_choices

    @property
    def response_cache(self) -> bool:  # type: ignore[override]
        return self.inner.response_cache

    @property
    def renders_tools(self) -> bool:
        return self.inner.renders_tools

    def tool_encoder(self) -> Callable[[list[dict[str, Any]], list[Any]], list[int]] | None:
        return self.inner.tool_encoder()

    @property
    def renderer(self) -> Engine:
        return self.inner.renderer

    def unwrapped(self) -> Engine:
        return self.inner.unwrapped()

    def use_classes(self, names: tuple[str, ...]) -> None:
        self.inner.use_classes(names)

    @property
    def ready(self) -> bool:
        return self.inner.ready

    @property
    def healthy(self) -> bool:
        return self.inner.healthy

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        for ticket in [t for t in self._tickets.values() if t.state == "waiting"]:
            self._drop(ticket)
        await self.inner.stop()

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
        return self.inner.encode_chat(messages, tools) if tools is not None else self.inner.encode_chat(messages)

    def check_request(self, request: EngineRequest) -> None:
        self.inner.check_request(request)

    def encode_text(self, prompt: str) -> list[int]:
        return self.inner.encode_text(prompt)

    # capacity ---------------------------------------------------------------------------------
    def capacity(self) -> int:
        """Requests let into the engine at once."""
        if self._capacity:
            return self._capacity
        slots = self.inner.slots()
        return UNLIMITED if slots is None else max(1, slots)

    def slots(self) -> int | None:
        cap = self.capacity()
        return None if cap >= UNLIMITED else cap

    def _regular(self, cap: int) -> int:
        """Slots any request may take; the rest are the reserve."""
        return cap if cap >= UNLIMITED else cap - min(self._reserve, cap - 1)

    def has_capacity(self) -> bool:
        return self.inner.healthy and self.queue_depth() < self.max_queue

    def requests_in_flight(self) -> int:
        return self.inner.requests_in_flight() + self.queue_depth()

    def queue_depth(self) -> int:
        """Requests waiting in the gateway for a slot in this engine."""
        return sum(self._waiting)

    def snapshot(self) -> dict[str, Any]:
        cap = self.capacity()
        return {
            "model": self.model_id,
            "capacity": None if cap >= UNLIMITED else cap,
            "running": self._running,
            "waiting": {c.name: self._waiting[i] for i, c in enumerate(self.classes)},
            "hold_s": self.hold_s,
        }

    # admission --------------------------------------------------------------------------------
    def rank_of(self, request: EngineRequest) -> int:
        """0 is the top class. No priority: the top class; one this gateway does not know: the last."""
        if request.priority is None:
            return 0
        return self._rank.get(request.priority, len(self.classes) - 1)

    def _ahead(self, account: Any, rank: int) -> tuple[int, int]:
        """(requests that would go before a new one of this account and class, the account's own)."""
        counts = {a: len(q) for a, q in self._lines[rank].items()}
        above = sum(self._waiting[:rank])
        for held_account, held_rank, _ in self._held.values():
            if held_rank == rank:
                counts[held_account] = counts.get(held_account, 0) + 1
            elif held_rank < rank:
                above += 1
        own = counts.pop(account, 0)
        others = sum(min(n, own + 1) for n in counts.values())  # round robin
        return above + own + others, own

    def _urgent(self, account: Any, rank: int) -> bool:
        """May take a reserved slot: top class, nothing running here."""
        return rank == 0 and not self._in_flight.get(account)

    def expected_wait(self, request: EngineRequest) -> float:
        """Seconds a request would wait for a slot if it were queued now (0 until a request has
        been served: nothing to estimate from)."""
        cap = self.capacity()
        if cap >= UNLIMITED:
            return 0.0
        self._lapse_holds()
        rank, account = self.rank_of(request), request.account_id
        ahead, _ = self._ahead(account, rank)
        regular = self._regular(cap)
        free = (cap if self._urgent(account, rank) else regular) - self._running
        if ahead < free or self.hold_s is None:
            return 0.0
        return (ahead - max(free, 0) + 1) * self.hold_s / regular

    def refusal(self, request: EngineRequest) -> EngineOverloadedError | None:
        """The admission decision, as a question: it holds nothing (`admit()` does)."""
        if self._held:
            self._lapse_holds()
        return self._check(request)

    def admit(self, request: EngineRequest) -> None:
        """Takes a place for an admitted request until `stream()` comes with it (or `release()`,
        `cancel()`, or HOLD_S seconds); raises the refusal instead."""
        refused = self.refusal(request)
        if refused is not None:
            raise refused
        self._held[request.request_id] = (request.account_id, self.rank_of(request), self._clock() + HOLD_S)

    def release(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def _lapse_holds(self) -> None:
        now = self._clock()
        for rid in [rid for rid, (_, _, until) in self._held.items() if until <= now]:
            del self._held[rid]

    def _check(self, request: EngineRequest) -> EngineOverloadedError | None:
        if not self.inner.healthy:
            return EngineOverloadedError(f"The model {self.model_id!r} has no engine in rotation; retry shortly.")
        if (
            not any(self._waiting) and len(self._held) < self.max_queue
            and self._running + len(self._held) < self._regular(self.capacity()) and self.inner.has_capacity()
        ):
            return None  # a regular slot free for it and for every request admitted before it: no wait to weigh
        rank, account = self.rank_of(request), request.account_id
        ahead, own = self._ahead(account, rank)
        mine = own + self._in_flight.get(account, 0)  # the caller's own requests, waiting or running
        own_backlog = mine > 0 and mine >= (ahead - own) + (self._running - self._in_flight.get(account, 0))
        waiting = self.queue_depth() + len(self._held)  # admitted ones on their way count
        if waiting >= self.max_queue:
            per_slot = (self.hold_s or 1.0) / self._regular(self.capacity())
            return EngineOverloadedError(
                f"{waiting} requests are already waiting for {self.model_id!r}; retry later.",
                retry_after=max(1, math.ceil(per_slot)), own_backlog=own_backlog,
            )
        if not waiting and self._running < self.capacity() and not self.inner.has_capacity():
            return EngineOverloadedError("The engine is at capacity; retry shortly.")  # full from outside this queue
        wait = self.expected_wait(request)
        limit = self.classes[rank]
        if wait > limit.max_wait:
            return EngineOverloadedError(
                f"The expected wait for {self.model_id!r} ({wait:.0f}s) is longer than the {limit.name} class "
                f"allows ({limit.max_wait:g}s); retry later.",
                retry_after=max(1, math.ceil(wait - limit.max_wait)), own_backlog=own_backlog,
            )
        return None

    # generation -------------------------------------------------------------------------------
    async def _admit(self, request: EngineRequest) -> tuple[_Ticket, float, EngineOutput | None]:
        """Refuses, or queues the request until it may go into the engine. Returns its ticket, the
        time it waited (ms) and, when it was dropped while waiting, the output that ends it."""
        if self._held.pop(request.request_id, None) is None:  # not admitted here beforehand
            refused = self._check(request)
            if refused is not None:
                raise refused
        ticket = self._enqueue(request)
        if ticket.granted is None:
            run = True
        else:
            try:
                run = await ticket.granted
            except BaseException:  # the caller went away while the request waited
                self._leave(ticket)
                raise
        queue_ms = ((ticket.dispatched if run else self._clock()) - ticket.enqueued) * 1000.0  # type: ignore[operator]
        if not run:  # dropped while waiting: the engine never saw it
            return ticket, queue_ms, EngineOutput("", [], FINISH_CANCELLED, len(request.prompt_token_ids or ()), 0, queue_ms=queue_ms, unrun=True)
        return ticket, queue_ms, None

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        ticket, queue_ms, dropped = await self._admit(request)
        if dropped is not None:
            yield dropped
            return
        last: EngineOutput | None = None
        try:
            async with aclosing(self.inner.stream(request)) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    out.queue_ms = queue_ms + (out.queue_ms or 0.0)
                    last = out
                    if ticket.state == "running" and not out.finished and out.completion_tokens >= request.max_tokens - 1:
                        # Its last step is under way: hand the slot on now, so that the next request
                        # is inside the engine when this one ends rather than a step or two later.
                        self._ending += 1
                        self._release(ticket, out, ending=True)
                    yield out
        finally:
            if ticket.state == "running":
                self._release(ticket, last)
            elif ticket.state == "done":
                self._ending -= 1
                self._dispatch()  # a handed-off slot: an engine with a hard limit (a pool) has room only now

    @property
    def completes(self) -> bool:  # type: ignore[override]
        return self.inner.completes

    async def complete(self, request: EngineRequest) -> EngineOutput:
        """`stream()` for a one-body answer: the same admission, queue and release around the inner
        engine's `complete()`, as one coroutine."""
        ticket, queue_ms, dropped = await self._admit(request)
        if dropped is not None:
            return dropped
        last: EngineOutput | None = None
        try:
            last = await self.inner.complete(request)
            last.queue_ms = queue_ms + (last.queue_ms or 0.0)
            return last
        finally:
            if ticket.state == "running":
                self._release(ticket, last)

    def cancel(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        ticket = self._tickets.get(request_id)
        if ticket is not None and ticket.state == "waiting":
            self._drop(ticket)
        else:
            self.inner.cancel(request_id)

    # the queue --------------------------------------------------------------------------------
    def _cost(self, request: EngineRequest) -> int:
        expected = request.max_tokens if self._completion is None else min(request.max_tokens, math.ceil(self._completion))
        return max(1, len(request.prompt_token_ids or ()) + expected)

    def _enqueue(self, request: EngineRequest) -> _Ticket:
        rank, account = self.rank_of(request), request.account_id
        if not self._in_flight.get(account) and not any(account in line for line in self._lines):
            # Back from idle: start at the current virtual time, no credit for the time away.
            self._served[account] = max(self._served.get(account, 0.0), self._vclock)
        self._seq += 1
        ticket = _Ticket(request, rank, self._cost(request), self._seq, self._clock())
        self._tickets[ticket.request_id] = ticket
        if not any(self._waiting) and self._room_for(account, rank, ticket.kv_tokens):
            self._start(ticket)  # nobody to let go first: straight in, no queue entry, no future
            return ticket
        ticket.granted = asyncio.get_running_loop().create_future()
        self._lines[rank].setdefault(account, deque()).append(ticket)
        self._waiting[rank] += 1
        self._dispatch()
        return ticket

    def _room_for(self, account: Any, rank: int, kv_tokens: int) -> bool:
        """Whether a request of this account and class may go into the engine now: a slot it may take
        is free (the reserve only for urgent ones), the engine is not full from elsewhere (another
        model shares it), and its worst case fits the token capacity."""
        cap = self.capacity()
        if self._running >= (cap if self._urgent(account, rank) else self._regular(cap)):
            return False
        if (self._running or self._ending) and not self.inner.has_capacity():
            return False
        return not (self._capacity_tokens and self._running and self._running_tokens + kv_tokens > self._capacity_tokens)

    def _dispatch(self) -> None:
        cap = self.capacity()
        regular = self._regular(cap)
        while self._running < cap and any(self._waiting):
            ticket = self._next(urgent_only=self._running >= regular)
            if ticket is None or not self._room_for(ticket.account, ticket.rank, ticket.kv_tokens):
                return
            self._grant(ticket)

    def _next(self, *, urgent_only: bool) -> _Ticket | None:
        """The head of the line of the top waiting class's account with the fewest tokens served."""
        for rank, line in enumerate(self._lines):
            if not self._waiting[rank]:
                continue
            best: tuple[float, int, Any] | None = None
            for account, queue in line.items():
                if urgent_only and not self._urgent(account, rank):
                    continue
                key = (self._served.get(account, 0.0), queue[0].seq, account)
                if best is None or key[:2] < best[:2]:
                    best = key
            return None if best is None else line[best[2]][0]
        return None

    def _unqueue(self, ticket: _Ticket) -> None:
        line = self._lines[ticket.rank]
        queue = line[ticket.account]
        queue.remove(ticket)
        if not queue:
            del line[ticket.account]
        self._waiting[ticket.rank] -= 1

    def _grant(self, ticket: _Ticket) -> None:
        self._unqueue(ticket)
        assert ticket.granted is not None
        if ticket.granted.done():  # its waiter was cancelled a moment ago
            ticket.state = "dropped"
            self._tickets.pop(ticket.request_id, None)
            return
        self._start(ticket)
        ticket.granted.set_result(True)

    def _start(self, ticket: _Ticket) -> None:
        ticket.state = "running"
        ticket.dispatched = self._clock()
        self._running += 1
        self._running_tokens += ticket.kv_tokens
        account = ticket.account
        self._in_flight[account] = self._in_flight.get(account, 0) + 1
        served = self._served.get(account, 0.0)
        self._vclock = max(self._vclock, served)
        self._served[account] = served + ticket.cost
        self._emit("dispatched", ticket, ticket.dispatched)

    def _drop(self, ticket: _Ticket) -> None:
        """A waiting request leaves the queue without running (client gone, or shutdown)."""
        self._unqueue(ticket)
        ticket.state = "dropped"
        self._tickets.pop(ticket.request_id, None)
        if ticket.granted is not None and not ticket.granted.done():
            ticket.granted.set_result(False)
        self._emit("abandoned", ticket, self._clock())
        self._dispatch()  # a dropped head of line may have held back a smaller request (token capacity)

    def _leave(self, ticket: _Ticket) -> None:
        if ticket.state == "waiting":
            self._drop(ticket)
        elif ticket.state == "running":
            self._release(ticket, None)

    def _release(self, ticket: _Ticket, last: EngineOutput | None, *, ending: bool = False) -> None:
        if ticket.state != "running":
            return
        ticket.state = "done"
        self._tickets.pop(ticket.request_id, None)
        self._running -= 1
        self._running_tokens -= ticket.kv_tokens
        account = ticket.account
        left = self._in_flight.get(account, 0) - 1
        if left > 0:
            self._in_flight[account] = left
        else:
            self._in_flight.pop(account, None)
        served = (last.prompt_tokens + last.completion_tokens) if last is not None else 0
        self._served[account] = self._served.get(account, 0.0) + served - ticket.cost  # the estimate, corrected
        ended = ending or (last is not None and last.finish_reason in (FINISH_STOP, FINISH_LENGTH))
        if last is not None and ended and ticket.dispatched is not None:
            self.hold_s = _average(self.hold_s, self._clock() - ticket.dispatched)
            self._completion = _average(self._completion, float(last.completion_tokens))
        if len(self._served) > MAX_REMEMBERED_ACCOUNTS:
            self._forget_idle_accounts()
        self._dispatch()

    def _forget_idle_accounts(self) -> None:
        """Idle accounts at or behind the virtual clock would come back at it anyway."""
        keep = set(self._in_flight).union(*(line.keys() for line in self._lines))
        self._served = {a: v for a, v in self._served.items() if a in keep or v > self._vclock}

    def count_into(self, waited: Sequence[Observer], abandoned: Sequence[Incrementer]) -> None:
        """Where each class (in rank order) records its dispatched requests' wait in seconds and
        counts those whose client left while queued: metric children owned by whoever reads them
        (the gateway's /metrics). Plain observe()/inc() calls, so the queue never calls back into
        the gateway's own code in the middle of a request's start."""
        if len(waited) != len(self.classes) or len(abandoned) != len(self.classes):
            raise ValueError(f"one metric per priority class: {len(self.classes)} classes")
        self._waited = tuple(waited)
        self._abandoned = tuple(abandoned)

    def _emit(self, kind: str, ticket: _Ticket, now: float) -> None:
        wait_s = max(0.0, now - ticket.enqueued)
        try:
            if kind == "dispatched":
                if self._waited:
                    self._waited[ticket.rank].observe(wait_s)
            elif self._abandoned:
                self._abandoned[ticket.rank].inc()
        except Exception:  # a metrics bug must not stall the queue
            log.exception("queue metric failed")
        if not self.listeners:
            return
        event = QueueEvent(kind, self.model_id, self.classes[ticket.rank].name, wait_s, ticket.request_id, ticket.account)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # a metrics bug must not stall the queue
                log.exception("queue listener failed")


def _average(current: float | None, sample: float) -> float:
    return sample if current is None else (1 - EWMA) * current + EWMA * sample


def schedule_engines(
    served: dict[str, Engine], make: Callable[[Engine], ScheduledEngine]
) -> tuple[dict[str, Engine], list[ScheduledEngine]]:
    """Puts a scheduler in front of every engine that runs requests: a model's fallback chain gets
    its candidates wrapped (in place), a bare engine is wrapped itself, a routing model is left as
    it is. An engine shared by several models or aliases gets one scheduler. Returns the served map
    and the schedulers."""
    made: dict[int, ScheduledEngine] = {}

    def wrap(engine: Engine) -> Engine:
        if isinstance(engine, ScheduledEngine):
            return engine
        if id(engine) not in made:
            made[id(engine)] = make(engine)
        return made[id(engine)]

    from engines.wrappers.router import RouterEngine

    out: dict[str, Engine] = {}
    for name, engine in served.items():
        if isinstance(engine, RouterEngine):  # runs nothing itself: its models are scheduled as served
            out[name] = engine
        elif isinstance(engine, FallbackEngine):
            engine.candidates[:] = [wrap(c) for c in engine.candidates]
            out[name] = engine
        else:
            out[name] = wrap(engine)
    return out, list(made.values())


class _HostSlots:
    """The engine as an engine host's queue sees it: `slots` requests in its batch at once."""

    healthy = True

    def __init__(self, model_id: str, slots: int) -> None:
        self.model_id = model_id
        self._slots = slots

    def slots(self) -> int:
        return self._slots

    def has_capacity(self) -> bool:
        return True


class HostQueue:
    """The scheduler of an engine that several gateway workers share (engines/backends/hf_process.py, the engine
    host): the one place that sees every worker's requests, so the classes, the fair share across
    accounts and the reserve apply to the engine as a whole. Requests come as commands, not streams:
    `add` lets one in (`go`, with the ms it waited) when `ScheduledEngine`'s order says so, or turns
    it away (`refuse`, with the reason and Retry-After); `finish`/`cancel` free its slot."""

    def __init__(self, model_id: str, slots: int, *, reserve: int, classes: tuple[PriorityClass, ...], max_queue: int) -> None:
        self.scheduler = ScheduledEngine(_HostSlots(model_id, slots), reserve=reserve, classes=classes, max_queue=max_queue)  # type: ignore[arg-type]
        self._tickets: dict[str, tuple[_Ticket, int]] = {}

    def add(self, key: str, prompt_ids: list[int], max_tokens: int, account: Any, priority: str | None,
            go: Callable[[float], None], refuse: Callable[[str, int], None]) -> None:
        request = EngineRequest(request_id=key, max_tokens=max_tokens, prompt_token_ids=prompt_ids, account_id=account, priority=priority)
        refused = self.scheduler.refusal(request)
        if refused is not None:
            refuse(str(refused), refused.retry_after)
            return
        ticket = self.scheduler._enqueue(request)
        self._tickets[key] = (ticket, len(prompt_ids))
        if ticket.granted is None:
            go(0.0)
            return

        def granted(future: asyncio.Future[bool]) -> None:
            if not future.cancelled() and future.result() and ticket.dispatched is not None:
                go((ticket.dispatched - ticket.enqueued) * 1000.0)

        ticket.granted.add_done_callback(granted)

    def finish(self, key: str, completion_tokens: int, finish_reason: str) -> None:
        entry = self._tickets.pop(key, None)
        if entry is not None:
            ticket, prompt_tokens = entry
            self.scheduler._release(ticket, EngineOutput("", [], finish_reason, prompt_tokens, completion_tokens))

    def cancel(self, key: str) -> None:
        entry = self._tickets.pop(key, None)
        if entry is not None:
            self.scheduler._leave(entry[0])

    def running(self) -> int:
        return self.scheduler._running

    def waiting(self) -> int:
        return self.scheduler.queue_depth()
