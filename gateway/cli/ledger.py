"""`tollgate ledger ...`: the ledger's monthly partitions on Postgres (billing/ledger/partitions.py).

    tollgate ledger partitions [--rows] [--json]          each partition: month, attached, rows
    tollgate ledger create-partitions [--ahead N]         this month's and N more (the server does it hourly)
    tollgate ledger archive --before YYYY-MM --to DIR [--drop]
        closed months before YYYY-MM: rows to DIR/<partition>.csv.gz, partition detached (dropped
        with --drop); refused while one of those months is not closed (invoices issued)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from billing.ledger import partitions
from billing.db import create_engine
from billing.models import utcnow
from billing.invoices.periods import InvalidPeriod, Period
from gateway.cli import bounded
from gateway.config import Settings


def _run(settings: Settings, work: Any) -> Any:
    async def run() -> Any:
        db = create_engine(settings.resolved_database_url)
        try:
            return await work(db)
        finally:
            await db.dispose()

    return asyncio.run(run())


def _not_partitioned(settings: Settings) -> int:
    print("error: the ledger is not partitioned here (SQLite keeps one table; on Postgres run tollgate migrate)", file=sys.stderr)
    return 1


def cmd_partitions(settings: Settings, args: argparse.Namespace) -> int:
    found = _run(settings, lambda db: partitions.partitions(db, count_rows=args.rows))
    if not found:
        return _not_partitioned(settings)
    rows = [{"name": p.name, "month": str(p.period) if p.period else "default", "attached": p.attached, "rows": p.rows} for p in found]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:<32} {r['month']:<8} {'attached' if r['attached'] else 'detached':<9}"
                  + (f" {r['rows']:>12,} rows" if r["rows"] is not None else ""))
    return 0


def cmd_create(settings: Settings, args: argparse.Namespace) -> int:
    async def create(db: Any) -> Any:
        async with db.connect() as conn:
            if not await partitions.is_partitioned(conn):
                return None
        return await partitions.ensure_ahead(db, utcnow(), args.ahead)

    made = _run(settings, create)
    if made is None:
        return _not_partitioned(settings)
    print("created: " + (", ".join(made) if made else "nothing (all there)"))
    return 0


def cmd_archive(settings: Settings, args: argparse.Namespace) -> int:
    try:
        before = Period.parse(args.before)
    except InvalidPeriod as exc:
        print(f"error: --before: {exc}", file=sys.stderr)
        return 2
    try:
        done = _run(settings, lambda db: partitions.archive(db, before, Path(args.to), drop=args.drop))
    except partitions.ArchiveRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for a in done:
        print(f"{a.name}: {a.rows} rows -> {a.file}; detached{' and dropped' if a.dropped else ''}")
    if not done:
        print(f"nothing to archive before {before}")
    return 0


def register(sub: Any) -> None:
    ledger = sub.add_parser("ledger", help="the ledger's monthly partitions (Postgres)").add_subparsers(
        dest="action", required=True, metavar="ACTION")
    p_list = ledger.add_parser("partitions", help="list the partitions")
    p_list.add_argument("--rows", action="store_true", help="count each partition's rows (a scan)")
    p_list.add_argument("--json", action="store_true")
    p_list.set_defaults(func=cmd_partitions)
    p_create = ledger.add_parser("create-partitions", help="create this month's partition and the next ones")
    p_create.add_argument("--ahead", type=bounded(0, 120, "a number of months"), default=partitions.AHEAD_MONTHS,
                          help="months after this one (default 3; at most 120)")
    p_create.set_defaults(func=cmd_create)
    p_archive = ledger.add_parser("archive", help="copy closed months' partitions to files and detach them")
    p_archive.add_argument("--before", required=True, help="archive the months before this one, YYYY-MM")
    p_archive.add_argument("--to", required=True, help="directory for the .csv.gz files")
    p_archive.add_argument("--drop", action="store_true", help="drop the detached partitions (else kept, detached)")
    p_archive.set_defaults(func=cmd_archive)
