"""One Admission per request (gateway/serving/admission.py): what a request holds (its place in the engine's
queue, its quota hold, its journal entry) is let go by one `settle()`, exactly once, whatever
happens between admission and the end of the stream. Real scheduler, limiter, ledger writer and
journal on SQLite; the engine is tests/fakes/engine.py (the tests are about metering)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from billing import migrate
from billing.db import create_engine
from billing.ledger.journal import LedgerJournal
from billing.keys.store import Principal
from billing.ledger.writer import LedgerWriter, UsageRecord
from billing.quota.limits import Limits
from billing.quota import Hold, LedgerTotals, MemoryLimiter, Scope
from engines.backends.openai_pool import OpenAIPoolEngine
from engines.base import EngineOverloadedError, EngineRequest
from engines.wrappers.scheduler import ScheduledEngine
from gateway.http.errors import RateLimited
from gateway.serving.generate import answer
from gateway.api.openai.protocol import ChatCompletionRequest, parse
from gateway.serving.generation_response import GenerationResponse
from gateway.serving.completions import CompletionService
from tests.conftest import ServerThread
from tests.fakes.engine import FakeEngine
from tests.fakes.upstream import Behaviour, ScriptedUpstream

MODEL = "fake"


class Setup:
    def __init__(self, tmp: Path) -> None:
        url = f"sqlite:///{tmp / 'ledger.db'}"
        migrate.upgrade(url)
        self.db = create_engine(url)
        self.journal = LedgerJournal(tmp / "journal")
        self.journal.open()
        self.ledger = LedgerWriter(self.db, journal=self.journal)  # not started: rows stay queued, counted here
        self.rows: list[UsageRecord] = []
        self.ledger.add_listener(self.rows.append)
        self.limiter = MemoryLimiter(LedgerTotals(self.db))
        self.settled: list[tuple[str, int]] = []
        settle = self.limiter.settle

        async def counting_settle(hold: Any, tokens: int, nanos: int, background: bool = False) -> bool:
            self.settled.append((hold.request_id, tokens))
            return await settle(hold, tokens, nanos, background)

        self.limiter.settle = counting_settle  # type: ignore[method-assign]
        # One place in the engine and one in its queue: a place still held is seen at once.
        self.engine = ScheduledEngine(FakeEngine(MODEL), capacity=1, reserve=0, max_queue=1)
        self.service = CompletionService({MODEL: self.engine}, self.ledger, limiter=self.limiter)

    def gen(self, request_id: str, principal: Principal, *, stream: bool = True) -> Any:
        body = parse(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream})
        return self.service.prepare_chat(principal, body, request_id)

    def place_is_free(self) -> bool:
        """Whether another request can take the one place now (it would be refused while one is held)."""
        probe = EngineRequest("probe", 3, prompt_token_ids=[1, 2], account_id=9)
        try:
            self.engine.admit(probe)
        except EngineOverloadedError:
            return False
        self.engine.release("probe")
        return True

    async def close(self) -> None:
        await self.service.drain()
        self.journal.close()
        await self.db.dispose()


def principal(key_id: int = 1, key_limits: Limits = Limits()) -> Principal:
    return Principal(key_id=key_id, account_id=1, is_admin=False, models=None, expires_at=None, revoked=False, key_limits=key_limits)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    yield Setup(tmp_path)


async def test_a_second_settle_does_nothing(setup: Setup) -> None:
    admission = await setup.service.admit(setup.gen("r1", principal()))
    assert not setup.place_is_free()  # admitted: the place is the request's until it settles
    assert admission.settle("completed") is True
    assert admission.settle("error") is False and admission.settle() is False
    await setup.service.drain()
    assert [(r.request_id, r.status) for r in setup.rows] == [("r1", "completed")]
    assert [rid for rid, _ in setup.settled] == ["r1"]  # the quota hold settled once
    assert setup.place_is_free() and setup.service.live_count() == 0
    await setup.close()


async def test_a_quota_refusal_frees_the_place_and_writes_no_row(setup: Setup) -> None:
    refused = principal(key_id=2, key_limits=Limits(rpm=0))
    with pytest.raises(RateLimited):
        await setup.service.admit(setup.gen("r2", refused))
    assert setup.place_is_free()  # not held until HOLD_S lapses: given back at once
    assert setup.rows == [] and setup.journal.outstanding == 0 and setup.service.live_count() == 0
    await setup.close()


async def test_a_failure_before_the_stream_starts_still_settles_once(setup: Setup) -> None:
    """The response fails before it reads the engine stream (its generator never starts, so no
    `finally` of the stream runs): the response's own `finally` settles the admission."""

    class Failing(GenerationResponse):
        async def _respond(self, send: Any) -> None:
            raise RuntimeError("boom before the first output")

    gen = setup.gen("r3", principal())
    admission = await setup.service.admit(gen)
    response = Failing(gen, setup.service.metered(gen, admission), {}, admission=admission)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError("nothing is sent")

    with pytest.raises(RuntimeError):
        await response({"type": "http"}, receive, send)
    await setup.service.drain()
    assert [(r.request_id, r.status) for r in setup.rows] == [("r3", "error")]
    assert [rid for rid, _ in setup.settled] == ["r3"] and setup.place_is_free()
    await setup.close()


async def test_a_failure_between_admission_and_the_response_settles_once(setup: Setup) -> None:
    """`answer()` admits, then building the response fails: the admission is settled there."""
    gen = setup.gen("r4", principal())

    app = SimpleNamespace(state=SimpleNamespace(response_cache=None))  # no response cache configured
    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "app": app})

    def streamed(outputs: AsyncIterator[Any], headers: dict[str, str], admission: Any) -> Any:
        raise RuntimeError("boom building the response")

    with pytest.raises(RuntimeError):
        await answer(request, setup.service, gen, streamed=streamed, completed=streamed)
    await setup.service.drain()
    assert [(r.request_id, r.status) for r in setup.rows] == [("r4", "error")]
    assert [rid for rid, _ in setup.settled] == ["r4"] and setup.place_is_free()
    await setup.close()


async def test_a_stream_read_to_its_end_settles_once_before_its_last_output(setup: Setup) -> None:
    gen = setup.gen("r5", principal())
    admission = await setup.service.admit(gen)
    seen_rows_at_last: list[int] = []
    async for out in setup.service.metered(gen, admission):
        if out.finished:
            seen_rows_at_last.append(len(setup.rows))
    assert seen_rows_at_last == [1]  # the row was recorded before the client could see the end
    assert admission.settle() is False  # what the response's finally then does: nothing
    await setup.service.drain()
    assert [(r.request_id, r.status, r.completion_tokens) for r in setup.rows] == [("r5", "completed", 3)]
    assert [rid for rid, _ in setup.settled] == ["r5"] and setup.place_is_free()
    await setup.close()


async def test_a_pass_through_stream_closed_early_is_billed_the_text_it_relayed(setup: Setup) -> None:
    """A pool's outputs count a token a chunk until the upstream's usage comes; a server may stream
    several tokens a chunk (vLLM's stream_interval, speculative decoding). A stream closed before its
    end (the response's write failed: it closes the stream) is billed the count of the text relayed."""
    up = ScriptedUpstream()
    up.default = Behaviour(tokens=[" one two three four"] * 8, stall_after=3)  # 3 chunks, then silence
    server = ServerThread(up).__enter__()
    pool = OpenAIPoolEngine(model_id="pool", replicas=[f"http://127.0.0.1:{server.port}/v1"], context_length=4096,
                            health_path=None, retries=0)
    await pool.start()
    try:
        service = CompletionService({"pool": ScheduledEngine(pool, capacity=2, reserve=0, max_queue=2)}, setup.ledger, limiter=setup.limiter)
        body = parse(ChatCompletionRequest, {"model": "pool", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
                                             "stream": True}, passthrough=True)
        gen = service.prepare_chat(principal(), body, "r9")
        outputs = service.metered(gen, await service.admit(gen))
        relayed = ""
        async for out in outputs:
            relayed += "".join(p.text for p in out.before or ()) + out.text
            if relayed.count("four") == 3:
                break
        await outputs.aclose()  # what GenerationResponse does when a write fails
        await service.drain()
        [row] = setup.rows
        assert row.estimated and row.completion_tokens == pool.counter.count(relayed) == 12, row
    finally:
        await pool.stop()
        server.__exit__()
        await setup.close()


async def test_a_batch_line_taken_from_its_runner_is_refused_before_its_row(setup: Setup) -> None:
    """A batch line's admission marks it admitted in the database, for its runner only, after the hold
    and before the journal: when the mark is refused (another runner took the batch over and put the
    line back), the request is refused with no row and nothing held, and the line says it was taken."""
    from gateway.batches.line import BatchLine
    from gateway.http.errors import ServiceUnavailable

    marks: list[bool] = []
    limited = principal(key_limits=Limits(monthly_tokens=1_000))  # counted by the limiter

    def line_of(index: int, answer: bool) -> tuple[BatchLine, Any]:
        async def mark() -> bool:
            marks.append(answer)
            return answer

        gen = setup.gen(f"batch_x-{index}", limited)
        gen.api, gen.batch_id = "batch", "batch_x"
        return BatchLine("batch_x", gen.request_id, limited, mark=mark), gen

    line, gen = line_of(0, False)
    with pytest.raises(ServiceUnavailable):
        await setup.service.admit(gen, line)
    assert marks == [False] and line.taken and not line.admitted
    await setup.service.drain()
    assert setup.rows == [] and setup.journal.outstanding == 0 and setup.service.live_count() == 0
    assert setup.place_is_free() and [rid.split("/")[0] for rid, _ in setup.settled] == ["batch_x-0"]  # the hold given back

    line, gen = line_of(1, True)
    admission = await setup.service.admit(gen, line)
    assert line.admitted and line.marked and not line.taken and setup.journal.outstanding == 1
    # Its hold's own id, and its row's: the quota files settled usage under the row's id until the row
    # is written (tests/billing/quota/test_quota_rebuild.py, the batch line's run)
    assert admission.hold is not None and admission.hold.request_id.startswith("batch_x-1/")
    assert admission.hold.row == "batch_x-1" and admission.hold.to_json()["row_id"] == "batch_x-1"
    journaled_before = {k: v for k, v in admission.hold.to_json().items() if k != "row_id"}  # a journal line before row_id
    assert Hold.from_json(journaled_before).row == "batch_x-1"
    admission.settle("completed")
    await setup.service.drain()
    assert [(r.request_id, r.api) for r in setup.rows] == [("batch_x-1", "batch")]

    # The runner that took the batch over runs line 0, under the line's one request id: its usage is
    # counted (the refused run's settle, of its own hold, does not stand in for it) and nothing stays held.
    key = Scope("key", limited.key_id, limited.key_limits)
    before = await setup.limiter.counters(key)
    line, gen = line_of(0, True)
    admission = await setup.service.admit(gen, line)
    async for _ in setup.service.metered(gen, admission):
        pass
    await setup.service.drain()
    [row] = [r for r in setup.rows if r.request_id == "batch_x-0"]
    after = await setup.limiter.counters(key)
    assert after["month_tokens"] - before.get("month_tokens", 0) == row.prompt_tokens + row.completion_tokens > 0, (before, after)
    assert after.get("held_tokens", 0) == 0 and after.get("in_flight", 0) == 0, after
    await setup.close()


async def test_a_row_invoices_do_not_bill_costs_nothing_anywhere(setup: Setup) -> None:
    """Invoices bill `completed` and `cancelled` rows only. An engine that fails after two tokens
    leaves an `error` row: its tokens are counted, but it costs 0, so a prepaid balance and a spend
    limit take nothing of it either (before: its cost was spent from the balance, never invoiced)."""
    from engines.base import EngineError, EngineOutput
    from billing.prices.book import PriceBook

    class Failing(FakeEngine):
        async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
            prompt = len(request.prompt_token_ids or [])
            yield EngineOutput("Yes", [1], None, prompt, 1)
            yield EngineOutput(",", [2], None, prompt, 2)
            raise EngineError("the GPU fell over")

    prices = PriceBook(setup.db)
    await prices.add(MODEL, "1.000", "2.000")
    engine = ScheduledEngine(Failing(MODEL), capacity=1, reserve=0, max_queue=1)
    service = CompletionService({MODEL: engine}, setup.ledger, limiter=setup.limiter, prices=prices)
    from decimal import Decimal

    spender = Principal(key_id=3, account_id=1, is_admin=False, models=None, expires_at=None, revoked=False,
                        key_limits=Limits(monthly_spend=Decimal("1")))
    body = parse(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    gen = service.prepare_chat(spender, body, "err-1")
    admission = await service.admit(gen)
    assert admission.nanos > 0  # priced: the hold was for money
    with pytest.raises(EngineError):
        async for _ in service.metered(gen, admission):
            pass
    await service.drain()
    [row] = setup.rows
    assert (row.status, row.completion_tokens, row.cost_nanos) == ("error", 2, 0), row
    counters = await setup.limiter.counters(Scope("key", 3, spender.key_limits))
    assert counters["month_nanos"] == 0 and counters["held_nanos"] == 0, counters  # nothing spent, nothing held
    assert counters["month_tokens"] == row.prompt_tokens + row.completion_tokens, counters  # its tokens counted
    await setup.close()


async def test_the_hold_counts_in_the_month_its_row_is_billed_to(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request admitted at Oct 31 23:59:59.95 is October's row (invoices, statements and the limiter's
    rebuild count months by `admitted_at`), so its hold counts against October's monthly_spend, even
    when the reservation runs after midnight (the price lookup awaits between the two). Before, the
    reservation took its own clock: November's empty counter admitted it, and October's spend
    passed its limit (an audit: 1,400,000,000 nano-USD against 1,000,000,000)."""
    import time as real_time
    from datetime import datetime, timezone
    from types import SimpleNamespace

    from billing.ledger.writer import write_records
    from billing.prices.book import PriceBook
    from billing.quota import base as quota_base
    from gateway.serving import admission as admission_module

    admitted = datetime(2026, 10, 31, 23, 59, 59, 950_000, tzinfo=timezone.utc)
    after_midnight = datetime(2026, 11, 1, 0, 0, 0, 50_000, tzinfo=timezone.utc).timestamp()
    prices = PriceBook(setup.db)
    await prices.add(MODEL, "1000.000", "1000.000", datetime(2026, 10, 1, tzinfo=timezone.utc), backdate=True)
    await write_records(setup.db, [UsageRecord(  # October so far: $0.99 of a $1.00 monthly_spend
        request_id="october", account_id=1, key_id=1, model=MODEL, prompt_tokens=495, completion_tokens=495, status="completed",
        finish_reason="stop", total_ms=1.0, cost_nanos=990_000_000, admitted_at=datetime(2026, 10, 31, 23, tzinfo=timezone.utc),
        created_at=datetime(2026, 10, 31, 23, 0, 1, tzinfo=timezone.utc))])
    service = CompletionService({MODEL: setup.engine}, setup.ledger, limiter=setup.limiter, prices=prices)
    spender = Principal(key_id=5, account_id=1, is_admin=False, models=None, expires_at=None, revoked=False,
                        account_limits=Limits().patched({"monthly_spend": "1.00"}))
    monkeypatch.setattr(admission_module, "utcnow", lambda: admitted)
    monkeypatch.setattr(quota_base, "time", SimpleNamespace(time=lambda: after_midnight, gmtime=real_time.gmtime, strftime=real_time.strftime))
    gen = service.prepare_chat(spender, parse(ChatCompletionRequest, {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}), "straddle")
    with pytest.raises(RateLimited) as refused:  # 11 tokens x $1000/M = $0.011: past October's $0.01 left
        await service.admit(gen)
    assert refused.value.code == "monthly_spend", refused.value
    await setup.close()


@pytest.mark.parametrize("prepaid", [False, True])
async def test_only_a_prepaid_row_is_capped_at_its_hold(setup: Setup, prepaid: bool) -> None:
    """An estimated prompt can cost more than the hold (a pass-through pool without `tokenizer:`). A
    prepaid account's row costs at most its hold, so its balance never goes below zero; a postpaid
    account's row costs its tokens in full: it is invoiced, and the operator is not to bear the
    estimate's error there (docs/prepaid.md)."""
    from billing.prices.book import PriceBook
    from gateway.serving.admission import Meter, Usage

    prices = PriceBook(setup.db)
    await prices.add(MODEL, "1.000", "2.000")  # 1,000 and 2,000 nano-USD a token
    meter = Meter(setup.ledger, limiter=setup.limiter, prices=prices)
    await setup.limiter.credit(1, 1, 10**9)  # $1 of credit (a postpaid account's scope ignores it)
    who = Principal(key_id=7, account_id=1, is_admin=False, models=None, expires_at=None, revoked=False, prepaid=prepaid)
    usage = Usage(estimated=True)
    admission = await meter.admit(f"est-{prepaid}", who, MODEL, usage, tokens=12, cost=lambda price: price.cost_nanos(9, 3))
    assert admission.nanos == 9 * 1_000 + 3 * 2_000
    usage.prompt_tokens, usage.completion_tokens, usage.finish_reason = 17, 3, "stop"  # the upstream's exact prompt: 17
    assert admission.settle() is True
    await meter.drain()
    [row] = [r for r in setup.rows if r.request_id == f"est-{prepaid}" and r.status == "completed"]
    assert row.cost_nanos == (admission.nanos if prepaid else 17 * 1_000 + 3 * 2_000), row
    await setup.close()


async def test_a_row_keeps_the_instant_it_was_admitted_at_and_that_instants_price(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admitted at Oct 31 23:59:59.95 and finished in November (here: weeks later, the real clock):
    its provisional and its final row both say it was admitted at that instant (the row's unique key,
    and its hour, day and month), and it costs October's price, the one in force when it was admitted."""
    from datetime import datetime, timezone

    from billing.prices.book import PriceBook
    from gateway.serving import admission as admission_module

    admitted = datetime(2026, 10, 31, 23, 59, 59, 950_000, tzinfo=timezone.utc)
    prices = PriceBook(setup.db)
    october = await prices.add(MODEL, "1000.000", "1000.000", datetime(2026, 10, 1, tzinfo=timezone.utc), backdate=True)
    await prices.add(MODEL, "3000.000", "3000.000", datetime(2026, 11, 1, tzinfo=timezone.utc), backdate=True)
    service = CompletionService({MODEL: setup.engine}, setup.ledger, limiter=setup.limiter, prices=prices)
    monkeypatch.setattr(admission_module, "utcnow", lambda: admitted)
    journaled: list[Any] = []
    admitted_rows = setup.ledger.admitted

    def journal(record: UsageRecord, hold: Any = None) -> None:
        journaled.append(record)
        admitted_rows(record, hold)

    monkeypatch.setattr(setup.ledger, "admitted", journal)
    gen = setup.gen("late", principal())
    admission = await service.admit(gen)
    async for _ in service.metered(gen, admission):
        pass
    await service.drain()
    [provisional] = journaled
    [row] = setup.rows
    assert (row.status, row.admitted_at, provisional.admitted_at) == ("completed", admitted, admitted), (row, provisional)
    assert row.created_at > admitted  # finished later: its own clock
    tokens = row.prompt_tokens + row.completion_tokens
    assert (row.price_version_id, row.cost_nanos) == (october.id, tokens * 1000_000), row  # $1000 per million: 1,000,000 nano-USD a token
    await setup.close()


async def test_a_client_gone_is_not_billed_what_an_engine_deaf_to_the_cancel_goes_on_making(setup: Setup) -> None:
    """The client leaves after its first token, and the engine does not hear the cancel (it came before
    the engine had the request): the metered stream closes at the next output, which cancels it. The
    row says `cancelled` with the tokens made until then, not `completed` with all of them."""
    class Deaf(FakeEngine):
        def cancel(self, request_id: str) -> None:
            return None

    engine = ScheduledEngine(Deaf(MODEL), capacity=1, reserve=0, max_queue=1)
    service = CompletionService({MODEL: engine}, setup.ledger, limiter=setup.limiter)
    body = parse(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True})
    gen = service.prepare_chat(principal(), body, "deaf")
    admission = await service.admit(gen)
    seen = 0
    async for _ in service.metered(gen, admission):
        seen += 1
        gen.cancel()  # the client left
    await service.drain()
    [row] = setup.rows
    assert (seen, row.status, row.completion_tokens) == (1, "cancelled", 2), row
    await setup.close()


async def test_nothing_an_engine_yields_after_its_final_output_is_billed_or_sent(setup: Setup) -> None:
    """An engine that goes on after its final output (a wrapper's stray output, an upstream's extra
    chunk): the row and the client have the final output's counts and nothing after it."""
    from engines.base import FINISH_STOP, EngineOutput

    class Chatty(FakeEngine):
        async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
            prompt = len(request.prompt_token_ids or [])
            yield EngineOutput("Yes", [1], None, prompt, 1)
            yield EngineOutput("", [], FINISH_STOP, prompt, 1)
            yield EngineOutput(" and more", [2, 3, 4], None, prompt, 99)

    engine = ScheduledEngine(Chatty(MODEL), capacity=1, reserve=0, max_queue=1)
    service = CompletionService({MODEL: engine}, setup.ledger, limiter=setup.limiter)
    gen = service.prepare_chat(principal(), parse(ChatCompletionRequest, {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}), "chatty")
    admission = await service.admit(gen)
    sent = [(out.text, out.finish_reason) async for out in service.metered(gen, admission)]
    await service.drain()
    [row] = setup.rows
    assert sent == [("Yes", None), ("", "stop")]
    assert (row.status, row.completion_tokens) == ("completed", 1), row
    await setup.close()
