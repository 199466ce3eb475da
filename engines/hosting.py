"""What an engine host is made of, shared by the hf engine process (engines/backends/hf_process.py)
and the trtllm host (engines/backends/trtllm_host.py): the thread that reads a connection's
commands onto the event loop, the thread that accepts gateway workers' connections, and the
host's queue built from the supervisor's scheduler settings."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


def read_commands(conn: Any, loop: asyncio.AbstractEventLoop, handlers: dict[str, Any], end: Callable[[], Any]) -> None:
    """A command reader thread: what arrived together is handed to the loop in one call (a burst
    of requests costs one wake-up of the loop, not one each). `end` runs on the loop when the
    connection closes or says stop."""
    running = True
    while running:
        try:
            messages = [conn.recv()]
            while conn.poll(0):
                messages.append(conn.recv())
        except (EOFError, OSError):
            break  # the other side closed the pipe or died
        if any(m[0] == "stop" for m in messages):
            running = False
            messages = [m for m in messages if m[0] != "stop"]
        loop.call_soon_threadsafe(_run_commands, handlers, messages)
    loop.call_soon_threadsafe(end)


def _run_commands(handlers: dict[str, Any], messages: list[tuple[Any, ...]]) -> None:
    for message in messages:
        handlers[message[0]](*message[1:])


def reader(conn: Any, loop: asyncio.AbstractEventLoop, handlers: dict[str, Any], end: Callable[[], Any]) -> None:
    """Starts read_commands on a daemon thread of its own."""
    threading.Thread(target=read_commands, args=(conn, loop, handlers, end), daemon=True).start()


def accept_workers(listener: Any, loop: asyncio.AbstractEventLoop, hello: tuple[Any, ...],
                   handlers_for: Callable[[int, Any], dict[str, Any]], drop: Callable[[int], Any], name: str) -> None:
    """Accepts gateway workers on `listener` (until it is closed) on a thread named `name`: each is
    numbered, sent `hello`, and read on a thread of its own; `drop(k)` runs when worker k's
    connection ends (its requests are to be cancelled)."""

    def accept() -> None:
        worker = 0
        while True:
            try:
                conn = listener.accept()
            except OSError:
                return
            worker += 1
            conn.send(hello)
            reader(conn, loop, handlers_for(worker, conn), lambda k=worker: drop(k))

    threading.Thread(target=accept, name=name, daemon=True).start()


def host_queue(model_id: str, max_batch_size: int, scheduler: dict[str, Any] | None) -> Any:
    """The host's HostQueue from the supervisor's scheduler settings (`classes` as (name, max
    wait) pairs, `reserve`, `max_queue`), or None when the scheduler is off."""
    if not scheduler:
        return None
    from engines.wrappers.scheduler import HostQueue, PriorityClass

    classes = tuple(PriorityClass(name, wait) for name, wait in scheduler["classes"])
    return HostQueue(model_id, max_batch_size, reserve=scheduler["reserve"], classes=classes, max_queue=scheduler["max_queue"])
