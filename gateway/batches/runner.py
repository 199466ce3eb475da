"""The batch runner: a background loop in the gateway process that runs the lines of every active
batch through the route of their endpoint, as the app's own request: the same authentication
result (the batch's key), parsing, admission (gateway/serving/admission.py: Meter.admit), engine and ledger
row as any request, in the scheduler's lowest class and at the batch price (gateway/batches/line.py).

One runner drives a batch at a time, on a lease in its row (TOLLGATE_BATCH_LEASE_SECONDS) that a
task of its own renews every third of the lease for as long as the runner drives it, whatever the
runner waits on (lines in flight, the ledger's flush, the files): another process (a worker,
another instance, the same server restarted) takes it over only once the lease has lapsed, so the
lines it finds claimed are not running anywhere. A runner that finds its lease taken stops at once.

A line's run never strands it: an exception while it runs ends it `errored` (500, code
`line_failed`; not run again: if it was admitted its row exists), and an answer whose storing
failed is kept and stored again; the batch is not finalized while a line is claimed.

Restart safety: a line is claimed durably before it runs (naming the runner), and its request id
(so its ledger row's) is `<batch id>-<line index>`. Its admission marks it admitted in the database,
for its runner only, before its row is journaled (Meter.admit, BatchStore.admitted). A run that
stopped leaves claimed lines; the next one, once the ledger has the rows its journal replayed,
finds each claimed line's row: a line with a row ran (in part) and is not run again (it ends
`errored`: interrupted); a line marked admitted without a row ran on a runner whose journal is not
here (another instance's volume; its row comes when that instance comes back) and is not run again
either (`errored`: interrupted). Before judging or claiming any line, a runner sweeps once, in every
batch, the lines the previous run on this process's journal (its id is kept there) marked admitted
and that have no row although that journal is replayed: it was killed between the mark and the
journal, so they never ran. One still claimed goes back to pending with the lines never admitted;
one another instance ended meanwhile (admitted elsewhere, it judged) gets its one row there and
then, `interrupted` and billed nothing (`sweep`; one that fails runs again at the next round). A
runner whose line was put back or ended by another (its lease lapsed while it stalled) cannot mark
it: that run is refused before its row and leaves the line alone. A line refused before admission
(429/503: queue full, quota) is put back and retried until the batch's window ends. So a line is
admitted once, and has one row, whichever runners and instances handle it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.routing import Route

from billing.batches.store import BatchStore, LeaseHeld, Line, Unjournaled
from billing.batches.files import FileStore
from billing.keys.store import KeyStore
from billing.ledger.records import UsageRecord
from billing.models import utcnow
from billing.periodic import Periodic
from gateway.batches import results
from gateway.batches.line import SCOPE_KEY, BatchLine
from gateway.config import BatchSettings

log = logging.getLogger("tollgate.batches")
SWEEP_SECONDS = 60.0  # a sweep stuck on the database gives up; the next round runs it again
RETRIED = (429, 503, 529)  # refused before admission (529: Anthropic's overloaded): no row, may run later
INTERRUPTED = {"error": {"message": "The gateway restarted while this request ran; it was not run again (its usage is in the ledger).",
                         "type": "server_error", "param": None, "code": "interrupted"}}
# Admitted by a runner whose journal is not here (another instance stopped): its row, if it ran, is that journal's.
ADMITTED_ELSEWHERE = {"error": {"message": "The gateway instance running this request stopped after admitting it; it was not "
                                "run again (its usage, if any, is billed from that instance's ledger journal).",
                                "type": "server_error", "param": None, "code": "interrupted"}}
# Killed after the line's row was final but before its answer was stored: billed in full, answer lost.
ANSWER_LOST = {"error": {"message": "The gateway restarted after this request finished but before its answer was stored; "
                         "it was not run again (its usage is in the ledger).",
                         "type": "server_error", "param": None, "code": "answer_lost"}}
KEY_REVOKED = {"error": {"message": "The batch's API key is no longer valid.", "type": "invalid_request_error",
                         "param": None, "code": "key_revoked"}}


def line_failed(admitted: bool) -> bytes:
    """The answer of a line whose run raised: it is not run again (admitted, it has its one row)."""
    billed = "its usage is in the ledger" if admitted else "it was not admitted: nothing was billed"
    return orjson.dumps({"error": {"message": f"The gateway failed while running this request; it was not run again ({billed}).",
                                   "type": "server_error", "param": None, "code": "line_failed"}})


End = tuple[str, int, str] | None  # what ends a line: (outcome, status code, body); None: back to pending


class Unstored(Exception):
    """A line's run ended (`end`) but storing that failed: the line is still claimed."""

    def __init__(self, line: Line, end: End) -> None:
        super().__init__(f"line {line.line}")
        self.line, self.end = line, end


def interrupted_row(found: Unjournaled) -> UsageRecord:
    """The one row of a line its run marked admitted and never journaled (killed in between): it
    never reached the engine, so nothing used, nothing billed; admitted when it was marked."""
    line = found.line
    try:
        body = orjson.loads(line.body)
    except orjson.JSONDecodeError:
        body = None
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        model = found.batch_model or "unknown"  # the model an OpenAI batch's lines all name
    return UsageRecord(
        request_id=line.request_id, account_id=found.account_id, key_id=found.key_id, model=model[:128],
        prompt_tokens=0, completion_tokens=0, status="interrupted", finish_reason=None, total_ms=0.0, cost_nanos=0,
        api="batch", batch_id=line.batch_id, created_at=found.admitted_at, admitted_at=found.admitted_at,
    )


def _round_failed(pulse: Any, exc: Exception) -> None:  # the database is out: the next round tries again
    if pulse.worth_saying():
        log.warning("could not list active batches (%d rounds in a row): %s", pulse.streak, type(exc).__name__)


class BatchRunner:
    def __init__(
        self, app: Any, store: BatchStore, files: FileStore, keys: KeyStore, settings: BatchSettings, *,
        lowest_class: str | None, flush: Callable[[], Any], runner_id: str | None = None, previous_run: str | None = None,
    ) -> None:
        self._app = app
        self._store = store
        self._files = files
        self._keys = keys
        self._settings = settings
        self._lowest = lowest_class
        self._flush = flush  # the ledger's rows (a replayed journal's too) into the database
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._jobs: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        # A round at the start, then each poll, or at once when a batch is created or cancelled.
        self.loop = Periodic("batch-runner", settings.poll_seconds, self._round, on_error=lambda exc: _round_failed(self.loop.pulse, exc),
                             first=True, wake=self._wake)
        self._stopping = False
        self._endpoints: dict[str, Any] = {}
        self.runner_id = runner_id or uuid.uuid4().hex  # this process's runner, in the leases it holds
        # The runner the previous run on this process's journal had: its rows are replayed here.
        self._previous_run = previous_run
        self._swept = False  # its lines marked admitted and never journaled are seen to (`sweep`)
        self._sweeping = asyncio.Lock()

    def start(self) -> None:
        self._endpoints = {r.path: r.endpoint for r in self._app.routes
                           if isinstance(r, Route) and r.path in results.ENDPOINTS and "POST" in (r.methods or ())}
        self.loop.start()

    @property
    def halting(self) -> bool:
        """Stopping, or the server drains (SIGTERM): no new line is claimed; those in flight finish."""
        return self._stopping or bool(getattr(self._app, "draining", False))

    def wake(self) -> None:
        """A batch was created or cancelled: look now rather than at the next poll."""
        self._wake.set()

    async def stop(self, timeout: float = 10.0) -> None:
        """Claims nothing more; lines in flight get `timeout` seconds to end, then are cut."""
        self._stopping = True
        self._wake.set()
        jobs = list(self._jobs.values())
        if jobs:
            await asyncio.wait(jobs, timeout=timeout)
        await self.loop.stop()
        for task in self._jobs.values():
            task.cancel()
        for task in jobs:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _round(self) -> None:
        if self.halting:
            return  # claims nothing more
        try:
            await self.sweep()
        except Exception as exc:  # the database is out: the next round, or a batch's recovery, runs it again
            log.warning("the previous run's admitted lines were not swept: %s; trying again", type(exc).__name__)
        try:
            await self._files.delete_expired()  # files past their expires_after (no read finds them meanwhile)
        except Exception as exc:  # the database is out: the next round, and the claims below still try
            log.warning("expired files not deleted: %s", type(exc).__name__)
        for batch_id in await self._store.active():
            if batch_id not in self._jobs and not self.halting:
                try:
                    await self._store.lease(batch_id, self.runner_id, self._settings.lease_seconds)
                except LeaseHeld:
                    continue  # another runner drives it
                self._jobs[batch_id] = asyncio.get_running_loop().create_task(self._job(batch_id), name=f"batch-{batch_id}")

    async def _job(self, batch_id: str) -> None:
        try:
            await self._drive(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: the runner failed; the next round resumes it", batch_id)
        finally:
            self._jobs.pop(batch_id, None)

    def window_end(self, batch: dict[str, Any]) -> float:
        """When the batch's window ends, in epoch seconds."""
        if self._settings.window_seconds:
            return batch["created_at"].timestamp() + self._settings.window_seconds
        return float(batch["expires_at"].timestamp())

    async def _drive(self, batch_id: str) -> None:
        """Drives the batch while this runner holds its lease, renewed meanwhile by `_keep_lease`;
        the lease taken by another runner cancels the drive."""
        lost = asyncio.Event()
        driver = asyncio.current_task()
        assert driver is not None
        keeper = asyncio.get_running_loop().create_task(self._keep_lease(batch_id, driver, lost), name=f"lease-{batch_id}")
        try:
            let_go = await self._run_batch(batch_id)
        except asyncio.CancelledError:
            if not lost.is_set():
                raise
            driver.uncancel()
            log.warning("batch %s: lease lost; leaving it to the runner that took it", batch_id)
            return
        finally:
            keeper.cancel()  # before an unlease, so no renewal comes after it
            await asyncio.gather(keeper, return_exceptions=True)
        if let_go:
            await self._store.unlease(batch_id, self.runner_id)

    async def _keep_lease(self, batch_id: str, driver: asyncio.Task[Any], lost: asyncio.Event) -> None:
        """Renews the lease every third of it until cancelled; another runner holding it (ours
        lapsed) cancels `driver`. A failed renewal is tried again at the next third."""
        seconds = self._settings.lease_seconds
        while True:
            await asyncio.sleep(seconds / 3)  # the renewal's cadence
            try:
                await self._store.lease(batch_id, self.runner_id, seconds)
            except LeaseHeld:
                lost.set()
                driver.cancel()
                return
            except Exception as exc:
                log.warning("batch %s: could not renew its lease: %s; trying again", batch_id, type(exc).__name__)

    async def _run_batch(self, batch_id: str) -> bool:
        """Runs the batch; no line of it is in flight anywhere when this starts (a lapsed lease, or
        this process's own earlier job, which awaited its lines). True: halting, let go of the lease."""
        await self._recover(batch_id)
        await self._store.move(batch_id, "in_progress", from_=("validating",))
        running: dict[asyncio.Task[float | None], Line] = {}
        owed: dict[int, Unstored] = {}  # lines whose run ended but whose end is not stored yet
        retry_at = 0.0
        try:
            while True:
                batch = await self._store.get(batch_id)
                if batch is None:
                    return False
                status = batch["status"]
                ending = "cancelled" if status == "cancelling" else "expired" if time.time() >= self.window_end(batch) else None
                if status == "finalizing":
                    ending = "completed"
                if ending is not None or self.halting:
                    if running:
                        await asyncio.wait(list(running))  # the lease is renewed meanwhile
                        for task, line in running.items():
                            self._ended(batch_id, task, line, owed)
                        running.clear()
                    if self.halting:
                        await self._store_owed(batch_id, owed)  # those it cannot store the next job judges
                        return True
                    if not await self._all_ended(batch_id, owed):  # none is left claimed when it ends
                        await asyncio.sleep(self._settings.poll_seconds)
                        continue
                    if ending != "completed":
                        await self._store.end_pending(batch_id, "canceled" if ending == "cancelled" else "expired")
                    await self._finalize(batch, ending or "completed")
                    return False
                principal = await self._principal(batch)
                free = self._settings.concurrency - len(running)
                if free > 0 and time.time() >= retry_at:
                    lines = await self._store.pending(batch_id, free)
                    if not lines and not running and await self._all_ended(batch_id, owed):
                        if await self._store.move(batch_id, "finalizing", from_=("in_progress",)):
                            continue
                    for line in lines:
                        if await self._store.claim(line, self.runner_id):
                            task = asyncio.get_running_loop().create_task(self._run_line(batch, line, principal))
                            running[task] = line
                if not running:
                    await asyncio.sleep(min(self._settings.poll_seconds, max(0.0, retry_at - time.time())) or 0.05)
                    continue
                done, _ = await asyncio.wait(list(running), timeout=self._settings.poll_seconds, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    wait = self._ended(batch_id, task, running.pop(task), owed)
                    if wait is not None:
                        retry_at = max(retry_at, time.time() + (wait or 1.0))
        finally:
            for task in running:
                task.cancel()
            if running:  # their rows are recorded before the next job judges their lines
                await asyncio.gather(*running, return_exceptions=True)

    def _ended(self, batch_id: str, task: asyncio.Task[float | None], line: Line, owed: dict[int, Unstored]) -> float | None:
        """A line's task is done: the seconds to wait before claiming more (it was refused before
        admission), else None. One whose end could not be stored is kept in `owed`."""
        if task.cancelled():
            return None
        exc = task.exception()
        if isinstance(exc, Unstored):
            log.error("batch %s: line %d ended but storing it failed: %r; stored again before the batch ends",
                      batch_id, line.line, exc.__cause__)
            owed[line.line] = exc
        elif exc is not None:  # still claimed: `_all_ended` judges it by the ledger, as a restart does
            log.error("batch %s: line %d failed: %r", batch_id, line.line, exc, exc_info=exc)
        return None if exc is not None else task.result()

    async def _store_owed(self, batch_id: str, owed: dict[int, Unstored]) -> bool:
        """Stores the ends it owes; whether none is left (one that fails again is kept)."""
        for number, unstored in list(owed.items()):
            try:
                await self._store_end(unstored.line, unstored.end)
            except Exception as exc:
                log.warning("batch %s: line %d's end still could not be stored: %s", batch_id, number, type(exc).__name__)
                return False
            del owed[number]
        return True

    async def _all_ended(self, batch_id: str, owed: dict[int, Unstored]) -> bool:
        """With no line of it in flight here: stores what it owes and judges any line left claimed
        (a run that raised) by the ledger; whether no line is claimed any more and none went back
        to pending."""
        if not await self._store_owed(batch_id, owed):
            return False
        return await self._recover(batch_id) == 0

    async def _still_wanted(self, batch: dict[str, Any], principal: Any) -> tuple[Any, bool]:
        """Whether a line claimed a while ago still runs (its batch in progress and within its window,
        the server not draining), with its key read again; (principal, False) when it does not."""
        try:
            now = await self._store.get(batch["id"])
            if self.halting or now is None or now["status"] != "in_progress" or time.time() >= self.window_end(now):
                return principal, False
            return await self._principal(now), True
        except Exception as exc:  # the database or the key store is out: not started; pending again once it is back
            log.warning("batch %s: could not read it again before a line's start: %s", batch["id"], type(exc).__name__)
            return principal, False

    async def _principal(self, batch: dict[str, Any]) -> Any:
        principal = await self._keys.principal_of_key(batch["key_id"])
        if principal is None:
            return None
        return dataclasses.replace(principal, priority=self._lowest) if self._lowest else principal

    async def sweep(self) -> list[Line]:
        """Once, before this runner judges or claims a line: the lines the previous run on this
        journal marked admitted and never journaled (killed between the two, so they never ran, and
        with its journal replayed and flushed no row of theirs is coming), in every batch. One still
        claimed goes back to pending, to run once; one a runner that took its batch over has ended
        meanwhile (admitted elsewhere, it judged: its row to come from a journal) gets that row now,
        `interrupted` and billed nothing. Returns the lines put back (none once it has run); raises
        when it could not run (the database is out), and the next caller runs it again."""
        previous = self._previous_run
        if self._swept or previous is None:
            return []
        async with self._sweeping:  # the round and the batches' recoveries: one sweep at a time
            if self._swept:
                return []
            async with asyncio.timeout(SWEEP_SECONDS):
                reopened, rows, written = await self._sweep_lines(previous)
            self._swept = True
        if reopened or rows:
            log.warning("the previous run %s marked %d lines admitted and was killed before journaling them: %d go back "
                        "to pending, %d ended by another runner get their interrupted row (%d written)",
                        previous, len(reopened) + rows, len(reopened), rows, written)
        return reopened

    async def _sweep_lines(self, previous: str) -> tuple[list[Line], int, int]:
        """(the lines put back, the rows owed, those of them written now)."""
        await self._flush()  # first: a line whose row the replayed journal had is not the sweep's
        found = await self._store.admitted_without_row(previous)
        claimed = [f.line for f in found if f.line.state == "claimed"]
        reopened = [line for line in claimed if await self._store.reopen(line, previous)]
        if len(reopened) < len(claimed):  # ended meanwhile by a runner that took its batch over: it is owed a row
            found = await self._store.admitted_without_row(previous)
        rows = [interrupted_row(f) for f in found if f.line.state == "done"]
        written = await self._store.add_rows(rows) if rows else 0  # one per request id and instant: a repeat writes none
        return reopened, len(rows), written

    async def _recover(self, batch_id: str) -> int:
        """Lines a stopped run had claimed: done if their ledger row exists, else pending again;
        how many there were (with those of this batch the sweep put back)."""
        reopened = sum(line.batch_id == batch_id for line in await self.sweep())
        claimed = await self._store.claimed(batch_id)
        if not claimed:
            return reopened
        await self._flush()
        ran = await self._store.in_ledger([line.request_id for line in claimed])
        elsewhere = 0
        for line in claimed:
            if line.request_id in ran:
                error = INTERRUPTED if ran[line.request_id] == "interrupted" else ANSWER_LOST
                await self._store.finish(line, "errored", 500, orjson.dumps(error).decode(), line.claimed_by)
            elif line.admitted or not await self._store.release(line, line.claimed_by):  # not put back: admitted meanwhile
                elsewhere += 1
                await self._store.finish(line, "errored", 500, orjson.dumps(ADMITTED_ELSEWHERE).decode(), line.claimed_by)
        log.info("batch %s: %d claimed lines had run, %d were admitted where their rows are not seen, %d go back to pending",
                 batch_id, len(ran), elsewhere, len(claimed) - len(ran) - elsewhere + reopened)
        return reopened + len(claimed)

    async def _run_line(self, batch: dict[str, Any], line: Line, principal: Any) -> float | None:
        """Runs one claimed line; returns seconds to wait before claiming more when it was refused
        before admission (it is pending again), else None (it is done). Its run raising ends it as
        an error (not run again); storing its end failing raises Unstored, which carries the end."""
        end: End
        retry: float | None = None
        waited = self._slots.locked()
        async with self._slots:  # one limit for every batch of this process: a claimed line may wait here a while
            wanted = True
            if waited:
                # What held when it was claimed may not now: the batch cancelled, its window over, the server
                # draining, its key revoked. Not started then: pending again (a cancel or expiry ends it as such).
                principal, wanted = await self._still_wanted(batch, principal)
            if not wanted:
                end = None
            elif principal is None or principal.revoked or principal.expired():
                end = ("errored", 401, orjson.dumps(KEY_REVOKED).decode())  # as the API answers a revoked or expired key
            else:
                context = BatchLine(batch["id"], line.request_id, principal, mark=lambda: self._store.admitted(line, self.runner_id))
                try:
                    status, body, wait = await self._dispatch(batch["endpoint"], line.body, context)
                except Exception:
                    log.exception("batch %s: line %d raised while it ran (%s); it ends as an error", batch["id"], line.line,
                                  "admitted" if context.admitted else "not admitted")
                    status, body, wait = 500, line_failed(context.admitted), 1.0
                if context.taken:
                    log.warning("batch %s: line %d was taken over by another runner before it was admitted here; left to it",
                                batch["id"], line.line)
                    return None
                if not context.marked and status in RETRIED:
                    end, retry = None, wait
                else:
                    end = ("succeeded" if 200 <= status < 300 else "errored", status, body.decode("utf-8", "replace"))
        try:
            await self._store_end(line, end)
        except Exception as exc:
            raise Unstored(line, end) from exc
        return retry

    async def _store_end(self, line: Line, end: End) -> None:
        if end is None:
            await self._store.release(line, self.runner_id)
        else:
            if not await self._store.finish(line, *end, self.runner_id):
                log.warning("batch %s: line %d was ended by the runner that took the batch over; its end stays", line.batch_id, line.line)

    async def _dispatch(self, path: str, body: str, line: BatchLine) -> tuple[int, bytes, float]:
        """The line as a request to its route in this app; (status, body, Retry-After seconds)."""
        raw = orjson.loads(body)
        if isinstance(raw, dict) and "stream" in raw:
            if raw["stream"]:
                raw.pop("stream_options", None)  # the options of a stream it no longer is (the route refuses them then)
            raw["stream"] = False  # a batch line's answer is one body
        payload = orjson.dumps(raw)
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            "client": ("batch", 0), "server": ("batch", 0), "app": self._app,
            "state": {"request_id": line.request_id}, SCOPE_KEY: line,
        }
        inbox = [{"type": "http.request", "body": payload, "more_body": False}]
        finished = asyncio.Event()
        answer: dict[str, Any] = {"status": 500, "headers": [], "body": []}

        async def receive() -> dict[str, Any]:
            if inbox:
                return inbox.pop()
            await finished.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answer["status"], answer["headers"] = message["status"], message.get("headers", [])
            elif message["type"] == "http.response.body":
                answer["body"].append(message.get("body", b""))
                if not message.get("more_body"):
                    finished.set()

        from gateway.http.error_handlers import error_response  # the app's one answer to a route's exception

        endpoint = self._endpoints[path]
        try:
            response = await endpoint(Request(scope, receive, send))
        except Exception as exc:
            response = await error_response(scope, exc)
        try:
            await response(scope, receive, send)
        finally:
            finished.set()
        retry = next((v for k, v in answer["headers"] if k.lower() == b"retry-after"), b"1")
        try:
            wait = float(retry)
        except ValueError:
            wait = 1.0
        return int(answer["status"]), b"".join(answer["body"]), min(max(wait, 0.2), 30.0)

    async def _finalize(self, batch: dict[str, Any], ending: str) -> None:
        """Writes the output and error files (OpenAI's batches) and moves the batch to `ending`."""
        batch_id = batch["id"]
        values: dict[str, Any] = {}
        if batch["api"] == "openai":
            output, errors = results.openai_files(await self._store.lines(batch_id))
            if output:
                values["output_file_id"] = (await self._files.put(batch["account_id"], "batch_output", f"{batch_id}_output.jsonl", output,
                                                                  batch.get("output_expires_seconds"))).id
            if errors:
                values["error_file_id"] = (await self._files.put(batch["account_id"], "batch_output", f"{batch_id}_error.jsonl", errors,
                                                                 batch.get("output_expires_seconds"))).id
        moved = await self._store.move(batch_id, ending, from_=("in_progress", "finalizing", "cancelling", "validating"), **values)
        if moved:
            log.info("batch %s %s at %s", batch_id, ending, utcnow().isoformat())
