"""The one background loop (billing/periodic.py): a failed round is reported and the next one runs;
`first` runs a round before the first wait; `wake` starts a round early; stop() ends the task;
the pulse says what the loop has done. The same for its thread form."""

from __future__ import annotations

import asyncio
import threading
import time

from billing.periodic import Periodic, PeriodicThread, every
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


async def test_the_pulse_reports_a_failed_round_and_the_loop_stays_alive() -> None:
    rounds: list[int] = []

    async def step() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise ConnectionError("redis is down")

    loop = Periodic("test-pulse", 0.01, step, on_error=lambda exc: None, first=True)
    assert not loop.alive and loop.pulse.last_round is None
    loop.start()
    await until(lambda: loop.pulse.rounds >= 3, "rounds after the failed one")
    assert loop.alive
    assert loop.pulse.failures == 1 and isinstance(loop.pulse.last_error, ConnectionError)
    assert loop.pulse.last_round is not None and time.monotonic() - loop.pulse.last_round < 5
    await loop.stop()
    assert not loop.alive


async def test_wake_starts_a_round_before_the_interval_is_up() -> None:
    rounds: list[int] = []
    wake = asyncio.Event()

    async def step() -> None:
        rounds.append(len(rounds))

    loop = Periodic("test-wake", 3600, step, on_error=lambda exc: None, first=True, wake=wake)
    loop.start()
    await until(lambda: len(rounds) == 1, "the first round")
    wake.set()
    await until(lambda: len(rounds) == 2, "the round the wake started")
    assert not wake.is_set()  # cleared as that round started
    await loop.stop()


def _until(predicate: object, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not so after {timeout}s"
        time.sleep(0.01)


def test_the_thread_form_goes_on_after_a_failed_round_and_groups_what_a_wake_brings() -> None:
    wake = threading.Event()
    rounds: list[float] = []
    errors: list[Exception] = []

    def step() -> None:
        rounds.append(time.monotonic())
        if len(rounds) == 1:
            raise OSError("disk full")

    loop = PeriodicThread("test-thread", step, on_error=errors.append, wake=wake, delay=0.05)
    loop.start()
    assert loop.alive and loop.pulse.rounds == 0  # no wake, no round
    woken = time.monotonic()
    wake.set()
    _until(lambda: loop.pulse.rounds == 1, "the round the first wake started")
    assert rounds[0] - woken >= 0.045  # after the delay: what arrives meanwhile shares the round
    assert [str(e) for e in errors] == ["disk full"] and loop.pulse.failures == 1
    wake.set()
    _until(lambda: loop.pulse.rounds == 2, "the round after the failed one")
    assert loop.alive and loop.pulse.failures == 1
    done = loop.pulse.rounds
    loop.stop()
    assert not loop.alive and loop.pulse.rounds == done  # stop runs no further round


def test_the_thread_form_runs_every_interval_without_a_wake() -> None:
    loop = PeriodicThread("test-thread-interval", lambda: None, on_error=lambda exc: None, interval=0.01)
    loop.start()
    _until(lambda: loop.pulse.rounds >= 3, "rounds each interval")
    loop.stop()
    assert not loop.alive


async def test_stop_ends_the_loop_although_a_wake_comes_with_it() -> None:
    wake = asyncio.Event()
    rounds: list[int] = []

    async def step() -> None:
        rounds.append(len(rounds))

    loop = Periodic("test-wake-stop", 3600, step, on_error=lambda exc: None, first=True, wake=wake)
    loop.start()
    await until(lambda: rounds, "the first round")
    wake.set()  # what the batch runner's stop() does before stopping its loop
    stopping = asyncio.ensure_future(loop.stop())
    done, _ = await asyncio.wait({stopping}, timeout=5)
    assert done, "stop() did not end the loop: the cancel was lost"
    assert not loop.alive


async def test_stop_ends_the_loop_although_the_step_turns_the_cancel_into_an_error() -> None:
    # What a Redis client's asyncio.timeout does when the cancel meets its deadline: the step raises
    # an ordinary error instead of CancelledError. stop() must still end the loop.
    entered = asyncio.Event()
    swallowed: list[bool] = []

    async def step() -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if swallowed:  # only the first cancel: the test's own clean-up still ends the loop
                raise
            swallowed.append(True)
            raise RuntimeError("timed out") from None

    loop = Periodic("swallows", 0.01, step, on_error=lambda exc: None, first=True)
    loop.start()
    await entered.wait()
    stopping = asyncio.ensure_future(loop.stop())  # a task of its own: a stop that hangs fails here, not the run
    done, _ = await asyncio.wait({stopping}, timeout=5)
    assert done, "stop() did not end a loop whose step turned the cancel into an error"
    assert not loop.alive


async def test_an_outage_is_worth_a_log_line_once_then_every_60th_round() -> None:
    """A loop of a second (the limits recheck, the batch runner) logs a database outage when it
    begins and once a minute after, not every round; a round that goes well ends the run."""
    outage = {"on": True}
    said: list[int] = []

    async def step() -> None:
        if outage["on"]:
            raise ConnectionError("the database is down")

    loop = Periodic("test-outage", 0.001, step, on_error=lambda exc: said.append(loop.pulse.streak) if loop.pulse.worth_saying() else None)
    loop.start()
    await until(lambda: loop.pulse.streak >= 130, "130 failed rounds")
    outage["on"] = False
    await until(lambda: loop.pulse.streak == 0, "a round that went well")
    outage["on"] = True
    await until(lambda: loop.pulse.streak >= 1 and len(said) >= 4, "the next outage")
    await loop.stop()
    assert said[:4] == [1, 60, 120, 1], said
