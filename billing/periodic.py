"""One background loop: a step run every `interval` seconds until the task is cancelled.

A failed round is handed to `on_error` (each caller logs in its own words) and the next round
runs as planned, so one outage never ends the loop. Cancellation (shutdown) ends it at once.
Lives in billing/ because billing/ imports nothing of gateway/, while gateway/ may use it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


async def every(interval: float, step: Callable[[], Awaitable[object]], *, on_error: Callable[[Exception], None],
                first: bool = False) -> None:
    """Runs `step` every `interval` seconds; `first`: once at the start too, before the first wait."""
    if not first:
        await asyncio.sleep(interval)
    while True:
        try:
            await step()
        except Exception as exc:  # CancelledError is not an Exception: shutdown still ends the loop
            on_error(exc)
        await asyncio.sleep(interval)


class Periodic:
    """`every` as a named task: `start()` (again: a no-op while it runs), `stop()` cancels it and
    waits for it to end."""

    def __init__(self, name: str, interval: float, step: Callable[[], Awaitable[object]], *,
                 on_error: Callable[[Exception], None], first: bool = False) -> None:
        self.name = name
        self._run = lambda: every(interval, step, on_error=on_error, first=first)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
