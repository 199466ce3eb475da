"""The `hf` engine in a process of its own, the way vLLM runs its engine core apart from its API server.

In one process, the batching manager's thread and the gateway's event loop share one GIL: every
token the loop relays (an SSE chunk per stream per step) delays the manager's next step, and the
manager's Python work delays the loop's chunks. On a GPU that cost the engine a third to two thirds
of its tokens/s and added seconds to the first token (docs/gpu.md). Here the model and the
manager run in a child process that does nothing else: per step it sends each stream's new token
ids to the gateway in one pipe message; detokenization, stop strings and everything per request
stay in the gateway process, which owns the tokenizer too.

    gateway process                                   engine process
    HFProcessEngine.stream()  --("add", ...)-->       HFEngine.submit() -> batching manager
    per-request queues  <--[(rid, ids, done, ...)]--  one message per step (all streams)
    cancel / stop-string end --("cancel", rid)-->     manager.cancel_request()

The child exits when the pipe closes (the gateway stopped or died). If the child dies, every
stream in flight ends with an error, the engine stops being ready and the reason is logged.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engines.base import EngineError, EngineOutput, EngineOverloadedError, EngineRequest
from engines.backends.hf import HFEngine, drain
from engines.decoding.text import TokenProgress
from engines.hosting import WorkerSender, accept_workers, freeze_loaded, host_queue, reader

log = logging.getLogger("tollgate.engines.hf_process")

START_TIMEOUT_S = 1800.0  # loading, converting a GGUF once and warming up CUDA graphs
STOP_TIMEOUT_S = 15.0
# A burst after an idle spell: the engine process holds its requests until none has come for
# GATHER_QUIET_S (at most gather_ms in all) before the first step, so that step's prefill is full.
# Without it the first step starts with the first request or two and the rest of the burst waits a
# whole step behind it (docs/gpu.md). A lone request waits GATHER_QUIET_S at most.
GATHER_MS = 20.0
GATHER_QUIET_S = 0.002
_CANCELLED = object()


class _Refused:
    """Queued to a stream the engine host's queue turned away (engines/wrappers/scheduler.py:HostQueue)."""

    def __init__(self, reason: str, retry_after: int) -> None:
        self.reason, self.retry_after = reason, retry_after


class _Dead:
    """Queued to every live stream when the engine process is gone."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


@dataclass
class _Live:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]


class HFProcessEngine(HFEngine):
    """`HFEngine` whose model runs in a child process (TOLLGATE_ENGINE_PROCESS; on by default on CUDA)."""

    child_module = "engines.backends.hf_process"  # what the child runs: `python -m <it> FD`, speaking this module's messages

    def __init__(self, *, model_id: str, gather_ms: float = GATHER_MS, **params: Any) -> None:
        super().__init__(model_id=model_id, **params)
        self._params = params
        if gather_ms < 0:
            raise ValueError(f"gather_ms must be 0 or more, got {gather_ms}")
        self._gather_ms = float(gather_ms)
        self._process: Any = None
        self._conn: Any = None
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._live_streams: dict[str, _Live] = {}
        self._stopping = False
        self._asked: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[int]]] = {}
        self._asks = 0
        self.exited: str | None = None  # why the engine process is gone, once it is
        # Several gateway workers over one engine (`serve --workers N`, gateway/serving/engine_hosts.py):
        # `host`, in the process that starts it, makes the child an engine host listening on a socket
        # with the scheduler's queue; `connect_to`, in each worker, is that socket (no child of its own).
        self.host: dict[str, Any] | None = None
        self.connect_to: str | None = None

    # lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._ready:
            return
        if self.connect_to is not None:
            await self._connect()
            return
        # A fresh interpreter (`python -m engines.backends.hf_process FD`): no CUDA state or threads inherited,
        # and unlike multiprocessing's spawn it does not re-run the parent's main module.
        ours, theirs = socket.socketpair()
        try:
            # Run from this code's own tree: `-m` puts the working directory first on sys.path, so a child
            # started elsewhere could import another copy of the project than the gateway's (bench/ runs old revisions).
            process = subprocess.Popen([sys.executable, "-m", self.child_module, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                       cwd=str(Path(__file__).resolve().parents[2]))
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        self._process, self._conn = process, conn
        conn.send((self.model_id, self._params, self._gather_ms, self.host))
        try:
            hello = await asyncio.to_thread(_first_message, conn, process)
        except BaseException:
            self._kill()
            raise
        if hello[0] != "ready":
            self._kill()
            raise EngineError(hello[1])
        self._hello(hello)
        log.info("model %s ready in engine process %d", self.model_id, process.pid)

    async def _connect(self) -> None:
        """A worker's side of a shared engine: the engine host's socket instead of a child."""
        from multiprocessing.connection import Client

        conn = await asyncio.to_thread(Client, self.connect_to, "AF_UNIX")
        self._conn = conn
        hello = await asyncio.to_thread(_first_message, conn, None)
        if hello[0] != "ready":
            conn.close()
            raise EngineError(hello[1])
        self._hello(hello)
        log.info("model %s ready in the shared engine host at %s", self.model_id, self.connect_to)

    def _hello(self, hello: tuple[Any, ...]) -> None:
        info, self._tokenizer = hello[1], hello[2]
        self.context_length = int(info["context_length"])
        self.vocab_size = info["vocab_size"]
        self._eos_ids = set(info["eos_ids"])
        self.guided = bool(info.get("guided"))
        self._reader = threading.Thread(target=self._read_outputs, name=f"tollgate-engine-reader-{self.model_id}", daemon=True)
        self._reader.start()
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        if self.connect_to is not None and self._conn is not None:
            self._stopping = True
            self._conn.close()  # the engine host cancels what this worker still had running
            if self._reader is not None:
                await asyncio.to_thread(self._reader.join, STOP_TIMEOUT_S)
            return
        if self._process is None:
            return
        self._stopping = True
        try:
            self._send(("stop",))
        except (OSError, EOFError):
            pass
        await asyncio.to_thread(_wait, self._process, STOP_TIMEOUT_S)
        self._kill()
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, STOP_TIMEOUT_S)

    def _kill(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            _wait(process, 5.0)
        if self._conn is not None:
            self._conn.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:  # streams on several event loops (threads) share the pipe
            self._conn.send(message)

    def _read_outputs(self) -> None:
        """The reader thread: one pipe message per engine step, handed to each stream's loop in one call."""
        conn = self._conn
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(batch, tuple) and batch[0] == "refused":  # ("refused", rid, why, retry_after): the host's queue
                live = self._live_streams.get(batch[1])
                if live is not None and not live.loop.is_closed():
                    live.loop.call_soon_threadsafe(live.queue.put_nowait, _Refused(batch[2], batch[3]))
                continue
            if isinstance(batch, tuple):  # ("held", ask, n): the answer to held_in_engine()
                loop, answer = self._asked.pop(batch[1])
                loop.call_soon_threadsafe(lambda a=answer, n=batch[2]: a.done() or a.set_result(n))
                continue
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
            for item in batch:
                live = self._live_streams.get(item[0])
                if live is not None:
                    by_loop.setdefault(live.loop, []).append((live.queue, item))
            for loop, items in by_loop.items():
                if not loop.is_closed():
                    loop.call_soon_threadsafe(_put_all, items)
        self._ready = False
        if self.connect_to is not None:
            self.exited = "the shared engine host closed its connection"
        else:
            code = _wait(self._process, 5.0) if self._process is not None else None
            self.exited = f"the engine process exited (exit code {code})"
        if not self._stopping:
            log.error("model %s: %s; %d streams in flight end with an error", self.model_id, self.exited, len(self._live_streams))
        dead = _Dead(self.exited)
        for live in list(self._live_streams.values()):
            if not live.loop.is_closed():
                live.loop.call_soon_threadsafe(live.queue.put_nowait, dead)

    # capacity ---------------------------------------------------------------------------------
    def has_capacity(self) -> bool:
        return len(self._live_streams) < self.capacity

    def slots(self) -> int | None:
        # Shared by several workers, the engine host's queue lets requests into the batch: a worker's own
        # scheduler passes them on (its classes and reserve apply to the engine as a whole only there).
        return None if self.connect_to is not None else self._max_batch_size

    def requests_in_flight(self) -> int:
        return len(self._live_streams)

    # generation -------------------------------------------------------------------------------
    async def _generate(self, request: EngineRequest, prompt_ids: list[int], grammar: str | None) -> AsyncIterator[EngineOutput]:
        if not self._ready:
            raise EngineError(self.exited or "engine is not running")
        if not self.has_capacity():
            raise EngineOverloadedError("engine queue is full")
        rid = request.request_id
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._live_streams[rid] = _Live(asyncio.get_running_loop(), queue)
        sampling = request.sampling
        engine_done = False
        try:
            self._send(("add", rid, prompt_ids, request.max_tokens, sampling.temperature, sampling.top_p, grammar, request.account_id, request.priority))
        except (OSError, EOFError):
            self._live_streams.pop(rid, None)
            raise EngineError(self.exited or "the engine process is gone") from None
        progress = TokenProgress(self._tokenizer, request, len(prompt_ids), self._eos_ids)
        queue_ms: float | None = None
        try:
            while True:
                batch = await drain(queue)  # what arrived since the last turn leaves as one output
                new_ids: list[int] = []
                error: str | None = None
                for item in batch:
                    if item is _CANCELLED:
                        yield progress.cancelled(queue_ms)
                        return
                    if isinstance(item, _Refused):
                        engine_done = True
                        raise EngineOverloadedError(item.reason, retry_after=item.retry_after)
                    if isinstance(item, _Dead):
                        engine_done = True
                        yield progress.advance(new_ids, True, item.reason, queue_ms)  # type: ignore[misc]
                        return
                    _rid, ids, done, item_error, item_queue_ms = item
                    new_ids += ids
                    if queue_ms is None:
                        queue_ms = item_queue_ms
                    if done:
                        engine_done, error = True, item_error
                # Decoded here, once for whatever arrived since the last turn: when the loop falls behind, several
                # steps cost one decode and one event (decoding each step in the reader thread cost more: docs/performance.md).
                out = progress.advance(new_ids, engine_done, error, queue_ms)
                if out is not None:
                    yield out
                    if out.finished:
                        return
        finally:
            self._live_streams.pop(rid, None)
            if not engine_done and self._ready:  # the client left, or a stop string ended it first
                try:
                    self._send(("cancel", rid))
                except (OSError, EOFError):
                    pass

    async def held_in_engine(self) -> int:
        """Requests the engine process holds once it has handled every command sent before this call
        (commands run in order): a barrier for checks that a cancel reached the engine."""
        loop = asyncio.get_running_loop()
        self._asks += 1
        answer: asyncio.Future[int] = loop.create_future()
        self._asked[self._asks] = (loop, answer)
        self._send(("held", self._asks))
        return await answer

    def _cancel_stream(self, request_id: str) -> None:
        live = self._live_streams.get(request_id)
        if live is not None:
            live.queue.put_nowait(_CANCELLED)


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _wait(process: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _first_message(conn: Any, process: Any) -> tuple[Any, ...]:
    """The child's hello: ("ready", info, tokenizer) or ("failed", reason)."""
    waited = 0.0
    while not conn.poll(1.0):
        waited += 1.0
        if process is not None and process.poll() is not None:
            return ("failed", f"the engine process exited while loading (exit code {process.returncode})")
        if waited >= START_TIMEOUT_S:
            return ("failed", f"the engine process did not load within {START_TIMEOUT_S:.0f}s")
    try:
        return conn.recv()  # type: ignore[no-any-return]
    except (EOFError, OSError):
        if process is None:
            return ("failed", "the shared engine host closed the connection")
        return ("failed", f"the engine process exited while loading (exit code {_wait(process, 5.0)})")


# the engine process ---------------------------------------------------------------------------
def engine_main(fd: int, make: Any = HFEngine) -> None:
    """Entry point of the child process: the pipe's end is file descriptor `fd`; `make` builds the
    engine (engines/backends/synthetic.py gives its own)."""
    conn = Connection(fd)
    model_id, params, gather_ms, *rest = conn.recv()
    host = rest[0] if rest else None  # an engine host's settings (absent from a gateway before engine hosts)
    # The batching thread holds the GIL most of the time; the threads that take requests in and send
    # tokens out wait for it up to the switch interval each time (5 ms by default, a visible share of
    # a decode step). They run rarely and briefly, so a shorter interval costs the batching thread little.
    sys.setswitchinterval(0.001)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(conn, make(model_id=model_id, **params), gather_ms, host))


async def _serve(conn: Any, engine: HFEngine, gather_ms: float, host: dict[str, Any] | None = None) -> None:
    try:
        await engine.start()
    except BaseException as exc:  # the gateway reports it; nothing else would
        conn.send(("failed", f"model {engine.model_id!r} failed to load: {type(exc).__name__}: {exc}"))
        return
    freeze_loaded()
    info = {"context_length": engine.context_length, "vocab_size": engine.vocab_size, "eos_ids": sorted(engine._eos_ids), "guided": engine.guided}
    conn.send(("ready", info, engine.tokenizer))
    loop = asyncio.get_running_loop()
    relay = _StepRelay(conn, loop, engine, gather_ms / 1000.0, step_tokens=engine._max_batch_tokens, step_requests=engine._max_batch_size)
    stopped = loop.create_future()
    end = lambda: stopped.done() or stopped.set_result(None)  # noqa: E731
    if host is None:
        handlers = {"add": relay.add, "cancel": relay.cancel, "held": relay.held}
        reader(conn, loop, handlers, end)
    else:
        _host(conn, loop, relay, engine, host, ("ready", info, engine.tokenizer), end)
    await stopped
    await engine.stop()


def _host(owner: Any, loop: asyncio.AbstractEventLoop, relay: "_StepRelay", engine: Any, host: dict[str, Any],
          hello: tuple[Any, ...], end: Any) -> None:
    """An engine host: the gateway workers connect to `host["listen"]`, each on a connection of its own,
    and their requests go into the one batch (through the scheduler's queue when `host["scheduler"]`);
    it ends when the process that started it closes `owner` (or says stop)."""
    from multiprocessing.connection import Listener

    relay.hosting = True
    relay.queue = host_queue(engine.model_id, engine._max_batch_size, host.get("scheduler"))
    listener = Listener(host["listen"], "AF_UNIX")
    accept_workers(listener, loop, hello, relay.handlers_for, relay.drop_worker, "tollgate-engine-accept")

    def ended() -> None:
        listener.close()
        end()

    reader(owner, loop, {}, ended)


class _StepRelay:
    """In the engine process: collects what the manager delivers in one step and sends it as one message."""

    def __init__(self, conn: Any, loop: asyncio.AbstractEventLoop, engine: HFEngine, gather_s: float = 0.0, *,
                 step_tokens: int = 0, step_requests: int = 0) -> None:
        self._conn = conn
        self._loop = loop
        self._engine = engine
        self._seen: dict[str, int] = {}
        self._outbox: list[tuple[Any, ...]] = []
        self._gather_s = gather_s
        # What fills the first step (the manager's tokens and requests per step; 0: no limit): a
        # burst that fills it is handed over at once, as waiting longer could not make that step fuller.
        self._step_tokens, self._step_requests = step_tokens, step_requests
        self._held: dict[str, tuple[Any, ...]] = {}  # rid -> its add's arguments, while a burst is gathered
        self._held_tokens = 0
        self._window: tuple[float, Any] | None = None  # (the gathering's deadline, the quiet timer)
        # An engine host's: key ("worker/rid") -> (that worker's connection, its request id), the keys
        # of each worker, and the queue in front of the batch (None: straight in, as with one gateway).
        self._route: dict[str, tuple[Any, str]] = {}
        self.hosting = False  # set by _host: outputs go to each worker's part of the step (`_parts`)
        self._parts: dict[Any, list[tuple[Any, ...]]] = {}
        self._workers: dict[int, set[str]] = {}
        self._senders: dict[int, WorkerSender] = {}
        self.queue: Any = None
        self._waited: dict[str, tuple[float, int, int]] = {}  # key -> (ms in the host's queue, prompt tokens, max_tokens)

    # an engine host's side: commands from several workers -----------------------------------
    def handlers_for(self, worker: int, conn: Any) -> dict[str, Any]:
        conn = self._senders[worker] = WorkerSender(conn, f"tollgate-engine-send-{worker}")  # every send to it goes through here
        self._workers[worker] = set()
        return {"add": lambda rid, *args: self.add_from(worker, conn, rid, *args),
                "cancel": lambda rid: self.cancel(f"{worker}/{rid}"),
                "held": lambda ask: conn.send(("held", ask, len(self._workers.get(worker, ()))))}

    def add_from(self, worker: int, conn: Any, rid: str, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
                 grammar: str | None = None, account: Any = None, priority: str | None = None) -> None:
        key = f"{worker}/{rid}"
        self._route[key] = (conn, rid)
        self._workers.setdefault(worker, set()).add(key)
        args = (key, prompt_ids, max_tokens, temperature, top_p, grammar)
        if self.queue is None:
            self.add(*args)
            return

        def go(waited_ms: float) -> None:
            if key in self._route:
                self._waited[key] = (waited_ms, len(prompt_ids), max_tokens)
                self.add(*args)

        def refuse(why: str, retry_after: int) -> None:
            self._forget(key)
            try:
                conn.send(("refused", rid, why, retry_after))
            except (OSError, EOFError):
                pass

        self.queue.add(key, prompt_ids, max_tokens, account, priority, go, refuse)

    def drop_worker(self, worker: int) -> None:
        for key in list(self._workers.pop(worker, ())):
            self.cancel(key)
        sender = self._senders.pop(worker, None)
        if sender is not None:
            sender.close()

    def _forget(self, key: str) -> None:
        conn_rid = self._route.pop(key, None)
        if conn_rid is not None:
            worker = int(key.split("/", 1)[0])
            self._workers.get(worker, set()).discard(key)

    def add(self, rid: str, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float, grammar: str | None = None,
            account: Any = None, priority: str | None = None) -> None:
        idle = not self._seen
        self._seen[rid] = -1  # -1: queue time not reported yet
        if self._gather_s and (idle or self._window is not None):
            # A burst after an idle spell: held until no request has come for GATHER_QUIET_S (at most
            # gather_s after the first), then submitted together so the first prefill step is full.
            self._held[rid] = (rid, prompt_ids, max_tokens, temperature, top_p, grammar)
            self._held_tokens += len(prompt_ids)
            now = self._loop.time()
            deadline, timer = self._window or (now + self._gather_s, None)
            if timer is not None:
                timer.cancel()
            if (self._step_tokens and self._held_tokens >= self._step_tokens) or (self._step_requests and len(self._held) >= self._step_requests):
                self._release()  # the first step is full already
                return
            self._window = (deadline, self._loop.call_at(min(deadline, now + GATHER_QUIET_S), self._release))
            return
        self._submit(rid, prompt_ids, max_tokens, temperature, top_p, grammar)

    def _release(self) -> None:
        held, self._held, self._window, self._held_tokens = self._held, {}, None, 0
        for args in held.values():
            self._submit(*args)

    def _submit(self, rid: str, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float, grammar: str | None = None) -> None:
        from engines.base import SamplingParams

        sampling = SamplingParams(temperature=temperature, top_p=top_p)
        self._engine.submit(rid, prompt_ids, max_tokens, sampling, lambda out: self._collect(rid, out), grammar)

    def cancel(self, rid: str) -> None:
        if self.queue is not None:
            self.queue.cancel(rid)  # waiting: it leaves the queue; running: its slot is free
            self._waited.pop(rid, None)
        if self._route:
            self._forget(rid)
        if self._seen.pop(rid, None) is None:
            return
        held = self._held.pop(rid, None)
        if held is None:
            self._engine._cancel(rid)
        else:
            self._held_tokens -= len(held[1])

    def held(self, ask: int) -> None:
        self._conn.send(("held", ask, len(self._seen)))

    def _collect(self, rid: str, out: Any) -> None:
        seen = self._seen.get(rid)
        if seen is None:
            return  # cancelled meanwhile
        queue_ms = None
        done = out.is_finished()
        if seen < 0:
            started = out.lifespan[0]
            if started <= 0 and not done:
                return  # not running yet
            queue_ms = max(0.0, (started - out.created_time) * 1000.0) if started > 0 else None
            seen = 0
        tokens = out.generated_tokens
        error = (str(out.error) if out.error else self._engine.guide_failure(rid)) if done else None
        if queue_ms is not None and rid in self._waited:
            queue_ms += self._waited.pop(rid)[0]  # the time in the host's queue, before the engine saw it
        if done:
            self._seen.pop(rid, None)
            self._waited.pop(rid, None)
            if self.queue is not None:
                self.queue.finish(rid, len(tokens), "error" if error else "length")
        else:
            self._seen[rid] = len(tokens)
        new = [int(t) for t in tokens[seen:]]
        if not self.hosting:
            if not self._outbox:
                self._loop.call_soon(self._flush)  # after every handler of this step has run
            self._outbox.append((rid, new, done, error, queue_ms))
            return
        # An engine host: straight into its worker's part of this step, with that worker's own id (one
        # tuple per output: a step's items are most of what this process allocates).
        conn_rid = self._route.get(rid)
        if conn_rid is None:
            return  # its worker is gone
        if not self._parts:
            self._loop.call_soon(self._flush)
        part = self._parts.get(conn_rid[0])
        if part is None:
            part = self._parts[conn_rid[0]] = []
        part.append((conn_rid[1], new, done, error, queue_ms))
        if done:
            self._forget(rid)

    def _flush(self) -> None:
        if self.hosting:
            parts, self._parts = self._parts, {}
            for conn, part in parts.items():
                conn.send(part)  # a WorkerSender: queued, never blocks; a gone worker's reader cancels its requests
            return
        batch, self._outbox = self._outbox, []
        try:
            self._conn.send(batch)
        except (OSError, EOFError):
            pass  # the gateway is gone; the command reader ends this process


if __name__ == "__main__":
    engine_main(int(sys.argv[1]))
