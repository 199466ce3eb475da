"""A gateway SIGKILLed in the middle of a batch and started again on the same database and data
directory finishes the batch: every line once in the output or error file, one ledger row per line,
none twice (docs/batches.md: how a restart judges the lines the killed run had claimed)."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from billing.db import create_engine
from billing.models import utcnow
from tests.conftest import SECRET, bootstrap
from tests.gateway.batches.test_batches import chat_lines
from tests.processes import GatewayProcess

LINES = 50
TAKEOVER_LINES = 24


async def _rows(url: str, batch_id: str) -> list[dict[str, Any]]:
    db = create_engine(url)
    try:
        async with db.connect() as conn:
            return [dict(r) for r in (await conn.execute(
                sa.text("SELECT request_id, status FROM ledger_entries WHERE batch_id = :b"), {"b": batch_id})).mappings().all()]
    finally:
        await db.dispose()


async def _completed(client: Any, batch_id: str, what: str) -> Any:
    """The batch once it has ended, which must be `completed` within 240 s."""
    deadline = time.monotonic() + 240
    while (batch := await client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"{what}: {batch.request_counts}"
        await asyncio.sleep(0.25)
    assert batch.status == "completed", batch
    return batch


async def test_a_batch_survives_a_sigkill(fresh_pg_database: Any, tmp_path: Path) -> None:
    from openai import AsyncOpenAI

    url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(url, SECRET)
    env = {"TOLLGATE_BATCH_POLL_SECONDS": "0.2", "TOLLGATE_BATCH_CONCURRENCY": "4", "TOLLGATE_BATCH_LEASE_SECONDS": "3", "TOLLGATE_EMBEDDINGS": "off"}
    gw = GatewayProcess(url, tmp_path / "data", admin_key, **env).start()
    try:
        key = (await gw.new_key())["key"]
        client = AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=60)
        uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(LINES, max_tokens=3))), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 180
        while len(await _rows(url, batch.id)) < 10:  # well under way: lines done, others in flight
            assert time.monotonic() < deadline, "the batch did not get under way"
            await asyncio.sleep(0.1)
        await client.close()
        gw.kill()  # SIGKILL: no drain, no flush
        before = {r["request_id"] for r in await _rows(url, batch.id)}
        assert len(before) < LINES, "the batch had finished before the kill; nothing was tested"
        gw.start()
        client = AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=60)
        batch = await _completed(client, batch.id, "the batch did not finish after the restart")
        rows = await _rows(url, batch.id)
        ids = [r["request_id"] for r in rows]
        assert len(ids) == LINES and len(set(ids)) == LINES, f"{len(ids)} rows for {len(set(ids))} lines"
        assert set(ids) == {f"{batch.id}-{i}" for i in range(LINES)}
        files = [batch.output_file_id, batch.error_file_id]
        lines = [json.loads(x) for f in files if f for x in (await client.files.content(f)).content.splitlines()]
        assert sorted(x["custom_id"] for x in lines) == sorted(f"req-{i}" for i in range(LINES))
        interrupted = [x for x in lines if x["response"]["status_code"] != 200]
        assert all(x["response"]["body"]["error"]["code"] in ("interrupted", "answer_lost") for x in interrupted)
        assert batch.request_counts.completed + batch.request_counts.failed == LINES
        by_status = {r["request_id"]: r["status"] for r in rows}
        for x in interrupted:  # a line the kill cut short is not run again: its one row says how far it got
            status = by_status[x["response"]["request_id"]]
            assert (x["response"]["body"]["error"]["code"], status) in (("interrupted", "interrupted"), ("answer_lost", "completed")), (x, status)
        print(f"restart: {len(before)} rows before the kill, {len(interrupted)} lines interrupted by it")
        await client.close()
    finally:
        gw.stop()


async def _claimed_without_rows(url: str, batch_id: str) -> dict[int, bool]:
    """The lines claimed and without a row in the database, and whether each was marked admitted."""
    db = create_engine(url)
    try:
        async with db.connect() as conn:
            return {int(line): admitted for line, admitted in (await conn.execute(sa.text(
                "SELECT line, admitted_at IS NOT NULL FROM batch_lines l WHERE batch_id = :b AND state = 'claimed' AND NOT EXISTS "
                "(SELECT 1 FROM ledger_entries e WHERE e.request_id = l.batch_id || '-' || l.line)"), {"b": batch_id})).all()}
    finally:
        await db.dispose()


async def test_a_batch_taken_over_by_another_instance_runs_no_line_twice(fresh_pg_database: Any, tmp_path: Path) -> None:
    """Instance A is SIGKILLed mid-batch; instance B, on the same database but its own volume (A's
    ledger journal is not there), takes the batch over and finishes it; then A comes back and its
    journal adds the rows of the lines it had admitted. Each line has one row and one answer: the
    lines A had claimed whose rows were only in its journal are not run again by B (their mark says
    A admitted them; they end `interrupted`), and their rows are A's."""
    from openai import AsyncOpenAI

    url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(url, SECRET)
    env = {"TOLLGATE_BATCH_POLL_SECONDS": "0.2", "TOLLGATE_BATCH_CONCURRENCY": "4", "TOLLGATE_BATCH_LEASE_SECONDS": "3", "TOLLGATE_EMBEDDINGS": "off"}
    a = GatewayProcess(url, tmp_path / "a", admin_key, **env).start()
    b = GatewayProcess(url, tmp_path / "b", admin_key, **env)
    try:
        key = (await a.new_key())["key"]
        client = AsyncOpenAI(base_url=a.base_url + "/v1", api_key=key, max_retries=0, timeout=60)
        uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(TAKEOVER_LINES, max_tokens=3))), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        await client.close()
        deadline = time.monotonic() + 180
        while len(await _rows(url, batch.id)) < 6:
            assert time.monotonic() < deadline, "the batch did not get under way"
            await asyncio.sleep(0.1)
        a.kill()  # SIGKILL: its journal keeps the rows of the lines it had in flight
        unseen = await _claimed_without_rows(url, batch.id)
        assert unseen, "no claimed line's row was left in A's journal at the kill; nothing was tested"

        b.start()
        client = AsyncOpenAI(base_url=b.base_url + "/v1", api_key=key, max_retries=0, timeout=60)
        batch = await _completed(client, batch.id, "instance B did not finish the batch")
        files = [batch.output_file_id, batch.error_file_id]
        answers = [json.loads(x) for f in files if f for x in (await client.files.content(f)).content.splitlines()]
        await client.close()
        b.stop()
        a.start()  # A's journal goes into the ledger
        a.stop()

        rows = await _rows(url, batch.id)
        ids = [r["request_id"] for r in rows]
        assert len(ids) == len(set(ids)), f"{len(ids)} rows for {len(set(ids))} lines: a line ran twice"
        assert set(ids) == {f"{batch.id}-{i}" for i in range(TAKEOVER_LINES)}
        assert sorted(x["custom_id"] for x in answers) == sorted(f"req-{i}" for i in range(TAKEOVER_LINES))
        by_line = {int(x["custom_id"].removeprefix("req-")): x["response"] for x in answers}
        for line in [n for n, admitted in unseen.items() if admitted]:  # admitted on A: not run on B; the row is A's journal's
            assert by_line[line]["status_code"] == 500 and by_line[line]["body"]["error"]["code"] == "interrupted", by_line[line]
        print(f"takeover: {len(unseen)} claimed lines without rows at the kill ({sum(unseen.values())} admitted on A), "
              "none run again on B")
    finally:
        a.stop()
        b.stop()


async def running_batch(db: Any, *custom_ids: str) -> tuple[Any, str, list[Any]]:
    """(the batch store, a new in-progress batch of empty lines with these custom ids, its lines pending)."""
    from billing.batches.store import BatchStore, new_batch_id

    store = BatchStore(db)
    batch_id = new_batch_id()
    now = utcnow()
    await store.create({"id": batch_id, "account_id": 1, "key_id": 1, "api": "openai", "endpoint": "/v1/chat/completions",
                        "completion_window": "24h", "status": "in_progress", "created_at": now, "expires_at": now},
                       [(custom_id, "{}") for custom_id in custom_ids])
    return store, batch_id, await store.pending(batch_id, len(custom_ids))


async def test_a_stalled_runner_cannot_admit_a_line_taken_from_it(fresh_pg_database: Any) -> None:
    """Runner A claims a line and stalls past its lease; runner B takes the batch over and puts the line
    back (never admitted), then claims it itself. A, awake again, cannot mark it admitted (its admission
    is refused before its row), nor put it back, nor end it; B can, and once B has admitted it nobody
    can put it back. A line A had admitted before the takeover is not put back either: B ends it, and
    A cannot overwrite that end."""
    db = create_engine(fresh_pg_database(migrated=True))
    try:
        store, batch_id, (taken, kept) = await running_batch(db, "taken", "kept")
        assert await store.claim(taken, "A") and await store.claim(kept, "A")
        assert await store.admitted(kept, "A")  # A admitted this one before it stalled

        claimed = {line.line: line for line in await store.claimed(batch_id)}  # B's recovery reads the claims
        assert (claimed[0].claimed_by, claimed[0].admitted, claimed[1].admitted) == ("A", False, True)
        assert await store.release(claimed[0], "A")  # never admitted: back to pending
        assert not await store.release(claimed[1], "A")  # admitted: stays claimed (B ends it as interrupted)
        (again,) = await store.pending(batch_id, 2)
        assert await store.claim(again, "B")

        assert not await store.admitted(taken, "A")  # A is awake: the line is B's now
        assert not await store.release(taken, "A")
        assert not await store.finish(taken, "succeeded", 200, "{}", "A")  # nor can A end it
        assert await store.admitted(again, "B")
        assert not await store.admitted(again, "B")  # admitted once
        assert not await store.release(again, "B")  # admitted: never put back
        assert await store.finish(again, "succeeded", 200, '{"by": "B"}', "B")

        assert await store.finish(claimed[1], "errored", 500, '{"by": "B"}', claimed[1].claimed_by)  # B ends A's admitted line
        assert not await store.finish(kept, "succeeded", 200, '{"by": "A"}', "A")  # A, awake, cannot overwrite that end
        assert [(line.state, line.result) for line in await store.lines(batch_id)] == [("done", '{"by": "B"}')] * 2
    finally:
        await db.dispose()


async def test_a_line_admitted_by_the_killed_run_on_this_journal_but_never_journaled_runs_again(fresh_pg_database: Any) -> None:
    """A run killed between marking a line admitted and journaling it leaves the line admitted with no
    row, and none is coming: the restarted process on the same journal has replayed it. Its runner
    knows the killed run's runner id (kept in the journal's directory) and puts such a line back to
    pending, so it runs once and has its one row. A line admitted by another runner (another
    instance's journal) still ends `errored`, its row to come from there. Before, the first also ended
    `errored` with no row: test_a_batch_survives_a_sigkill saw 49 rows for 50 lines in a CI run."""
    from gateway.batches.runner import BatchRunner
    from gateway.config import BatchSettings

    db = create_engine(fresh_pg_database(migrated=True))
    try:
        store, batch_id, (mine, theirs, unmarked) = await running_batch(db, "mine", "theirs", "unmarked")
        for line, runner in ((mine, "killed-run"), (theirs, "other-instance"), (unmarked, "killed-run")):
            assert await store.claim(line, runner)
        assert await store.admitted(mine, "killed-run") and await store.admitted(theirs, "other-instance")

        async def flushed() -> None:
            return None

        runner = BatchRunner(None, store, None, None, BatchSettings(), lowest_class=None, flush=flushed,  # type: ignore[arg-type]
                             runner_id="restarted", previous_run="killed-run")
        assert await runner._recover(batch_id) == 3
        lines = {line.custom_id: line for line in await store.lines(batch_id)}
        assert (lines["mine"].state, lines["mine"].admitted, lines["mine"].claimed_by) == ("pending", False, None)
        assert lines["unmarked"].state == "pending"
        assert (lines["theirs"].state, lines["theirs"].outcome) == ("done", "errored")
        (again, _) = await store.pending(batch_id, 3)
        assert again.custom_id == "mine" and await store.claim(again, "restarted") and await store.admitted(again, "restarted")
    finally:
        await db.dispose()


async def test_a_line_the_killed_run_admitted_and_another_instance_ended_gets_its_one_row(fresh_pg_database: Any) -> None:
    """The killed run marked a line admitted and died before journaling it; another instance took the
    batch over and ended the line `interrupted`, its row to come from the killed run's journal, which
    has none. Before, that line never got a row: test_a_batch_taken_over_by_another_instance_runs_no_line_twice
    saw "line 9 without a row" in a CI run. The restarted runner on that journal sweeps the killed
    run's lines once, in every batch: that line gets its one row (interrupted, nothing used, nothing
    billed), one it marked and nobody ended goes back to pending, another runner's are left alone,
    and sweeping again writes nothing more."""
    from gateway.batches.runner import ADMITTED_ELSEWHERE, BatchRunner
    from gateway.config import BatchSettings

    db = create_engine(fresh_pg_database(migrated=True))
    try:
        store, batch_id, (ended, claimed, theirs, ran) = await running_batch(db, "ended", "claimed", "theirs", "ran")
        _, other_batch, (elsewhere,) = await running_batch(db, "elsewhere")
        for line, runner in ((ended, "killed-run"), (claimed, "killed-run"), (theirs, "other-instance"), (ran, "killed-run"),
                             (elsewhere, "killed-run")):
            assert await store.claim(line, runner) and await store.admitted(line, runner)
        async with db.begin() as conn:  # the body as a real line's: its row names its model
            await conn.execute(sa.text("UPDATE batch_lines SET body = :b WHERE batch_id = :id AND line = 0"),
                               {"b": json.dumps({"model": "tiny-chat", "messages": []}), "id": batch_id})
        from billing.batches.store import Unjournaled
        from gateway.batches.runner import interrupted_row

        (found,) = [f for f in await store.admitted_without_row("killed-run") if f.line.line == 3]
        await store.add_rows([interrupted_row(Unjournaled(found.line, utcnow(), 1, 1, None))])  # `ran`: its row is in the ledger
        for line in (ended, elsewhere):  # instance B's recovery: admitted by a runner whose journal is not there
            (line,) = [x for x in await store.claimed(line.batch_id) if x.line == line.line]
            assert await store.finish(line, "errored", 500, json.dumps(ADMITTED_ELSEWHERE), "killed-run")

        async def flushed() -> None:
            return None

        runner = BatchRunner(None, store, None, None, BatchSettings(), lowest_class=None, flush=flushed,  # type: ignore[arg-type]
                             runner_id="restarted", previous_run="killed-run")
        reopened = await runner.sweep()
        assert [(line.batch_id, line.line) for line in reopened] == [(batch_id, 1)]
        rows = await _rows(db.url.render_as_string(hide_password=False), batch_id) + await _rows(
            db.url.render_as_string(hide_password=False), other_batch)
        assert sorted(r["request_id"] for r in rows) == sorted([f"{batch_id}-0", f"{batch_id}-3", f"{other_batch}-0"])
        async with db.connect() as conn:
            row = (await conn.execute(sa.text(
                "SELECT e.status, e.prompt_tokens, e.completion_tokens, e.cost_nanos, e.api, e.batch_id, e.model, e.account_id, "
                "e.key_id, e.admitted_at = l.admitted_at AS at_mark FROM ledger_entries e JOIN batch_lines l "
                "ON e.request_id = l.batch_id || '-' || l.line WHERE e.request_id = :r"), {"r": f"{batch_id}-0"})).mappings().one()
        assert dict(row) == {"status": "interrupted", "prompt_tokens": 0, "completion_tokens": 0, "cost_nanos": 0, "api": "batch",
                             "batch_id": batch_id, "model": "tiny-chat", "account_id": 1, "key_id": 1, "at_mark": True}
        lines = {line.custom_id: line for line in await store.lines(batch_id)}
        assert (lines["claimed"].state, lines["claimed"].admitted, lines["claimed"].claimed_by) == ("pending", False, None)
        assert (lines["ended"].state, lines["ended"].outcome) == ("done", "errored")  # its answer stays: it was not run
        assert (lines["theirs"].state, lines["theirs"].admitted, lines["theirs"].claimed_by) == ("claimed", True, "other-instance")
        assert await store.admitted_without_row("killed-run") == []

        again = BatchRunner(None, store, None, None, BatchSettings(), lowest_class=None, flush=flushed,  # type: ignore[arg-type]
                            runner_id="restarted-again", previous_run="killed-run")
        assert await again.sweep() == [] and await runner.sweep() == []
        async with db.begin() as conn:  # even one that finds the row gone writes it once
            await conn.execute(sa.text("DELETE FROM ledger_entries WHERE request_id = :r"), {"r": f"{other_batch}-0"})
        (found,) = await store.admitted_without_row("killed-run")
        row = interrupted_row(found)
        assert await store.add_rows([row, row]) == 1 and await store.add_rows([row]) == 0
        async with db.connect() as conn:
            counts = dict((await conn.execute(sa.text(
                "SELECT request_id, count(*) FROM ledger_entries GROUP BY request_id"))).all())
        assert counts == {f"{batch_id}-0": 1, f"{batch_id}-3": 1, f"{other_batch}-0": 1}
    finally:
        await db.dispose()


async def test_a_sweep_that_failed_runs_again_and_never_twice_at_once(fresh_pg_database: Any) -> None:
    """The sweep's flush failing (the database is out) leaves it to run again at the next call (the
    next round, a batch's recovery); two calls at once run it once."""
    from gateway.batches.runner import BatchRunner
    from gateway.config import BatchSettings

    db = create_engine(fresh_pg_database(migrated=True))
    try:
        store, batch_id, (line,) = await running_batch(db, "one")
        assert await store.claim(line, "killed-run") and await store.admitted(line, "killed-run")
        flushes = []

        async def flush() -> None:
            flushes.append(1)
            if len(flushes) == 1:
                raise ConnectionError("the database is out")
            await asyncio.sleep(0.05)  # the other call comes meanwhile

        runner = BatchRunner(None, store, None, None, BatchSettings(), lowest_class=None, flush=flush,  # type: ignore[arg-type]
                             runner_id="restarted", previous_run="killed-run")
        with pytest.raises(ConnectionError):
            await runner.sweep()
        assert [(x.state, x.admitted) for x in await store.lines(batch_id)] == [("claimed", True)]
        first, second = await asyncio.gather(runner.sweep(), runner.sweep())
        assert len(flushes) == 2 and [x.line for x in first + second] == [0]
        assert [(x.state, x.admitted) for x in await store.lines(batch_id)] == [("pending", False)]
        assert await runner._recover(batch_id) == 0 and len(flushes) == 2  # swept once: nothing more to do
    finally:
        await db.dispose()
