"""The ledger journal on its own and under the writer: what survives a crash, replay exactly once,
interrupted admissions, rotation, torn lines, one process per directory, the backlog policy."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from billing import migrate
from billing.db import create_engine
from billing.ledger.journal import JournalLocked, LedgerJournal
from billing.ledger.writer import LedgerWriter, UsageRecord, release_interrupted, write_records
from billing.quota.limits import Limits
from billing.quota import Hold, Scope


def record(**overrides: Any) -> UsageRecord:
    fields = dict(
        request_id=uuid.uuid4().hex, account_id=1, key_id=1, model="m", prompt_tokens=10,
        completion_tokens=5, status="completed", finish_reason="stop", total_ms=12.5, cost_nanos=70,
    )
    fields.update(overrides)
    return UsageRecord(**fields)  # type: ignore[arg-type]


def crash(journal: LedgerJournal) -> None:
    """What SIGKILL leaves: the file as written (no fsync, no close bookkeeping), the lock gone."""
    journal.fsyncer.stop()
    for fd in (journal._fd, journal._lock_fd):
        if fd is not None:
            os.close(fd)
    journal._fd = journal._lock_fd = None


def test_unacknowledged_rows_and_unfinished_admissions_come_back(tmp_path: Path) -> None:
    j = LedgerJournal(tmp_path)
    assert j.open().replayed == []
    done, written, running = record(), record(), record(status="interrupted", completion_tokens=0)
    hold = {"request_id": running.request_id, "scopes": [["key", 1]], "tokens": 99, "nanos": 5, "minute": 1, "month": "202611"}
    for r in (done, written):
        j.admitted(record(request_id=r.request_id, status="interrupted"), None)
        j.final(r)
    j.acknowledged([written.request_id])
    j.admitted(running, hold)
    crash(j)

    again = LedgerJournal(tmp_path)
    recovered = again.open()
    assert [r["request_id"] for r in recovered.replayed] == [done.request_id]
    assert recovered.replayed[0]["completion_tokens"] == 5
    assert [(row["request_id"], row["status"], h) for row, h in recovered.interrupted] == [(running.request_id, "interrupted", hold)]
    # The new segment carries both as rows to write; the old segment is gone.
    assert len(list(tmp_path.glob("ledger-*.jsonl"))) == 1
    assert again.outstanding == 2
    again.acknowledged([done.request_id, running.request_id])
    again.close()
    third = LedgerJournal(tmp_path)
    recovered = third.open()
    assert recovered.replayed == [] and recovered.interrupted == []  # acknowledged: nothing to do twice
    third.close()


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    j = LedgerJournal(tmp_path)
    j.open()
    r = record()
    j.final(r)
    crash(j)
    segment = next(tmp_path.glob("ledger-*.jsonl"))
    with open(segment, "ab") as fh:
        fh.write(b'{"f": {"request_id": "cut-in-the-midd')
    again = LedgerJournal(tmp_path)
    recovered = again.open()
    assert [x["request_id"] for x in recovered.replayed] == [r.request_id] and recovered.torn_lines == 1
    again.close()


def test_one_process_per_directory(tmp_path: Path) -> None:
    j = LedgerJournal(tmp_path)
    j.open()
    with pytest.raises(JournalLocked):
        LedgerJournal(tmp_path).open()
    j.close()
    LedgerJournal(tmp_path).open()  # free again once closed


def test_segments_rotate_and_keep_only_outstanding_rows(tmp_path: Path) -> None:
    j = LedgerJournal(tmp_path, segment_bytes=4096)
    j.open()
    pending = record()
    j.final(pending)
    for _ in range(200):
        r = record()
        j.final(r)
        j.acknowledged([r.request_id])
    segments = list(tmp_path.glob("ledger-*.jsonl"))
    assert len(segments) == 1 and segments[0].stat().st_size < 4 * 4096  # rotated, old segments deleted
    crash(j)
    recovered = LedgerJournal(tmp_path).open()
    assert [x["request_id"] for x in recovered.replayed] == [pending.request_id]


def test_lines_are_fsynced_in_batches(tmp_path: Path) -> None:
    j = LedgerJournal(tmp_path, fsync_interval=0.05)
    j.open()
    for _ in range(500):
        j.final(record())
    end = time.monotonic() + 5
    while j.fsyncs == 0:
        assert time.monotonic() < end, "the fsync thread never ran"
        time.sleep(0.01)
    assert j.fsyncs < 50  # 500 rows: a handful of group commits, not one per row
    j.close()


def test_a_failed_fsync_is_counted_and_the_fsync_thread_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only an OSError: whatever one round raises, later lines are still fsync'd."""
    real_fsync = os.fsync
    failed: list[int] = []

    def fsync_once_broken(fd: int) -> None:
        if not failed:
            failed.append(fd)
            raise ValueError("a bad descriptor")
        real_fsync(fd)

    j = LedgerJournal(tmp_path, fsync_interval=0.01)
    j.open()
    monkeypatch.setattr("billing.ledger.journal.os.fsync", fsync_once_broken)
    j.final(record())
    end = time.monotonic() + 5
    while j.write_errors == 0:
        assert time.monotonic() < end, "the failed fsync was not reported"
        time.sleep(0.01)
    assert isinstance(j.fsyncer.pulse.last_error, ValueError) and j.fsyncs == 0
    j.final(record())
    while j.fsyncs == 0:
        assert time.monotonic() < end, "the fsync thread stopped after a failed round"
        time.sleep(0.01)
    assert j.fsyncer.alive and j.write_errors == 1
    j.close()
    assert not j.fsyncer.alive


async def count(db: Any, **where: Any) -> int:
    clause = " AND ".join(f"{k} = :{k}" for k in where) or "1=1"
    async with db.connect() as conn:
        return int((await conn.execute(sa.text(f"SELECT count(*) FROM ledger_entries WHERE {clause}"), where)).scalar_one())


async def test_writer_replays_a_crashed_run_exactly_once(fresh_pg_database: Any, tmp_path: Path) -> None:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        first = LedgerWriter(db, journal=LedgerJournal(tmp_path))
        first.recover()
        first.start()
        landed = [record() for _ in range(5)]
        for r in landed:
            first.record(r)
        await first.flush(timeout=10)
        # Rows the database got but whose acknowledgement the crash lost, rows it never got, one in flight.
        lost_ack = record()
        first.journal.final(lost_ack)  # type: ignore[union-attr]
        await write_records(db, [lost_ack])
        unwritten = [record() for _ in range(3)]
        for r in unwritten:
            first.journal.final(r)  # type: ignore[union-attr]
        in_flight = record(status="interrupted", completion_tokens=0, prompt_tokens=17, cost_nanos=17)
        hold = Hold(in_flight.request_id, (Scope("key", 1, Limits()), Scope("account", 1, Limits())), 40, 9, 1, "202611")
        first.admitted(in_flight, hold.to_json())
        first._task.cancel()  # type: ignore[union-attr]
        crash(first.journal)  # type: ignore[arg-type]
        if first._session is not None:  # the crashed process's database connection goes with it
            await first._session.close(broken=True)

        second = LedgerWriter(db, journal=LedgerJournal(tmp_path))
        recovered = second.recover()
        assert len(recovered.replayed) == 4 and len(recovered.interrupted) == 1
        second.start()
        settled: list[tuple[Hold, int, int]] = []

        async def settle(h: Hold, tokens: int, nanos: int) -> bool:
            settled.append((h, tokens, nanos))
            return True

        assert await release_interrupted(second, settle, recovered, wait=10) == 1
        assert await count(db) == 5 + 1 + 3 + 1  # each request once: no duplicate, none lost
        assert await count(db, request_id=in_flight.request_id, status="interrupted", prompt_tokens=17) == 1
        [(h, tokens, nanos)] = settled
        assert (h.request_id, [s.name for s in h.scopes], h.tokens, tokens, nanos) == (in_flight.request_id, ["k1", "a1"], 40, 17, 17)
        await second.close()
        third = LedgerWriter(db, journal=LedgerJournal(tmp_path))
        assert third.recover().replayed == []  # all acknowledged now
        await third.close()
    finally:
        await db.dispose()


async def test_backlog_policy_refuses_only_when_set(tmp_path: Path) -> None:
    db = create_engine(f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}")  # never reachable
    try:
        keep = LedgerWriter(db, journal=None, max_backlog=0, max_backoff=0.1)
        refuse = LedgerWriter(db, journal=None, max_backlog=3, max_backoff=0.1)
        for writer in (keep, refuse):
            writer.start()
            for _ in range(4):
                writer.record(record())
        await asyncio.sleep(0.2)
        assert keep.backlog == 4 and not keep.refusing
        assert refuse.backlog == 4 and refuse.refusing
        for writer in (keep, refuse):
            await writer.close(timeout=0.2)
    finally:
        await db.dispose()


async def test_a_journal_no_worker_claims_is_finished_and_removed(fresh_pg_database: Any, tmp_path: Path) -> None:
    """A server that ran with more workers left `journal-3`: a worker of the smaller server writes its
    rows, releases its interrupted holds, and removes it (billing.ledger.writer.adopt_journal)."""
    from billing.ledger.writer import adopt_journal
    from gateway.app import orphan_journals
    from gateway.config import HttpSettings, Settings

    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        for name in ("journal", "journal-1", "journal-3", "journal-x"):
            (tmp_path / name).mkdir()
        assert orphan_journals(Settings(data_dir=tmp_path, http=HttpSettings(workers=2))) == [tmp_path / "journal-3"]
        assert orphan_journals(Settings(data_dir=tmp_path, http=HttpSettings(workers=4))) == []

        gone = LedgerJournal(tmp_path / "journal-3")
        gone.open()
        unwritten = [record() for _ in range(3)]
        for r in unwritten:
            gone.final(r)
        in_flight = record(status="interrupted", completion_tokens=0, prompt_tokens=11, cost_nanos=11)
        hold = Hold(in_flight.request_id, (Scope("key", 1, Limits()),), 30, 5, 1, "202611")
        gone.admitted(in_flight, hold.to_json())
        crash(gone)

        live = LedgerJournal(tmp_path / "journal-1")
        live.open()  # a running worker's journal is never taken
        writer = LedgerWriter(db, journal=LedgerJournal(tmp_path / "journal"))
        writer.recover()
        writer.start()
        settled: list[tuple[str, int]] = []

        async def settle(h: Hold, tokens: int, nanos: int) -> bool:
            settled.append((h.request_id, tokens))
            return True

        assert await adopt_journal(writer, settle, tmp_path / "journal-1") is False and (tmp_path / "journal-1").is_dir()
        assert await adopt_journal(writer, settle, tmp_path / "journal-3", wait=10) is True
        assert not (tmp_path / "journal-3").exists()
        assert await count(db) == 4 and await count(db, request_id=in_flight.request_id, status="interrupted") == 1
        assert settled == [(in_flight.request_id, 11)]
        live.close()
        await writer.close()
    finally:
        await db.dispose()


async def test_a_rotation_keeps_the_admissions_still_running(fresh_pg_database: Any, tmp_path: Path) -> None:
    """A segment rotated (written rows acknowledged) while a request runs carries its admission line,
    and only its: a crash after the rotation leaves its `interrupted` row and releases its hold once,
    and no finished request comes back as interrupted (its hold released a second time)."""
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        first = LedgerWriter(db, journal=LedgerJournal(tmp_path, segment_bytes=4096))
        first.recover()
        first.start()
        running = record(status="interrupted", completion_tokens=0, prompt_tokens=23, cost_nanos=23)
        hold = Hold(running.request_id, (Scope("key", 1, Limits()),), 50, 9, 1, "202611")
        first.admitted(running, hold.to_json())
        for _ in range(40):  # admitted, finished and acknowledged around it, one batch each: the segment rotates
            done = record()
            first.admitted(record(request_id=done.request_id, status="interrupted", completion_tokens=0), None)
            first.record(done)
            await first.flush(timeout=10)
        assert first.journal._seq > 1  # type: ignore[union-attr]  # rotated at least once since open()
        assert first.journal.outstanding == 1  # type: ignore[union-attr]  # the running request only
        first._task.cancel()  # type: ignore[union-attr]
        crash(first.journal)  # type: ignore[arg-type]
        if first._session is not None:
            await first._session.close(broken=True)

        second = LedgerWriter(db, journal=LedgerJournal(tmp_path))
        recovered = second.recover()
        assert [(row["request_id"], h) for row, h in recovered.interrupted] == [(running.request_id, hold.to_json())]
        second.start()
        settled: list[tuple[str, int]] = []

        async def settle(h: Hold, tokens: int, nanos: int) -> bool:
            settled.append((h.request_id, tokens))
            return True

        assert await release_interrupted(second, settle, recovered, wait=10) == 1
        assert settled == [(running.request_id, 23)]
        assert await count(db) == 41 and await count(db, request_id=running.request_id, status="interrupted") == 1
        await second.close()
    finally:
        await db.dispose()
