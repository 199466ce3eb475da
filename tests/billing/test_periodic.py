"""The one background loop (billing/periodic.py): a failed round is reported and the next one runs;
`first` runs a round before the first wait; stop() ends the task."""

from __future__ import annotations

import asyncio

from billing.periodic import Periodic, every
from tests.conftest import until


async def test_a_failed_round_is_reported_and_the_loop_goes_on() -> None:
    rounds: list[int] = []
    errors: list[Exception] = []

    async def step() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 2:
            raise ValueError("the database is down")

    task = asyncio.create_task(every(0.01, step, on_error=errors.append))
    await until(lambda: len(rounds) >= 4, "rounds after the failed one")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    assert [str(e) for e in errors] == ["the database is down"]


async def test_first_runs_a_round_before_waiting_and_stop_ends_the_task() -> None:
    rounds: list[float] = []

    async def step() -> None:
        rounds.append(asyncio.get_running_loop().time())

    loop = Periodic("test-periodic", 3600, step, on_error=lambda exc: None, first=True)
    loop.start()
    loop.start()  # once only
    await until(lambda: rounds, "the first round, at the start")
    tasks = [t for t in asyncio.all_tasks() if t.get_name() == "test-periodic"]
    assert len(tasks) == 1
    await loop.stop()
    assert tasks[0].cancelled() and rounds == rounds[:1]

    started = asyncio.get_running_loop().time()
    late = Periodic("test-periodic-late", 0.2, step, on_error=lambda exc: None)
    late.start()
    await until(lambda: len(rounds) == 2, "the late loop's first round")
    await late.stop()
    assert rounds[1] - started >= 0.19  # without first: the first round comes after one interval
