"""Graceful drain on SIGTERM (docs/reliability.md, deploy/README.md).

    SIGTERM  -> /readyz answers 503 `draining` at once (the load balancer takes the pod out)
             -> every new request on this process: 503 with Retry-After, in its API's error shape
             -> running generations go on for up to TOLLGATE_DRAIN_SECONDS
             -> those still running then are cut: each stream ends with an error event, its row is
                written (`interrupted`) and its quota hold settled with what it generated
             -> the ledger is flushed and the server stops (exit 0)

The listening socket stays open while draining: a request that reaches the process after the
signal (endpoints take a moment to update) gets a clear 503 to retry elsewhere, never a refused
connection. A second SIGTERM, or SIGINT, cuts what still runs at once and stops.

With `--workers N` (uvicorn's process manager) the master forwards its SIGTERM to every worker and
waits for them; each worker drains exactly as a single process does (`install_in_worker`), then
exits 0, and so does the master.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.api.anthropic.errors import in_the_apis_shape
from gateway.http.errors import ServiceUnavailable

log = logging.getLogger("tollgate.drain")
EXEMPT_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # probes and scrapes still answer while draining
CUT_WAIT_SECONDS = 10.0  # how long cut generations get to write their rows before the server stops anyway


def draining_error(retry_after: int = 1) -> ServiceUnavailable:
    return ServiceUnavailable(
        "This server is shutting down; retry the request (another instance will take it).",
        code="server_draining", headers={"Retry-After": str(retry_after), "Connection": "close"},
    )


async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to a request that arrives while draining, in the shape of the API it called."""
    await in_the_apis_shape(draining_error(), scope)(scope, receive, send)


class Drain:
    """One per server process: `begin()` from the signal handler's loop callback; `stop_server` is
    what makes uvicorn shut down (its lifespan then flushes the ledger and closes the stores)."""

    def __init__(self, app: Any, seconds: float, stop_server: Callable[[], None]) -> None:
        self.app = app
        self.seconds = seconds
        self.stop_server = stop_server
        self.task: asyncio.Task[None] | None = None
        self.hurried = False

    @property
    def active(self) -> bool:
        return self.task is not None

    @property
    def serving(self) -> bool:
        """Whether the app has started (its services exist): before, a signal stops it as uvicorn does."""
        return self.app.state.service is not None

    def begin(self) -> None:
        if self.task is not None:
            return
        self.app.draining = True
        self.task = asyncio.get_running_loop().create_task(self._run(), name="drain")

    def now(self) -> None:
        """A second SIGTERM, or SIGINT: the running generations are cut at once (rows written as
        interrupted, holds settled, as at the deadline), then the server stops as after a drain."""
        if self.hurried:
            return
        self.hurried = True
        self.app.draining = True
        log.warning("stopping now: cut %d generations still running", self.app.state.service.cut_live())
        self.begin()  # the drain (begun already, or now) finds nothing left to wait for

    async def _run(self) -> None:
        service = self.app.state.service
        started = time.monotonic()
        running = service.live_count()
        log.warning("SIGTERM: draining; readyz is 503, new requests are refused; %d generations running, "
                    "waiting up to %gs for them", running, self.seconds)
        try:
            finished = await service.wait_idle(self.seconds)
            if not finished:
                cut = service.cut_live()
                log.warning("drain: %gs passed; cut %d generations still running (rows written as interrupted, holds settled)",
                            self.seconds, cut)
                if not await service.wait_idle(CUT_WAIT_SECONDS):
                    log.error("drain: %d generations did not end %gs after being cut", service.live_count(), CUT_WAIT_SECONDS)
            await service.drain()  # quota settlements in the background
            await self.app.state.ledger.flush(timeout=CUT_WAIT_SECONDS)
            log.warning("drain: done in %.1fs; stopping", time.monotonic() - started)
        except Exception:
            log.exception("drain failed; stopping")
        finally:
            self.stop_server()


def is_refused(scope: Scope) -> bool:
    """Whether a request that arrives while draining is refused (probes and scrapes still answer)."""
    return scope["type"] == "http" and scope["path"] not in EXEMPT_PATHS



class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM drains instead of closing the listener at
    once, and another SIGTERM, or SIGINT, cuts what still runs at once (rows `interrupted`, holds
    settled) and stops: uvicorn's own stop waited for every open stream to end by itself."""

    drain: Drain | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        drain = self.drain
        if drain is not None and drain.serving and not self.should_exit and sig in (signal.SIGTERM, signal.SIGINT):
            # The handler runs on the loop's thread between two steps: the drain starts on the loop.
            if sig == signal.SIGTERM and not drain.active:
                asyncio.get_running_loop().call_soon_threadsafe(drain.begin)
                return
            if not drain.hurried:  # another SIGTERM, or SIGINT: what runs is cut now, then the stop
                asyncio.get_running_loop().call_soon_threadsafe(drain.now)
                return
        super().handle_exit(sig, frame)  # a third signal: uvicorn's own (SIGINT then forces the exit)


def install_in_worker(app: Any, seconds: float) -> Drain | None:
    """Drain on SIGTERM in a worker of uvicorn's process manager, where the server is uvicorn's own
    (not `DrainingServer`). Called while the worker loads its app: uvicorn's server has installed its
    `handle_exit` for SIGTERM by then, so the handler found is that server's bound method. Ours
    replaces it: the first SIGTERM begins the drain, which stops that server when done; another
    SIGTERM cuts what still runs and stops (SIGINT is left to uvicorn). None (uvicorn's plain stop) when the handler
    is not a uvicorn server's, logged: a uvicorn that loads apps elsewhere."""
    previous = signal.getsignal(signal.SIGTERM)
    server = getattr(previous, "__self__", None)
    if not isinstance(server, uvicorn.Server) or not callable(previous):
        log.warning("worker: SIGTERM is not uvicorn's server handler (%r); it will stop without draining", previous)
        return None
    loop = asyncio.get_running_loop()

    def stop() -> None:
        server.should_exit = True

    drain = Drain(app, seconds, stop)

    def on_sigterm(sig: int, frame: Any) -> None:
        if not drain.serving:
            previous(sig, frame)
            return
        if not server.should_exit and not drain.active:
            loop.call_soon_threadsafe(drain.begin)
            return
        if not server.should_exit and not drain.hurried:  # another SIGTERM: cut now, then stop
            loop.call_soon_threadsafe(drain.now)
            return
        previous(sig, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
    app.state.stop_server = stop
    return drain
