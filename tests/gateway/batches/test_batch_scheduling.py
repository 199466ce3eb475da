"""A running batch takes only the capacity interactive traffic leaves: its lines queue in the
scheduler's lowest class, and an interactive request goes into the engine ahead of every waiting
line, its TTFT within the scheduler's fairness bound (the one tests/gateway/serving/test_scheduling.py
holds a batch-class account to)."""

from __future__ import annotations

import io
import statistics
from collections.abc import Iterator
from typing import Any

import pytest

from engines.wrappers.scheduler import QueueEvent
from tests.conftest import Gateway, run_coro, start_gateway, stop_server
from tests.gateway.batches.test_batches import chat_lines, ended, openai_client
from tests.gateway.serving.test_scheduling import (
    body, client_of, scheduler_of, sequential_ttfts, steps_of, timed_stream, wait_for, warm_up, xfail_if_unsteady,
)

pytestmark = pytest.mark.solo  # queue waits and TTFTs beside a batch compared against bounds: alone on the machine (tests/conftest.py)


@pytest.fixture(scope="module")
def busy_gateway(engine: Any, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Capacity 4 with one slot reserved for interactive work; the runner keeps 8 lines in flight,
    so that lines wait in the scheduler's queue."""
    run_coro(warm_up(engine, 4))
    server, gw = start_gateway(
        fresh_pg_database(migrated=True), engine, tmp_path_factory.mktemp("batch-sched"),
        scheduler={"capacity": 4, "reserve": 1, "classes": "interactive:600,batch:3600"},
        batches={"poll_seconds": 0.2, "concurrency": 8},
    )
    try:
        yield gw
    finally:
        stop_server(server)


async def test_an_interactive_key_goes_ahead_of_a_running_batch(busy_gateway: Gateway) -> None:
    gw, sched = busy_gateway, scheduler_of(busy_gateway)
    events: list[QueueEvent] = []
    sched.listeners.append(lambda e: events.append(e) if e.kind == "dispatched" else None)
    owner, y = await gw.new_key(), await gw.new_key()
    client = openai_client(gw, owner["key"])
    async with client_of(gw) as cy:
        await sequential_ttfts(cy, y, 1, 6)
        idle, _, _ = await sequential_ttfts(cy, y, 3, 6)
        uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(10, max_tokens=16))), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        # Steady state, as test_scheduling measures it: a line has finished and the next went in (not the
        # first wave, when three lines' prefills and the runner's claims share the two cores at once).
        await wait_for(lambda: sum(e.request_id.startswith(batch.id) for e in events) >= 4 and sched.snapshot()["waiting"]["batch"] >= 3,
                       120, "batch lines running and waiting in the scheduler")
        loaded, waiting = [], []
        for i in range(3):
            waiting.append(sched.snapshot()["waiting"]["batch"])
            loaded.append(await timed_stream(cy, y, body(6, f"Name fruit number {i}.")))
    assert (await ended(client, batch.id)).status == "completed"
    lines = [e for e in events if e.request_id.startswith(batch.id)]
    assert len(lines) == 10 and {e.priority for e in lines} == {"batch"}  # every line in the lowest class
    waits = {e.request_id: e.wait_s for e in events}
    idle_step, loaded_step = steps_of(idle), steps_of(loaded)
    idle_steps = statistics.median(r.ttft for r in idle) / idle_step
    delays = [r.ttft / loaded_step - idle_steps for r in loaded]
    print(f"\ninteractive TTFT (ms): idle {[round(r.ttft * 1000) for r in idle]}, beside the batch {[round(r.ttft * 1000) for r in loaded]}; "
          f"delay in engine steps {[round(d, 1) for d in delays]} with {waiting} lines waiting; "
          f"line queue waits (s) {sorted(round(e.wait_s, 2) for e in lines)[-3:]}")
    for run, behind in zip(loaded, waiting):
        assert run.status == 200 and behind >= 1
        assert waits[run.request_id] < 0.01  # into the engine at once, ahead of every waiting line
    xfail_if_unsteady("batch lines", [[r.ttft for r in idle]], 0.0)
    for behind, delay in zip(waiting, delays):
        assert delay <= behind, f"delayed {delay:.1f} engine steps behind {behind} waiting batch lines"
