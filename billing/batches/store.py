"""Batches and their lines in the database: what the Batch API's routes and its runner read and write.

A line goes pending -> claimed -> done. `claim()` is a conditional update (one winner per line on
any number of runners), which names the runner; `admitted()` marks it admitted for that runner only,
before its ledger row is journaled; `finish()` stores its answer; `release()` puts back a line that
was never admitted (it has no ledger row, so it may run later) and only then; both, and
`finish()`, act only on the claim of the runner they name. `admitted_without_row()` finds the lines
a runner marked admitted that have no ledger row (the sweep of a killed run's lines), and
`add_rows()` writes their rows through the ledger's own idempotent insert.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.batches.models import Batch, BatchLine
from billing.ledger.records import UsageRecord
from billing.ledger.writer import write_records
from billing.models import LedgerEntry, utcnow

BATCHES = Batch.__table__
LINES = BatchLine.__table__
LEDGER = LedgerEntry.__table__
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


class LeaseHeld(RuntimeError):
    """Another runner drives this batch now."""


def matchable(*values: str | None) -> bool:
    """Whether these ids, cursors or filters from a caller could name a row: none holds a NUL (no id
    or name made here has one, and Postgres refuses one in a text parameter, failing the query), so
    a value with one is answered as one that names nothing, without asking the database."""
    return not any(v and "\x00" in v for v in values)


def past(query: Any, table: sa.Table, cursor: str, *scope: Any, newer: bool) -> Any:
    """`query` (of `table`) narrowed to the rows past the one `cursor` names, in (created_at, id)
    order (two rows of one instant are still told apart): the newer ones or the older ones. A cursor
    naming no row within `scope` leaves none."""
    at = sa.select(table.c.created_at, table.c.id).where(table.c.id == cursor, *scope).subquery()
    row, mark = sa.tuple_(table.c.created_at, table.c.id), sa.tuple_(at.c.created_at, at.c.id)
    return query.join(at, row > mark if newer else row < mark)


def new_batch_id(prefix: str = "batch_") -> str:
    return prefix + secrets.token_hex(12)


def line_request_id(batch_id: str, line: int) -> str:
    """A line's request id, and so its ledger row's: one per line, whatever runs it."""
    return f"{batch_id}-{line}"


@dataclass(frozen=True)
class Line:
    batch_id: str
    line: int
    custom_id: str
    body: str
    state: str
    outcome: str | None
    status_code: int | None
    result: str | None
    claimed_by: str | None = None  # the runner that claimed it
    admitted: bool = False  # marked admitted by that runner (its row journaled there, or about to be)

    @property
    def request_id(self) -> str:
        return line_request_id(self.batch_id, self.line)


@dataclass(frozen=True)
class Unjournaled:
    """A line a runner marked admitted and that has no ledger row, with what a row of it needs."""

    line: Line
    admitted_at: datetime  # its mark's instant
    account_id: int  # the batch's
    key_id: int
    batch_model: str | None  # the model an OpenAI batch's lines name (None: an Anthropic batch, or an older one)


def _line(row: Any) -> Line:
    return Line(row.batch_id, row.line, row.custom_id, row.body, row.state, row.outcome, row.status_code, row.result,
                row.claimed_by, row.admitted_at is not None)


def _claimed_by(runner_id: str | None) -> Any:
    """A line's claim is this runner's (None: a claim made before lines named their runner)."""
    return LINES.c.claimed_by.is_(None) if runner_id is None else LINES.c.claimed_by == runner_id


def aware(value: datetime | None) -> datetime | None:
    """A time read back from the database, in UTC (SQLite's come back without their zone)."""
    return value if value is None or value.tzinfo else value.replace(tzinfo=utcnow().tzinfo)


class BatchStore:
    def __init__(self, db: AsyncEngine) -> None:
        self._db = db

    async def create(self, values: dict[str, Any], lines: list[tuple[str, str]]) -> dict[str, Any]:
        """A batch and its lines (custom_id, body JSON), in one transaction."""
        async with self._db.begin() as conn:
            await conn.execute(BATCHES.insert().values(**values, total=len(lines)))
            if lines:
                await conn.execute(LINES.insert(), [
                    {"batch_id": values["id"], "line": i, "custom_id": cid, "body": body, "state": "pending"}
                    for i, (cid, body) in enumerate(lines)])
        found = await self.get(values["id"])
        assert found is not None
        return found

    async def get(self, batch_id: str, account_id: int | None = None) -> dict[str, Any] | None:
        if not matchable(batch_id):
            return None
        query = sa.select(BATCHES).where(BATCHES.c.id == batch_id)
        if account_id is not None:
            query = query.where(BATCHES.c.account_id == account_id)
        async with self._db.connect() as conn:
            row = (await conn.execute(query)).mappings().first()
        return None if row is None else {k: aware(v) if isinstance(v, datetime) else v for k, v in row.items()}

    async def list(self, account_id: int, api: str, *, limit: int = 20, after: str | None = None,
                   before: str | None = None) -> list[dict[str, Any]]:
        """An account's batches of `api`, newest first: those after the batch `after` names (older
        than it), or the `limit` just before the batch `before` names (newer than it, nearest it
        first taken); a cursor naming no batch of the account's gives none."""
        if not matchable(after, before):
            return []  # as for any cursor naming no batch
        mine = (BATCHES.c.account_id == account_id, BATCHES.c.api == api)
        query = sa.select(BATCHES.c.id).where(*mine)
        if after or before:
            query = past(query, BATCHES, after or before, *mine, newer=before is not None)  # type: ignore[arg-type]
        order = (BATCHES.c.created_at, BATCHES.c.id)
        query = query.order_by(*(order if before else [c.desc() for c in order])).limit(limit)
        async with self._db.connect() as conn:
            ids = list((await conn.execute(query)).scalars())
        if before:
            ids.reverse()
        return [b for b in [await self.get(i) for i in ids] if b is not None]

    async def delete(self, batch_id: str, account_id: int) -> bool | None:
        """Deletes an ended batch and its lines (their ledger rows stay: billed is billed). None: no
        such batch of the account's; False: it has not ended."""
        async with self._db.begin() as conn:
            status = (await conn.execute(sa.select(BATCHES.c.status).where(
                BATCHES.c.id == batch_id, BATCHES.c.account_id == account_id).with_for_update())).scalar()
            if status is None:
                return None
            if status in ACTIVE:
                return False
            await conn.execute(LINES.delete().where(LINES.c.batch_id == batch_id))
            await conn.execute(BATCHES.delete().where(BATCHES.c.id == batch_id))
        return True

    async def active(self) -> list[str]:
        async with self._db.connect() as conn:
            return list((await conn.execute(
                sa.select(BATCHES.c.id).where(BATCHES.c.status.in_(ACTIVE)).order_by(BATCHES.c.created_at))).scalars())

    async def move(self, batch_id: str, status: str, *, from_: tuple[str, ...], **values: Any) -> bool:
        """Sets the status (and `<status>_at`) when the batch is in one of `from_`; whether it was."""
        stamp = {f"{status}_at": utcnow()} if f"{status}_at" in BATCHES.c else {}
        async with self._db.begin() as conn:
            done = await conn.execute(BATCHES.update().where(BATCHES.c.id == batch_id, BATCHES.c.status.in_(from_))
                                      .values(status=status, **stamp, **values))
        return bool(done.rowcount)

    async def lease(self, batch_id: str, runner_id: str, seconds: float) -> str | None:
        """Takes or renews the batch for `runner_id` for `seconds`, unless another runner's lease
        still holds. Returns the runner that held it before (None: nobody, or this one), or raises
        LeaseHeld."""
        now = utcnow()
        async with self._db.begin() as conn:
            before = (await conn.execute(sa.select(BATCHES.c.runner_id).where(BATCHES.c.id == batch_id))).scalar()
            done = await conn.execute(BATCHES.update().where(
                BATCHES.c.id == batch_id,
                sa.or_(BATCHES.c.runner_id.is_(None), BATCHES.c.runner_id == runner_id, BATCHES.c.lease_until < now),
            ).values(runner_id=runner_id, lease_until=now + timedelta(seconds=seconds)))
        if not done.rowcount:
            raise LeaseHeld(batch_id)
        return None if before == runner_id else before

    async def unlease(self, batch_id: str, runner_id: str) -> None:
        """Lets go of the batch at once (a clean shutdown): the next runner need not wait for the lease."""
        async with self._db.begin() as conn:
            await conn.execute(BATCHES.update().where(BATCHES.c.id == batch_id, BATCHES.c.runner_id == runner_id)
                               .values(lease_until=utcnow()))

    async def pending(self, batch_id: str, limit: int) -> list[Line]:
        async with self._db.connect() as conn:
            rows = (await conn.execute(sa.select(LINES).where(LINES.c.batch_id == batch_id, LINES.c.state == "pending")
                                       .order_by(LINES.c.line).limit(limit))).all()
        return [_line(r) for r in rows]

    async def claim(self, line: Line, runner_id: str) -> bool:
        """Takes a pending line for this runner, durably, before it runs; False: another took it."""
        async with self._db.begin() as conn:
            done = await conn.execute(LINES.update().where(
                LINES.c.batch_id == line.batch_id, LINES.c.line == line.line, LINES.c.state == "pending",
            ).values(state="claimed", claimed_at=utcnow(), claimed_by=runner_id, admitted_at=None))
        return bool(done.rowcount)

    async def admitted(self, line: Line, runner_id: str) -> bool:
        """Marks the line admitted, before its row is journaled; False: it is not this runner's claim
        any more (a runner that took the batch over put it back, or ended it), and must not run."""
        async with self._db.begin() as conn:
            done = await conn.execute(LINES.update().where(
                LINES.c.batch_id == line.batch_id, LINES.c.line == line.line, LINES.c.state == "claimed",
                LINES.c.claimed_by == runner_id, LINES.c.admitted_at.is_(None),
            ).values(admitted_at=utcnow()))
        return bool(done.rowcount)

    async def release(self, line: Line, runner_id: str | None) -> bool:
        """Puts back the line `runner_id` claimed, unless it was admitted; whether it did."""
        async with self._db.begin() as conn:
            done = await conn.execute(LINES.update().where(
                LINES.c.batch_id == line.batch_id, LINES.c.line == line.line, LINES.c.state == "claimed",
                _claimed_by(runner_id), LINES.c.admitted_at.is_(None),
            ).values(state="pending", claimed_at=None, claimed_by=None))
        return bool(done.rowcount)

    async def reopen(self, line: Line, runner_id: str) -> bool:
        """Puts back a line `runner_id` claimed and marked admitted but never journaled (its process was
        killed in between, so it never ran and has no row); whether it did."""
        async with self._db.begin() as conn:
            done = await conn.execute(LINES.update().where(
                LINES.c.batch_id == line.batch_id, LINES.c.line == line.line, LINES.c.state == "claimed",
                LINES.c.claimed_by == runner_id, LINES.c.admitted_at.is_not(None),
            ).values(state="pending", claimed_at=None, claimed_by=None, admitted_at=None))
        return bool(done.rowcount)

    async def finish(self, line: Line, outcome: str, status_code: int | None, result: str | None, runner_id: str | None) -> bool:
        """Ends the line `runner_id` claimed with its answer; False: it is not that runner's claim
        (another runner took the batch over and ended it meanwhile: its end stays)."""
        async with self._db.begin() as conn:
            done = await conn.execute(LINES.update().where(
                LINES.c.batch_id == line.batch_id, LINES.c.line == line.line, LINES.c.state == "claimed", _claimed_by(runner_id),
            ).values(state="done", outcome=outcome, status_code=status_code, result=result, done_at=utcnow()))
        return bool(done.rowcount)

    async def end_pending(self, batch_id: str, outcome: str) -> int:
        """Every line not yet claimed ends with `outcome` (expired, canceled); how many."""
        async with self._db.begin() as conn:
            done = await conn.execute(LINES.update().where(LINES.c.batch_id == batch_id, LINES.c.state == "pending")
                                      .values(state="done", outcome=outcome, done_at=utcnow()))
        return int(done.rowcount or 0)

    async def claimed(self, batch_id: str) -> list[Line]:
        async with self._db.connect() as conn:
            rows = (await conn.execute(sa.select(LINES).where(LINES.c.batch_id == batch_id, LINES.c.state == "claimed"))).all()
        return [_line(r) for r in rows]

    async def admitted_without_row(self, runner_id: str) -> list[Unjournaled]:
        """Every line `runner_id` marked admitted that has no ledger row, in any batch and state
        (claimed, or ended by a runner that took its batch over): one query, on
        ix_batch_lines_admitted_by and the ledger's unique key."""
        row = sa.select(LEDGER.c.request_id).where(LEDGER.c.request_id == LINES.c.batch_id + "-" + sa.cast(LINES.c.line, sa.String))
        query = (sa.select(LINES, BATCHES.c.account_id, BATCHES.c.key_id, BATCHES.c.model.label("batch_model"))
                 .join(BATCHES, BATCHES.c.id == LINES.c.batch_id)
                 .where(LINES.c.claimed_by == runner_id, LINES.c.admitted_at.is_not(None), ~sa.exists(row))
                 .order_by(LINES.c.batch_id, LINES.c.line))
        async with self._db.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [Unjournaled(_line(r), aware(r.admitted_at), r.account_id, r.key_id, r.batch_model) for r in rows]  # type: ignore[arg-type]

    async def add_rows(self, records: list[UsageRecord]) -> int:
        """Writes ledger rows as the ledger's writer does (a row with the same request id and
        admitted_at already there stays as it is, the aggregates count only new ones); how many were new."""
        return await write_records(self._db, records)

    async def lines(self, batch_id: str) -> list[Line]:
        async with self._db.connect() as conn:
            rows = (await conn.execute(sa.select(LINES).where(LINES.c.batch_id == batch_id).order_by(LINES.c.line))).all()
        return [_line(r) for r in rows]

    async def counts(self, batch_id: str) -> dict[str, int]:
        """Lines per state, and done lines per outcome (`done:<outcome>`)."""
        query = sa.select(LINES.c.state, LINES.c.outcome, sa.func.count()).where(LINES.c.batch_id == batch_id).group_by(
            LINES.c.state, LINES.c.outcome)
        out: dict[str, int] = {}
        async with self._db.connect() as conn:
            for state, outcome, n in (await conn.execute(query)).all():
                out[state] = out.get(state, 0) + int(n)
                if state == "done":
                    out[f"done:{outcome}"] = int(n)
        return out

    async def tokens(self, batch: dict[str, Any]) -> dict[str, int] | None:
        """The tokens of the batch's lines' ledger rows written so far (prompt, completion, cached);
        None for a batch with no line."""
        if not batch["total"]:
            return None
        async with self._db.connect() as conn:
            tokens = (await conn.execute(sa.select(
                sa.func.coalesce(sa.func.sum(LEDGER.c.prompt_tokens), 0), sa.func.coalesce(sa.func.sum(LEDGER.c.completion_tokens), 0),
                sa.func.coalesce(sa.func.sum(LEDGER.c.cached_tokens), 0),
            ).where(LEDGER.c.batch_id == batch["id"], LEDGER.c.admitted_at >= batch["created_at"]))).one()  # ix_ledger_batch
        return {"prompt": int(tokens[0]), "completion": int(tokens[1]), "cached": int(tokens[2])}

    async def in_ledger(self, request_ids: list[str]) -> dict[str, str]:
        """Which of these requests have a ledger row (ran, at least in part), and the row's status."""
        if not request_ids:
            return {}
        async with self._db.connect() as conn:
            rows = await conn.execute(sa.select(LEDGER.c.request_id, LEDGER.c.status).where(LEDGER.c.request_id.in_(request_ids)))
            return {request_id: status for request_id, status in rows}
