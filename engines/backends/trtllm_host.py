"""The `trtllm` backend under `tollgate serve --workers N`: one engine host process holds the
TensorRT-LLM `LLM`; every worker's `TRTLLMEngine` reaches it through engines/backends/trtllm_shared.py.

The engine host calls the real `generate_async` for every worker's requests, so TensorRT-LLM's
in-flight batch is one; its `HostQueue` (engines/wrappers/scheduler.py) lets them in, the scheduler's
classes and reserve applying to the engine as a whole (as the hf engine host's does). A worker that
goes (stopped or killed) has its requests aborted; the others go on.

    supervisor:  TRTLLMHost.start()  --spawns-->  python -m engines.backends.trtllm_host FD: TRTLLMEngine.start() (the LLM), listens
    worker 1..N: TRTLLMEngine(connect_to=socket)._llm = SharedLLM  <--one connection each-->  _Host: the one LLM
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engines.backends.trtllm_shared import ARGS, Call, Logprob, names
from engines.hosting import WorkerSender, accept_workers, freeze_loaded, host_queue, reader

log = logging.getLogger("tollgate.engines.trtllm_host")

START_TIMEOUT_S = 1800.0  # weights, CUDA graphs: as long as an engine process of the hf backend may take
STOP_TIMEOUT_S = 15.0
ABORT_GRACE_S = 5.0  # an aborted request TensorRT-LLM still held in its queue never answers: its pump ends here


# the supervisor's side -------------------------------------------------------------------------------
class TRTLLMHost:
    """The engine host process of a `trtllm` model, started by the supervisor before the workers."""

    child_module = "engines.backends.trtllm_host"  # `python -m <it> FD`

    def __init__(self, *, model_id: str, params: dict[str, Any]) -> None:
        self.model_id, self.params = model_id, params
        self.host: dict[str, Any] = {}  # {"listen": socket path, "scheduler": HostQueue settings or None}
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Any = None

    async def start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen([sys.executable, "-m", self.child_module, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                             cwd=str(Path(__file__).resolve().parents[2]))
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((self.model_id, self.params, self.host))
        hello = await asyncio.to_thread(self._hello)
        if hello[0] != "ready":
            self._kill()
            from engines.base import EngineError

            raise EngineError(hello[1])
        log.info("model %s ready in the TensorRT-LLM engine host (process %d)", self.model_id, self._process.pid)

    def _hello(self) -> tuple[Any, ...]:
        waited = 0.0
        assert self._process is not None
        while not self._conn.poll(1.0):
            waited += 1.0
            if self._process.poll() is not None or waited >= START_TIMEOUT_S:
                return ("failed", f"the TensorRT-LLM engine host did not start (exit code {self._process.poll()})")
        try:
            return self._conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            return ("failed", f"the TensorRT-LLM engine host exited while loading (exit code {self._process.wait(5.0)})")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def stop(self) -> None:
        if self._process is None:
            return
        self._conn.close()  # the host shuts the LLM down when its owner's connection closes
        try:
            await asyncio.to_thread(self._process.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        self._kill()

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(5.0)
        self._conn.close()


# the engine host process -----------------------------------------------------------------------------
class _Host:
    """In the engine host: every worker's requests into the one LLM, their responses back per step."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, queue: Any) -> None:
        self.engine, self.llm, self.loop, self.queue = engine, engine._llm, loop, queue
        self.live: dict[str, tuple[Any, str, Any]] = {}  # "worker/rid" -> (its connection, its rid, result or None while queued)
        self.workers: dict[int, set[str]] = {}
        self.outbox: dict[Any, list[tuple[Any, ...]]] = {}
        self.pumps: dict[str, asyncio.Task[None]] = {}
        self.senders: dict[int, WorkerSender] = {}

    def handlers(self, worker: int, conn: Any) -> dict[str, Any]:
        conn = self.senders[worker] = WorkerSender(conn, f"tollgate-trtllm-send-{worker}")  # every send to it goes through here
        self.workers[worker] = set()
        return {"generate": lambda rid, *args: self.generate(worker, conn, rid, *args), "abort": lambda rid: self.abort(f"{worker}/{rid}")}

    def generate(self, worker: int, conn: Any, rid: str, prompt: list[int], call: Call, admission: tuple[Any, Any] | None) -> None:
        key = f"{worker}/{rid}"
        self.live[key] = (conn, rid, None)
        self.workers.setdefault(worker, set()).add(key)
        if self.queue is None:
            self._start(key, prompt, call)
            return
        account, priority = admission or (None, None)

        def go(_waited_ms: float) -> None:
            if key in self.live:  # not aborted meanwhile
                self._start(key, prompt, call)

        def refuse(why: str, retry_after: int) -> None:
            self._forget(key)
            self._post(conn, ("refused", rid, why, retry_after))

        self.queue.add(key, prompt, int(call.kwargs.get("max_tokens") or 0), account, priority, go, refuse)

    def _start(self, key: str, prompt: list[int], call: Call) -> None:
        conn, rid, _ = self.live[key]
        try:
            params = self._built(call)
            result = self.llm.generate_async(prompt, sampling_params=params, streaming=True)
        except Exception as exc:  # noqa: BLE001 - the worker's engine decides what it means
            self._ended(key, 0, "error")
            self._post(conn, ("fail", rid, names(exc), str(exc)))
            return
        self.live[key] = (conn, rid, result)
        whole = (getattr(params, "best_of", None) or getattr(params, "n", 1) or 1) > 1
        self.pumps[key] = self.loop.create_task(self._pump(key, conn, rid, result, whole))

    def _built(self, call: Call) -> Any:
        api = self.engine._api
        where = api if call.name == "SamplingParams" else (getattr(api, "llmapi", None) or api)
        return getattr(where, call.name)(**{k: self._built(v) if isinstance(v, Call) else v for k, v in call.kwargs.items()})

    async def _pump(self, key: str, conn: Any, rid: str, result: Any, whole: bool) -> None:
        sent: list[int] = []  # the ids sent so far of each output (their count, n == 1; none when whole)
        tokens, reason = 0, "length"
        try:
            async for out in result:
                response = _response(out, sent, whole)
                tokens = sum(len(c.token_ids or ()) for c in out.outputs)
                self._post(conn, ("out", rid, response))
                if out.finished:
                    reason = "error" if getattr(out, "error", None) else "length"
                    return
        except asyncio.CancelledError:
            reason = "error"
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the worker's engine, which decides
            reason = "error"
            self._post(conn, ("fail", rid, names(exc), str(exc)))
        finally:
            self._ended(key, tokens, reason)

    def _ended(self, key: str, tokens: int, reason: str) -> None:
        self._forget(key)
        self.pumps.pop(key, None)
        if self.queue is not None:
            self.queue.finish(key, tokens, reason)

    def abort(self, key: str) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        if entry[2] is None:  # still in the host's queue: it leaves it, and TensorRT-LLM never saw it
            self._forget(key)
            if self.queue is not None:
                self.queue.cancel(key)
            return
        result = entry[2]
        try:
            if not result.finished:
                result.abort()
        except Exception as exc:  # noqa: BLE001
            log.warning("TensorRT-LLM abort failed: %s: %s", type(exc).__name__, exc)
        pump = self.pumps.get(key)
        if pump is not None:
            self.loop.call_later(ABORT_GRACE_S, pump.cancel)

    def drop(self, worker: int) -> None:
        """A worker is gone (stopped, or killed): its requests are aborted."""
        for key in list(self.workers.pop(worker, ())):
            self.abort(key)
        sender = self.senders.pop(worker, None)
        if sender is not None:
            sender.close()

    def _forget(self, key: str) -> None:
        self.live.pop(key, None)
        self.workers.get(int(key.split("/", 1)[0]), set()).discard(key)

    def _post(self, conn: Any, item: tuple[Any, ...]) -> None:
        if not self.outbox:
            self.loop.call_soon(self._flush)  # after every result of this step has answered
        self.outbox.setdefault(conn, []).append(item)

    def _flush(self) -> None:
        outbox, self.outbox = self.outbox, {}
        for conn, items in outbox.items():
            conn.send(items)  # a WorkerSender: queued, never blocks; a gone worker's reader aborts its requests


def _response(out: Any, sent: list[int], whole: bool) -> tuple[Any, ...]:
    """One response of TensorRT-LLM's result as plain values: per output its ids since the last
    response (`keep` of those sent, then `tail`; every id each time when there are several
    sequences, which TensorRT-LLM may re-rank), and the diffs it reports."""
    outputs = []
    for pos, c in enumerate(out.outputs):
        ids = list(c.token_ids or ())
        if whole:
            keep = 0
        else:
            if pos >= len(sent):
                sent.append(0)
            keep = min(sent[pos], len(ids))
            sent[pos] = len(ids)
        outputs.append((c.index, keep, ids[keep:], c.text_diff, list(c.token_ids_diff), _plain_logprobs(c.logprobs_diff),
                        c.finish_reason, c.stop_reason))
    every = getattr(out, "_outputs", None)
    all_seqs = None
    if whole and isinstance(every, list) and every and every is not out.outputs:
        all_seqs = [(c.index, 0, list(c.token_ids or ()), "", [], [], c.finish_reason, c.stop_reason) for c in every]
    error = getattr(out, "error", None)
    return (out.finished, str(error) if error else None, getattr(out, "cached_tokens", None), outputs, all_seqs)


def _plain_logprobs(entries: Any) -> list[Any]:
    out = []
    for entry in entries or ():
        if isinstance(entry, dict):
            out.append({int(t): Logprob(float(getattr(v, "logprob", v)), getattr(v, "rank", None)) for t, v in entry.items()})
        else:
            out.append(float(entry))
    return out


def listen(engine: Any, address: str, scheduler: dict[str, Any] | None) -> tuple[Any, tuple[Any, ...]]:
    """Serves a started TRTLLMEngine's LLM to the workers that connect to `address` (this process's
    event loop runs their requests); returns the listener (close it to stop accepting) and the hello."""
    from multiprocessing.connection import Listener

    loop = asyncio.get_running_loop()
    queue = host_queue(engine.model_id, engine.max_batch_size, scheduler)
    state = _Host(engine, loop, queue)
    args = {name: getattr(engine._llm.args, name, None) for name in ARGS}
    tokenizer = engine._llm.tokenizer
    hello = ("ready", args, getattr(tokenizer, "tokenizer", tokenizer))
    listener = Listener(address, "AF_UNIX")

    accept_workers(listener, loop, hello, state.handlers, state.drop, "tollgate-trtllm-accept")
    return listener, hello


async def _serve(owner: Connection) -> None:
    from engines.backends.trtllm import TRTLLMEngine

    model_id, params, host = owner.recv()
    engine = TRTLLMEngine(model_id=model_id, **params)
    try:
        await engine.start()
    except BaseException as exc:  # the supervisor reports it; nothing else would
        owner.send(("failed", f"model {model_id!r} failed to load: {type(exc).__name__}: {exc}"))
        return
    freeze_loaded()
    listener, hello = listen(engine, host["listen"], host.get("scheduler"))
    owner.send(hello[:2] + (None,))
    loop = asyncio.get_running_loop()
    stopped = loop.create_future()
    reader(owner, loop, {}, lambda: stopped.done() or stopped.set_result(None))
    await stopped
    listener.close()
    await engine.stop()


def host_main(fd: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trtllm-host %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(Connection(fd)))


if __name__ == "__main__":
    host_main(int(sys.argv[1]))
