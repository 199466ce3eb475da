"""The scheduler's order, reserve, admission and cancellation, against a gated test engine: every
request the engine receives waits for the test to let it finish, so the order is exact."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engines.base import FINISH_CANCELLED, FINISH_STOP, Engine, EngineOutput, EngineOverloadedError, EngineRequest
from engines.wrappers.fallback import FallbackEngine
from engines.backends.openai_pool import OpenAIPoolEngine
from engines.wrappers.router import RouterEngine
from engines.wrappers.scheduler import PriorityClass, QueueEvent, ScheduledEngine, parse_classes, schedule_engines


class GatedEngine(Engine):
    """Runs whatever it is given; a request ends when the test calls `finish()`."""

    def __init__(self, model_id: str = "gated") -> None:
        self.model_id = model_id
        self.context_length = 4096
        self.seen: list[str] = []  # request ids, in the order the engine received them
        self.gates: dict[str, asyncio.Event] = {}
        self.cancelled: list[str] = []

    @property
    def ready(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return [1, 2, 3]

    def encode_text(self, prompt: str) -> list[int]:
        return [1, 2, 3]

    def has_capacity(self) -> bool:
        return True

    def requests_in_flight(self) -> int:
        return len(self.gates)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        if request_id in self.gates:
            self.gates[request_id].set()

    def running(self) -> list[str]:
        return [rid for rid, gate in self.gates.items() if not gate.is_set()]

    async def finish(self, request_id: str | None = None) -> None:
        """Lets one running request end (the oldest when none is named) and lets the loop settle."""
        rid = request_id or self.running()[0]
        self.gates[rid].set()
        for _ in range(5):
            await asyncio.sleep(0)

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.seen.append(request.request_id)
        gate = self.gates[request.request_id] = asyncio.Event()
        try:
            await gate.wait()
            prompt = len(request.prompt_token_ids or ())
            yield EngineOutput("x", [7] * request.max_tokens, FINISH_STOP, prompt, request.max_tokens, queue_ms=5.0)
        finally:
            self.gates.pop(request.request_id, None)


def req(rid: str, account: int | None, *, prompt: int = 10, max_tokens: int = 10, priority: str | None = None) -> EngineRequest:
    return EngineRequest(request_id=rid, max_tokens=max_tokens, prompt_token_ids=[1] * prompt, account_id=account, priority=priority)


VIA = {"way": "stream"}


@pytest.fixture(autouse=True, params=["stream", "complete"])
def via(request: pytest.FixtureRequest) -> Any:
    """Every test runs the requests through `stream()` and again through `complete()` (the one-body
    coroutine the gateway uses for engines that complete natively): the same queue, order and release."""
    VIA["way"] = request.param
    yield request.param
    VIA["way"] = "stream"


async def consume(engine: Engine, request: EngineRequest) -> list[EngineOutput]:
    if VIA["way"] == "complete":
        out = await engine.complete(request)
        return [*(out.before or ()), out]
    return [out async for out in engine.stream(request)]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def submit(engine: Engine, *requests: EngineRequest) -> list[asyncio.Task[list[EngineOutput]]]:
    tasks = [asyncio.create_task(consume(engine, r)) for r in requests]
    await settle()
    return tasks


async def drain(inner: GatedEngine, tasks: list[asyncio.Task[Any]]) -> None:
    while not all(t.done() for t in tasks):
        if inner.running():
            await inner.finish()
        else:
            await settle()


async def test_a_light_account_is_served_between_a_heavy_accounts_requests() -> None:
    inner = GatedEngine()
    sched = ScheduledEngine(inner, capacity=1, reserve=0)
    tasks = await submit(sched, *[req(f"a{i}", 1) for i in range(20)])
    tasks += await submit(sched, *[req(f"b{i}", 2) for i in range(5)])
    assert inner.seen == ["a0"] and sched.queue_depth() == 24
    await drain(inner, tasks)
    # FIFO would run a0..a19 first; fair share alternates once b arrives.
    assert inner.seen[:11] == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4", "a5"]
    assert sorted(inner.seen) == sorted([f"a{i}" for i in range(20)] + [f"b{i}" for i in range(5)])


async def test_fair_share_counts_tokens_not_requests() -> None:
    inner = GatedEngine()
    sched = ScheduledEngine(inner, capacity=1, reserve=0)
    tasks = await submit(sched, *[req(f"a{i}", 1, prompt=30, max_tokens=10) for i in range(6)])  # 40 tokens each
    tasks += await submit(sched, *[req(f"b{i}", 2, prompt=5, max_tokens=5) for i in range(12)])  # 10 tokens each
    await drain(inner, tasks)
    first = inner.seen[:11]
    assert first.count("a0") == 1 and sum(r.startswith("a") for r in first) <= 3, first
    # between two of a's requests, b gets about as many tokens as one of a's: 4 of its requests
    a_positions = [i for i, r in enumerate(inner.seen) if r.startswith("a")]
    assert 3 <= a_positions[2] - a_positions[1] - 1 <= 5, inner.seen


async def test_priority_class_goes_first_and_unknown_class_goes_last() -> None:
    inner = GatedEngine()
    sched = ScheduledEngine(inner, capacity=1, reserve=0)
    tasks = await submit(sched, *[req(f"x{i}", 1, priority="batch") for i in range(4)])
    tasks += await submit(sched, req("odd", 3, priority="no-such-class"))
    tasks += await submit(sched, *[req(f"y{i}", 2, priority="interactive") for i in range(2)])
    tasks += await submit(sched, req("z", 4))  # no priority: the top class
    await drain(inner, tasks)
    assert inner.seen[0] == "x0"
    assert set(inner.seen[1:4]) == {"y0", "y1", "z"}
    assert set(inner.seen[4:]) == {"x1", "x2", "x3", "odd"}  # batch: the unknown class ranks with it


async def test_the_reserve_takes_only_a_top_class_account_with_nothing_running() -> None:
    inner = GatedEngine()
    sched = ScheduledEngine(inner, capacity=3, reserve=1)
    tasks = await submit(sched, *[req(f"a{i}", 1) for i in range(6)])
    assert inner.running() == ["a0", "a1"]  # the third slot is held back
    tasks += await submit(sched, req("x", 3, priority="batch"))
    assert inner.running() == ["a0", "a1"]  # batch does not get the reserve either
    tasks += await submit(sched, req("b0", 2), req("b1", 2))
    assert inner.running() == ["a0", "a1", "b0"]  # b had nothing running: in at once
    await inner.finish("b0")
    assert inner.running() == ["a0", "a1", "b1"]
    await inner.finish("a0")
    assert inner.running() == ["a1", "b1"]  # the two regular slots are taken: the reserve stays free
    await inner.finish("a1")
    assert inner.running() == ["b1", "a2"]  # a before the batch class
    await drain(inner, tasks)
    assert inner.seen[-1] == "x"


async def test_a_cancelled_waiting_request_never_reaches_the_engine() -> None:
    inner = GatedEngine()
    events: list[QueueEvent] = []
    sched = ScheduledEngine(inner, capacity=1, reserve=0)
    sched.listeners.append(events.append)
    tasks = await submit(sched, req("run", 1), req("left", 1), req("gone", 1), req("next", 1))
    sched.cancel("left")  # what a client disconnect does
    await settle()
    outputs = tasks[1].result()
    assert [o.finish_reason for o in outputs] == [FINISH_CANCELLED]
    assert outputs[0].completion_tokens == 0 and outputs[0].queue_ms is not None
    tasks[2].cancel()  # the consumer itself goes away while waiting
    await settle()
    assert sched.queue_depth() == 1
    await drain(inner, [tasks[0], tasks[3]])
    assert inner.seen == ["run", "next"] and inner.cancelled == []
    assert [e.kind for e in events].count("abandoned") == 2


async def test_running_requests_are_cancelled_in_the_engine() -> None:
    inner = GatedEngine()
    sched = ScheduledEngine(inner, capacity=1, reserve=0)
    tasks = await submit(sched, req("run", 1), req("wait", 1))
    sched.cancel("run")
    await settle()
    assert inner.cancelled == ["run"] and inner.running() == ["wait"]
    await drain(inner, tasks)


async def test_queue_time_is_added_to_the_engines_own() -> None:
    inner = GatedEngine()
    now = [100.0]
    sched = ScheduledEngine(inner, capacity=1, reserve=0, clock=lambda: now[0])
    events: list[QueueEvent] = []
    sched.listeners.append(events.append)
    tasks = await submit(sched, req("first", 1), req("second", 2, priority="batch"))
    now[0] += 2.5
    await drain(inner, tasks)
    first, second = tasks[0].result()[-1], tasks[1].result()[-1]
    assert first.queue_ms == pytest.approx(5.0)  # the engine's own 5 ms, no gateway wait
    assert second.queue_ms == pytest.approx(2505.0)
    assert [(e.kind, e.priority, e.wait_s, e.request_id, e.account_id) for e in events] == [
        ("dispatched", "interactive", 0.0, "first", 1), ("dispatched", "batch", 2.5, "second", 2)
    ]


async def test_a_full_queue_refuses_at_once() -> None:
    inner = GatedEngine()
    sched = ScheduledEngine(inner, capacity=1, reserve=0, max_queue=2)
    tasks = await submit(sched, req("r", 1), req("w1", 1), req("w2", 1))
    with pytest.raises(EngineOverloadedError) as info:
        await consume(sched, req("w3", 1))
    assert info.value.own_backlog and info.value.retry_after >= 1
    refused = sched.refusal(req("other", 2))
    assert refused is not None and not refused.own_backlog  # someone else's backlog: not this caller's doing
    assert not sched.has_capacity() and "w3" not in inner.seen
    await drain(inner, tasks)


async def test_expected_wait_over_the_class_limit_is_refused_with_retry_after() -> None:
    inner = GatedEngine()
    now = [0.0]
    classes = (PriorityClass("interactive", 3.0), PriorityClass("batch", 100.0))
    sched = ScheduledEngine(inner, capacity=1, reserve=0, classes=classes, clock=lambda: now[0])
    tasks = await submit(sched, req("warm", 1))
    assert sched.refusal(req("probe", 9)) is None  # nothing measured yet
    now[0] += 2.0
    await drain(inner, tasks)
    assert sched.hold_s == pytest.approx(2.0)
    tasks = await submit(sched, req("a0", 1), req("a1", 1))  # a0 runs, a1 waits
    assert sched.expected_wait(req("a2", 1)) == pytest.approx(4.0)  # a1 then itself: 2 turns of 2 s
    refused = sched.refusal(req("a2", 1))
    assert refused is not None and refused.own_backlog and refused.retry_after == 1  # 4 s - 3 s allowed
    assert sched.refusal(req("b0", 2, priority="batch")) is None  # batch allows 100 s
    tasks += await submit(sched, *[req(f"a{i}", 1, priority="batch") for i in range(2, 5)])
    refused = sched.refusal(req("c", 3))
    assert refused is not None and not refused.own_backlog  # interactive, behind a1 and a turn: 4 s > 3 s
    await drain(inner, tasks)


async def test_a_pool_is_scheduled_per_replica_in_rotation() -> None:
    pool = OpenAIPoolEngine(model_id="p", replicas=["http://a/v1", "http://b/v1", "http://c/v1"], context_length=4096, max_concurrency=2)
    sched = ScheduledEngine(pool)
    assert sched.capacity() == 6
    pool.pool.eject(pool.pool.replicas[0], "test")
    assert sched.capacity() == 4  # an ejected replica's slots are gone
    assert sched.unwrapped().pool is pool.pool  # type: ignore[attr-defined]  # the backend's own specifics: through unwrapped()


async def test_every_engine_behind_a_model_gets_one_scheduler() -> None:
    shared, own = GatedEngine("shared"), GatedEngine("own")
    bare = GatedEngine("bare")
    first = FallbackEngine("first", [own, shared])
    second = FallbackEngine("second", [shared])
    router = RouterEngine("auto", [], "first", {"first": first, "second": second})
    served, schedulers = schedule_engines(
        {"first": first, "alias": first, "second": second, "bare": bare, "bare-alias": bare, "auto": router},
        lambda e: ScheduledEngine(e, capacity=1),
    )
    assert len(schedulers) == 3 and served["auto"] is router  # a router runs nothing itself
    assert first.candidates[1] is second.candidates[0]  # one queue for the shared engine
    assert served["bare"] is served["bare-alias"] and isinstance(served["bare"], ScheduledEngine)
    assert served["first"] is first and all(isinstance(c, ScheduledEngine) for c in first.candidates)


async def test_a_chain_refuses_only_when_every_engine_would() -> None:
    busy, idle = GatedEngine("busy"), GatedEngine("idle")
    sb, si = ScheduledEngine(busy, capacity=1, max_queue=1), ScheduledEngine(idle, capacity=1, max_queue=1)
    chain = FallbackEngine("m", [sb, si])
    tasks = await submit(sb, req("r", 1), req("w", 1))
    assert sb.refusal(req("n", 2)) is not None and chain.refusal(req("n", 2)) is None
    outputs = await asyncio.gather(consume(chain, req("n", 2)), idle_finisher(idle, "n"))
    assert outputs[0][-1].finish_reason == FINISH_STOP and idle.seen == ["n"]
    await drain(busy, tasks)


async def idle_finisher(engine: GatedEngine, rid: str) -> None:
    while rid not in engine.gates:
        await asyncio.sleep(0)
    await engine.finish(rid)


def test_priority_classes_parse_and_refuse_mistakes() -> None:
    assert parse_classes("interactive:30, batch:600") == (PriorityClass("interactive", 30.0), PriorityClass("batch", 600.0))
    for bad in ("interactive", "interactive:soon", "a:1,a:2", "a:0", ":3"):
        with pytest.raises(ValueError):
            parse_classes(bad)


async def test_a_burst_admitted_at_once_counts_its_own_places() -> None:
    inner = GatedEngine()
    now = [0.0]
    classes = (PriorityClass("interactive", 3.0),)
    sched = ScheduledEngine(inner, capacity=1, reserve=0, classes=classes, clock=lambda: now[0])
    tasks = await submit(sched, req("warm", 1))
    now[0] += 2.0
    await drain(inner, tasks)
    tasks = await submit(sched, req("running", 1))
    # Admission happens before the quota is reserved; the requests arrive at the queue later.
    sched.admit(req("x1", 2))  # 2 s: one turn
    assert sched.refusal(req("x2", 2)) is not None  # 4 s: x1 holds the turn before it
    tasks += await submit(sched, req("x1", 2))  # arrives: its held place becomes its ticket
    assert sched.queue_depth() == 1 and sched.refusal(req("x3", 2)) is not None
    now[0] += 11.0  # a place held by a request that never arrives lapses
    assert sched.refusal(req("y1", 3)) is not None  # x1 really waits
    await drain(inner, tasks)
    sched.admit(req("z1", 3))  # the free slot is z1's
    assert sched.expected_wait(req("z2", 4)) > 0
    now[0] += 11.0
    assert sched.expected_wait(req("z2", 4)) == 0  # z1 never came: its place lapsed


async def test_who_is_told_to_slow_down() -> None:
    inner = GatedEngine()
    now = [0.0]
    sched = ScheduledEngine(inner, capacity=1, reserve=0, classes=(PriorityClass("interactive", 1.0),), clock=lambda: now[0])
    tasks = await submit(sched, req("warm", 1))
    now[0] += 2.0
    await drain(inner, tasks)
    tasks = await submit(sched, req("a0", 1))
    mine, theirs = sched.refusal(req("a1", 1)), sched.refusal(req("b0", 2))
    assert mine is not None and mine.own_backlog  # its own running request is the wait: 429
    assert theirs is not None and not theirs.own_backlog  # someone else's: 503
    await drain(inner, tasks)


class SteppedEngine(GatedEngine):
    """Each request yields one token per `step()` from the step after it arrived, the last with
    its finish reason."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.ticks: list[asyncio.Event] = []
        self.full = False  # has_capacity(): False models a pool whose replicas are all busy

    def has_capacity(self) -> bool:
        return not self.full

    def _tick(self, n: int) -> asyncio.Event:
        while len(self.ticks) < n:
            self.ticks.append(asyncio.Event())
        return self.ticks[n - 1]

    async def step(self) -> None:
        self.steps += 1
        self._tick(self.steps).set()
        await settle()

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.seen.append(request.request_id)
        start = self.steps
        for n in range(1, request.max_tokens + 1):
            await self._tick(start + n).wait()
            yield EngineOutput("x", [7], FINISH_STOP if n == request.max_tokens else None, 3, n)


@pytest.mark.parametrize("via", ["stream"])  # the hand-off watches a stream's outputs; complete() has only the final one
async def test_a_request_in_its_last_step_hands_its_slot_on(via: str) -> None:
    inner = SteppedEngine()
    sched = ScheduledEngine(inner, capacity=1, reserve=0)
    tasks = await submit(sched, req("first", 1, max_tokens=3), req("next", 2, max_tokens=2))
    await inner.step()
    assert inner.seen == ["first"]
    await inner.step()  # first has 2 of 3 tokens: its last step is under way
    assert inner.seen == ["first", "next"] and sched.snapshot()["running"] == 1
    await inner.step()
    await inner.step()
    await asyncio.gather(*tasks)
    assert sched.snapshot()["running"] == 0 and sched.hold_s is not None


async def test_an_engine_without_room_gets_the_handed_off_slot_when_the_request_ends() -> None:
    inner = SteppedEngine()
    sched = ScheduledEngine(inner, capacity=1, reserve=0)
    tasks = await submit(sched, req("first", 1, max_tokens=2), req("next", 2, max_tokens=1))
    inner.full = True  # e.g. every replica of a pool at its max_concurrency
    await inner.step()
    assert inner.seen == ["first"]  # handed off, but the engine has no room yet
    inner.full = False
    await inner.step()
    await settle()
    assert inner.seen == ["first", "next"]
    await inner.step()
    await asyncio.gather(*tasks)


async def test_a_place_held_at_admission_is_given_back_through_the_chain() -> None:
    inner = GatedEngine()
    sched = ScheduledEngine(inner, capacity=1, reserve=0, max_queue=1)
    chain = FallbackEngine("m", [sched])
    assert chain.refusal(req("r", 1)) is None and chain.refusal(req("r", 1)) is None  # a question takes nothing
    chain.admit(req("r", 1))
    assert chain.refusal(req("other", 2)) is not None  # the one place is held for r
    with pytest.raises(EngineOverloadedError):
        chain.admit(req("other", 2))
    chain.release("r")  # r was refused by its quota: what its Admission's settle() does then
    assert chain.refusal(req("other", 2)) is None


@pytest.mark.parametrize("via", ["stream"])
def test_only_chains_of_native_completers_complete_natively(via: str) -> None:
    """The gateway answers one-body requests through `complete()` only where every layer has its own
    (pools); a chain with an engine that only streams (hf, a test engine) keeps the stream path."""
    pool = OpenAIPoolEngine(model_id="p", replicas=["http://a/v1"], context_length=4096)
    served, _ = schedule_engines({"p": FallbackEngine("p", [pool]), "g": FallbackEngine("g", [GatedEngine(), pool])},
                                 lambda e: ScheduledEngine(e, capacity=4, reserve=0))
    assert served["p"].completes and not served["g"].completes
    assert not GatedEngine().completes
