"""One background loop: a step run every `interval` seconds until it is stopped.

A failed round is handed to `on_error` (each caller logs in its own words) and the next round
runs as planned, so one outage never ends the loop. Cancellation (shutdown) ends it at once.
`wake` (an event) starts the next round before the interval is up: something to do has arrived.
Every loop keeps its pulse (`Pulse`: rounds run, failures, when the last one ended), so a test or
an operator can tell a loop that runs from one that died or hangs.

`Periodic` runs on the event loop; `PeriodicThread` is the same loop on a thread, for a step
that blocks (an fsync must not hold the event loop up).
Lives in billing/ because billing/ imports nothing of gateway/ or engines/, while both may use it
(it imports nothing of the product itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass
class Pulse:
    """What a loop has done so far. `last_round`: time.monotonic() when the last round ended
    (None: none yet); `last_error`: the last failed round's exception; `streak`: failed rounds
    since the last that went well."""

    rounds: int = 0
    failures: int = 0
    last_round: float | None = None
    last_error: Exception | None = None
    streak: int = 0

    def beat(self, error: Exception | None = None) -> None:
        self.rounds += 1
        self.last_round = time.monotonic()
        if error is None:
            self.streak = 0
        else:
            self.failures += 1
            self.streak += 1
            self.last_error = error

    def worth_saying(self, every: int = 60) -> bool:
        """Whether the failure just counted is worth a log line: the first of a run of failed rounds,
        then every `every`th, so a loop of a second logs an outage once a minute, not each round."""
        return self.streak == 1 or (self.streak > 0 and self.streak % every == 0)


async def every(interval: float, step: Callable[[], Awaitable[object]], *, on_error: Callable[[Exception], None],
                first: bool = False, wake: asyncio.Event | None = None, pulse: Pulse | None = None) -> None:
    """Runs `step` every `interval` seconds; `first`: once at the start too, before the first wait;
    `wake` set: the wait ends at once (the event is cleared as the round starts, so a wake during a
    round is not lost)."""
    pulse = pulse if pulse is not None else Pulse()
    if not first:
        await _wait(interval, wake)
    while True:
        if wake is not None:
            wake.clear()
        try:
            await step()
        except Exception as exc:  # CancelledError is not an Exception: shutdown still ends the loop
            pulse.beat(exc)
            on_error(exc)
        else:
            pulse.beat()
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # The cancel came during the step and the step turned it into an error or ate it (a
            # client's `asyncio.timeout` does, when the cancel meets its deadline): a cancel is
            # delivered once, so without this the loop would go on and stop() would wait forever.
            raise asyncio.CancelledError
        await _wait(interval, wake)


async def _wait(interval: float, wake: asyncio.Event | None) -> None:
    if wake is None:
        await asyncio.sleep(interval)
        return
    # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancel that meets the wake (stop()
    # sets one), and the loop would never end.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(interval):
            await wake.wait()


class Periodic:
    """`every` as a named task: `start()` (again: a no-op while it runs), `stop()` cancels it and
    waits for it to end; `alive` while the task runs, `pulse` what it has done."""

    def __init__(self, name: str, interval: float, step: Callable[[], Awaitable[object]], *,
                 on_error: Callable[[Exception], None], first: bool = False, wake: asyncio.Event | None = None) -> None:
        self.name = name
        self.pulse = Pulse()
        self._run = lambda: every(interval, step, on_error=on_error, first=first, wake=wake, pulse=self.pulse)
        self._task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class PeriodicThread:
    """`Periodic` on a daemon thread, for a blocking step. Without `wake`, a round every `interval`
    seconds; with it, a round once `wake` is set, `delay` seconds later (what arrives meanwhile
    shares that round: a group commit), and otherwise none (`interval` None). `stop()` ends the
    loop without another round and joins the thread."""

    def __init__(self, name: str, step: Callable[[], object], *, on_error: Callable[[Exception], None],
                 interval: float | None = None, wake: threading.Event | None = None, delay: float = 0.0) -> None:
        if interval is None and wake is None:
            raise ValueError("a loop needs an interval or a wake event")
        self.name = name
        self.pulse = Pulse()
        self._step = step
        self._on_error = on_error
        self._interval = interval
        self._wake = wake
        self._delay = delay
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._wake is not None:
            self._wake.set()  # the wait ends now; the loop sees the stop before any round
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    def _loop(self) -> None:
        while True:
            if self._wake is None:
                if self._stopping.wait(self._interval):
                    return
            else:
                woken = self._wake.wait(self._interval)
                if self._stopping.is_set():
                    return
                if woken and self._delay and self._stopping.wait(self._delay):
                    return
                self._wake.clear()
            try:
                self._step()
            except Exception as exc:
                self.pulse.beat(exc)
                self._on_error(exc)
            else:
                self.pulse.beat()
