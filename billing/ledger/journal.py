"""The ledger journal: an append-only local file between `LedgerWriter.record()` and the database.

Every line is one JSON object, written with one `os.write` before the call returns (so a killed
process loses nothing the kernel has seen) and fsync'd in batches by a background thread (so a
machine crash loses at most one fsync interval):

    {"a": row, "h": hold}   admitted: the request's provisional row (status interrupted) and quota hold
    {"f": row}              final: the row to insert (resolves the admission with the same request_id)
    {"k": [request_id...]}  acknowledged: these rows are in the database

On start (`open()`), rows of earlier runs that were never acknowledged are replayed, and admissions
that never got a final row become `interrupted` rows; the database's unique request_id makes the
replay exactly once. Segments rotate: a new segment starts with everything still outstanding, then
the old ones are deleted. One process per journal directory (an exclusive lock).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import uuid
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from billing.periodic import PeriodicThread

log = logging.getLogger("tollgate.journal")

SEGMENT_PREFIX = "ledger-"
SEGMENT_SUFFIX = ".jsonl"


class JournalLocked(RuntimeError):
    """Another process holds this journal directory."""


@dataclass
class Recovered:
    """What a start found in the journal of earlier runs."""

    replayed: list[dict[str, Any]] = field(default_factory=list)  # final rows never acknowledged
    interrupted: list[tuple[dict[str, Any], dict[str, Any] | None]] = field(default_factory=list)  # (row, hold)
    segments: int = 0
    torn_lines: int = 0


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, default=_default, option=orjson.OPT_APPEND_NEWLINE)  # the line without another copy


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(type(value).__name__)


class RunNotes:
    """Lines a run notes in its journal's directory (the quota groups it registers in), for the run
    after it: `previous` is what the run before noted, and the file starts empty. A note is one
    append, in the page cache at once: a SIGKILL right after it keeps it. Never raises."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.previous = {line for line in path.read_text().splitlines() if line}
        except OSError:
            self.previous = set()
        try:
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        except OSError as exc:
            log.warning("could not keep notes in %s: %s", path, type(exc).__name__)
            self._fd = None

    def note(self, line: str) -> None:
        if self._fd is not None:
            try:
                os.write(self._fd, line.encode() + b"\n")
            except OSError as exc:
                log.warning("could not note in %s: %s", self.path, type(exc).__name__)

    def close(self, clear: bool) -> None:
        """`clear`: a clean shutdown, nothing left for the next run to look at."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                if clear:
                    os.ftruncate(fd, 0)
                os.close(fd)
            except OSError as exc:
                log.warning("could not close %s: %s", self.path, type(exc).__name__)


class LedgerJournal:
    def __init__(self, directory: Path, *, fsync_interval: float = 0.05, segment_bytes: int = 16 << 20) -> None:
        self.directory = Path(directory)
        self.fsync_interval = fsync_interval
        self.segment_bytes = segment_bytes
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._seq = 0
        self._size = 0
        self._admitted: dict[str, bytes] = {}  # request_id -> its "a" line, until a final row is written
        self._unacked: dict[str, bytes] = {}  # request_id -> its "f" line, until the database has it
        self._outstanding_bytes = 0  # the two maps' line lengths, kept as they change (not summed per batch)
        self._dirty = threading.Event()
        self._fd_lock = threading.Lock()  # the fsync thread against rotation and close
        # A thread, not a task: fsync blocks for milliseconds, and record() on the event loop must
        # never wait for the disk. A round starts once a line is written (`_dirty`), after the
        # group-commit window, so one fsync covers everything written in it.
        self.fsyncer = PeriodicThread("ledger-journal-fsync", self._fsync, on_error=self._fsync_failed,
                                      wake=self._dirty, delay=fsync_interval)
        self.write_errors = 0
        self.fsyncs = 0

    # start and stop ---------------------------------------------------------------------------
    def open(self) -> Recovered:
        """Locks the directory, reads earlier segments, and starts a fresh one holding what is
        still outstanding (replayed rows and interrupted rows, as finals not yet acknowledged)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / "journal.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise JournalLocked(f"another gateway process uses the ledger journal in {self.directory}") from None
        old = self._segments()
        recovered = self._read(old)
        self._seq = max((self._seq_of(p) for p in old), default=0)
        for row in recovered.replayed:
            self._unacked[row["request_id"]] = _dumps({"f": row})
        for row, _hold in recovered.interrupted:
            self._unacked[row["request_id"]] = _dumps({"f": row})
        self._outstanding_bytes = sum(map(len, self._unacked.values())) + sum(map(len, self._admitted.values()))
        self._rotate()
        self.fsyncer.start()
        return recovered

    def close(self) -> None:
        self.fsyncer.stop()
        with self._fd_lock:
            if self._fd is not None:
                try:
                    os.fsync(self._fd)
                finally:
                    os.close(self._fd)
                self._fd = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def run_ids(self, name: str) -> tuple[str, str | None]:
        """A new id for this run under `name` (the quota store's registration, the batch runner) and
        the one the previous run on this journal had: one process holds the directory at a time, so
        that run is over and its rows are replayed here."""
        path = self.directory / name
        try:
            previous: str | None = path.read_text().strip() or None
        except OSError:
            previous = None
        current = uuid.uuid4().hex
        try:
            path.write_text(current)
        except OSError as exc:
            log.warning("could not keep the %s id in %s: %s", name, path, type(exc).__name__)
        return current, previous

    def run_notes(self, name: str) -> "RunNotes":
        """This run's notes under `name` (the quota groups it registers in), with the previous run's."""
        return RunNotes(self.directory / name)

    # writing (event loop thread; never raises) -------------------------------------------------
    def admitted(self, record: Any, hold: dict[str, Any] | None) -> None:
        """An admitted request's provisional row (a UsageRecord, status `interrupted`) and its hold."""
        line = _dumps({"a": fields_of(record), "h": hold})
        rid = record.request_id
        old = self._admitted.get(rid)
        self._admitted[rid] = line
        self._outstanding_bytes += len(line) - (len(old) if old is not None else 0)
        self._append(line)

    def final(self, record: Any) -> None:
        """A request's final row (a UsageRecord), to be acknowledged once it is in the database."""
        line = _dumps({"f": fields_of(record)})
        rid = record.request_id
        gone = self._admitted.pop(rid, None)
        old = self._unacked.get(rid)
        self._unacked[rid] = line
        self._outstanding_bytes += len(line) - (len(gone) if gone is not None else 0) - (len(old) if old is not None else 0)
        self._append(line)

    def acknowledged(self, request_ids: list[str]) -> None:
        freed = 0
        unacked = self._unacked
        for rid in request_ids:
            line = unacked.pop(rid, None)
            if line is not None:
                freed += len(line)
        self._outstanding_bytes -= freed
        self._append(_dumps({"k": request_ids}))
        if self._size >= self.segment_bytes and self._size >= 4 * self.outstanding_bytes:
            self._rotate()

    @property
    def outstanding(self) -> int:
        """Rows the database does not have yet plus requests admitted and not finished."""
        return len(self._unacked) + len(self._admitted)

    @property
    def outstanding_bytes(self) -> int:
        return self._outstanding_bytes

    def _append(self, line: bytes) -> None:
        if self._fd is None:
            return
        try:
            written = os.write(self._fd, line)
            if written != len(line):  # a short write to a regular file means the disk is full
                raise OSError(f"short write ({written} of {len(line)} bytes)")
            self._size += written
            if not self._dirty.is_set():  # set() takes the event's lock each time; most appends find it set
                self._dirty.set()
        except OSError as exc:
            self.write_errors += 1
            log.error("ledger journal write failed (row kept in memory only): %s", exc)

    # segments -----------------------------------------------------------------------------------
    def _segments(self) -> list[Path]:
        found = [p for p in self.directory.glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}") if self._seq_of(p) >= 0]
        return sorted(found, key=self._seq_of)

    @staticmethod
    def _seq_of(path: Path) -> int:
        digits = path.name[len(SEGMENT_PREFIX): -len(SEGMENT_SUFFIX)]
        return int(digits) if digits.isdigit() else -1

    def _rotate(self) -> None:
        """A new segment with everything outstanding, made durable, then the older segments go."""
        self._seq += 1
        path = self.directory / f"{SEGMENT_PREFIX}{self._seq:08d}{SEGMENT_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        body = b"".join([*self._unacked.values(), *self._admitted.values()])
        if body:
            os.write(fd, body)
        os.fsync(fd)
        self._fsync_directory()
        with self._fd_lock:
            previous, self._fd, self._size = self._fd, fd, len(body)
            if previous is not None:
                os.close(previous)
        for old in self._segments():
            if old != path:
                old.unlink()
        self._fsync_directory()

    def _fsync_directory(self) -> None:
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _fsync(self) -> None:
        with self._fd_lock:
            if self._fd is not None:
                os.fsync(self._fd)
                self.fsyncs += 1

    def _fsync_failed(self, exc: Exception) -> None:  # counted with the failed appends; the next write fsyncs again
        self.write_errors += 1
        log.error("ledger journal fsync failed: %s", exc)

    # reading --------------------------------------------------------------------------------------
    def _read(self, segments: list[Path]) -> Recovered:
        admitted: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {}
        finals: dict[str, dict[str, Any]] = {}
        acked: set[str] = set()
        recovered = Recovered(segments=len(segments))
        for path in segments:
            for raw in path.read_bytes().splitlines():
                try:
                    entry = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    recovered.torn_lines += 1  # a line cut by a machine crash: its request was never answered
                    continue
                if "a" in entry:
                    admitted.setdefault(entry["a"]["request_id"], (entry["a"], entry.get("h")))
                elif "f" in entry:
                    finals.setdefault(entry["f"]["request_id"], entry["f"])
                elif "k" in entry:
                    acked.update(entry["k"])
        recovered.replayed = [row for rid, row in finals.items() if rid not in acked]
        recovered.interrupted = [(row, hold) for rid, (row, hold) in admitted.items() if rid not in finals and rid not in acked]
        return recovered


def fields_of(record: Any) -> dict[str, Any]:
    """A UsageRecord's fields to journal, without copying: the journal encodes them into its line
    at once and keeps no reference."""
    values = getattr(record, "__dict__", None)
    return values if values is not None else asdict(record)


def record_fields(row: dict[str, Any], cls: type) -> Any:
    """A journal row back into `cls` (UsageRecord), ignoring fields a newer version may have added."""
    names = {f.name for f in fields(cls)}
    values = {k: v for k, v in row.items() if k in names}
    for name in ("created_at", "admitted_at"):
        if isinstance(values.get(name), str):
            values[name] = datetime.fromisoformat(values[name])
    return cls(**values)
