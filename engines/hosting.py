"""What an engine host is made of, shared by the hf engine process (engines/backends/hf_process.py)
and the trtllm host (engines/backends/trtllm_host.py): the thread that reads a connection's
commands onto the event loop, the thread that accepts gateway workers' connections, the thread
that sends to each worker, and the host's queue built from the supervisor's scheduler settings."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tollgate.engine")

# Messages a worker may fall behind before it is cut off (at one message per engine step, ~10 s
# of a fast engine's steps); its requests are then cancelled as if it had died.
MAX_BEHIND = 10_000


def freeze_loaded() -> None:
    """In an engine process once its model has loaded: what is alive now (the model's modules, the
    tokenizer, the imported libraries) is moved out of the cyclic collector's scans, as the
    gateway's processes do (gateway/wiring.py:freeze_heap). Each step allocates a tuple and a list
    per stream; left in the oldest generation, that heap was scanned by every full collection the
    steps' garbage triggered. With this and per-worker parts, the synthetic engine host at 256
    streams under two workers went from 0.70-0.81 to 0.60-0.65 of a core busy while relaying more
    (docs/performance.md, 2026-12-06)."""
    gc.collect()
    gc.freeze()


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


class WorkerSender:
    """Sends to one gateway worker from a thread of its own. The engine's loop only queues, so a
    worker that reads slowly (busy, paused, swapped out) holds up neither the engine's steps nor
    the other workers' streams. What queued up while a send was under way leaves in one message:
    consecutive output lists are joined (a worker's reader takes a list of items per message), any
    other message keeps its place. A worker MAX_BEHIND messages behind is cut off: its connection
    is shut down, so its command reader ends and the host cancels its requests."""

    def __init__(self, conn: Any, name: str) -> None:
        self.conn = conn
        self._pending: deque[Any] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self.cut_off = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def send(self, message: Any) -> None:
        with self._wake:
            if self._closed:
                return
            if len(self._pending) >= MAX_BEHIND:
                self._cut_off()
                return
            self._pending.append(message)
            if len(self._pending) == 1:
                self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._pending.clear()
            self._wake.notify()

    def _cut_off(self) -> None:  # under the lock
        log.warning("an engine host's worker fell %d messages behind; its requests are cancelled", MAX_BEHIND)
        self._closed = self.cut_off = True
        self._pending.clear()
        self._wake.notify()
        try:  # a duplicate of the descriptor, so the connection's own stays the sender's to close
            with socket.socket(fileno=os.dup(self.conn.fileno())) as dup:
                dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                batch = list(self._pending)
                self._pending.clear()
            for message in joined(batch):
                try:
                    self.conn.send(message)
                except (OSError, EOFError, ValueError):  # the worker is gone; its reader's end cleans up
                    self.close()
                    return


def joined(messages: list[Any]) -> list[Any]:
    """Consecutive list messages as one list, in order; other messages as they are."""
    out: list[Any] = []
    for message in messages:
        if isinstance(message, list) and out and isinstance(out[-1], list):
            out[-1] = out[-1] + message
        else:
            out.append(message)
    return out
