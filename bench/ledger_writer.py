"""How many ledger rows per second the LedgerWriter sustains into Postgres (batched inserts).

A fresh Postgres database at the head migration; a producer records UsageRecords (spread over
50 keys and 3 models, so the hourly aggregates see realistic fan-out) in bursts, yielding to
the event loop between bursts as request handlers would; the writer drains them in batches
(one statement per batch: `INSERT ... ON CONFLICT DO NOTHING RETURNING` and the aggregate upserts
of the rows it inserted, as data-modifying CTEs). rows/s = rows / (first record -> flush done); the rows are then counted in the database.
With --journal, each record() also appends to the local journal as the gateway does by default.
Each round runs the gateway's insert (one `INSERT ... SELECT FROM unnest(arrays)` per batch) and,
for comparison in the same run, SQLAlchemy's executemany insert it replaced (`--no-compare` skips it).
`--copy N` adds, in the same rounds, the binary COPY path (billing/ledger_copy.py: COPY into a staging
table and one insert + aggregates statement, on N connections at once, batches of --copy-batch-size):
the ledger is partitioned by month (migration 0012), the journal on as the gateway has it, and after
the run the hourly aggregates are checked to equal sums over the ledger.

    python bench/ledger_writer.py --rows 100000 --batch-size 1000 --rounds 3 --journal --copy 2 --no-compare
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import fresh_database  # noqa: E402
from billing.db import create_engine  # noqa: E402
from billing import ledger  # noqa: E402
from billing.ledger import LedgerWriter, UsageRecord  # noqa: E402
from billing.migrate import upgrade  # noqa: E402

TARGET = 20_000
MODELS = ("mock", "llama-3-8b", "qwen-7b")


def records(n: int, run: str) -> list[UsageRecord]:
    return [
        UsageRecord(
            request_id=f"{run}-{i}", account_id=1 + i % 10, key_id=1 + i % 50, model=MODELS[i % 3],
            prompt_tokens=12, completion_tokens=16, status="completed", finish_reason="stop",
            total_ms=1.5 + i % 7, ttft_ms=0.8, cost_nanos=11_400,
        )
        for i in range(n)
    ]


async def one_round(database_url: str, rows: int, batch_size: int, burst: int, journal_dir: Path | None,
                    copy_connections: int = 0) -> float:
    engine = create_engine(database_url)
    journal = None
    if journal_dir is not None:
        from billing.journal import LedgerJournal

        journal = LedgerJournal(journal_dir / uuid.uuid4().hex)
    writer = LedgerWriter(engine, batch_size=batch_size, journal=journal, copy_connections=copy_connections)
    if journal is not None:
        writer.recover()
    writer.start()
    batch = records(rows, uuid.uuid4().hex[:12])
    lsn = await wal_position(database_url)
    started = time.perf_counter()
    for i in range(0, rows, burst):
        for r in batch[i : i + burst]:
            writer.record(r)
        await asyncio.sleep(0)  # request handlers interleave with the writer
    await writer.flush(timeout=600)
    elapsed = time.perf_counter() - started
    WAL_PER_ROW.setdefault(copy_connections, []).append((await wal_position(database_url) - lsn) / rows)
    await writer.close()
    await engine.dispose()
    if writer.write_errors:
        raise SystemExit(f"{writer.write_errors} failed batch writes")
    return rows / elapsed


WAL_PER_ROW: dict[int, list[float]] = {}  # per path (copy connections; 0: today's), bytes of WAL per row each round


async def wal_position(database_url: str) -> int:
    """Postgres' WAL insert position in bytes (the whole cluster's: other databases' writes count too)."""
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        return int(await conn.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')"))
    finally:
        await conn.close()


async def count_rows(database_url: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM ledger_entries"))
    finally:
        await conn.close()


async def aggregates_exact(database_url: str) -> bool:
    """The hourly aggregates equal sums over the ledger, per hour, account, key and model."""
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        differ = await conn.fetchval(
            "SELECT count(*) FROM (SELECT date_trunc('hour', admitted_at) AS hour, account_id, key_id, model, count(*) AS requests, "
            "sum(prompt_tokens) AS p, sum(completion_tokens) AS c, coalesce(sum(cost_nanos), 0) AS n FROM ledger_entries "
            "GROUP BY 1, 2, 3, 4) l FULL JOIN usage_hourly u USING (hour, account_id, key_id, model) "
            "WHERE l.requests IS DISTINCT FROM u.requests OR l.p IS DISTINCT FROM u.prompt_tokens "
            "OR l.c IS DISTINCT FROM u.completion_tokens OR l.n IS DISTINCT FROM u.cost_nanos")
        return int(differ) == 0
    finally:
        await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=1000, help="LedgerWriter batch_size (the gateway's default: 1000)")
    parser.add_argument("--burst", type=int, default=200, help="rows recorded between event-loop yields")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--journal", action="store_true", help="also append every row to a local journal, as the gateway does")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="also time SQLAlchemy's executemany insert in each round (default on)")
    parser.add_argument("--copy", type=int, default=0, metavar="N",
                        help="also time the binary COPY path on N connections in each round (billing/ledger_copy.py)")
    parser.add_argument("--copy-batch-size", type=int, default=5000)
    parser.add_argument("--json", default="bench/results/ledger_writer.json")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    rates: list[float] = []
    before: list[float] = []
    copied: list[float] = []
    with fresh_database() as db, tempfile.TemporaryDirectory(prefix="ledger-bench-") as tmp:
        upgrade(db)
        for i in range(args.rounds):
            journal = Path(tmp) if args.journal else None
            ledger.PG_ARRAY_INSERT = True
            rate = asyncio.run(one_round(db, args.rows, args.batch_size, args.burst, journal))
            rates.append(rate)
            line = f"round {i + 1}: {args.rows} rows in {args.rows / rate:6.2f} s = {rate:9,.0f} rows/s"
            if args.compare:
                ledger.PG_ARRAY_INSERT = False
                old = asyncio.run(one_round(db, args.rows, args.batch_size, args.burst, journal))
                before.append(old)
                line += f"; executemany {old:9,.0f} rows/s ({rate / old:.2f}x)"
            if args.copy:
                fast = asyncio.run(one_round(db, args.rows, args.copy_batch_size, args.burst, journal, copy_connections=args.copy))
                copied.append(fast)
                line += f"; COPY x{args.copy} {fast:9,.0f} rows/s ({fast / rate:.2f}x)"
            print(line, flush=True)
        in_db = asyncio.run(count_rows(db))
        exact = asyncio.run(aggregates_exact(db))
    median = statistics.median(rates)
    expected = args.rounds * args.rows * (1 + bool(args.compare) + bool(args.copy))
    print(f"\nLedgerWriter into Postgres, batch {args.batch_size}{', journal on' if args.journal else ''}: "
          f"median {median:,.0f} rows/s (target >= {TARGET:,}: {'PASS' if median >= TARGET else 'FAIL'}); "
          f"rows in the database {in_db:,} of {expected:,} ({'ok' if in_db == expected else 'MISSING'}); shared machine")
    print(f"hourly aggregates == sums over the ledger: {'yes' if exact else 'NO'}")
    for path, wal in sorted(WAL_PER_ROW.items()):
        print(f"WAL per row ({f'COPY x{path}' if path else 'one INSERT'}): min {min(wal):,.0f} bytes over {len(wal)} rounds "
              "(the cluster's WAL: other databases' writes in the same window count too)")
    if copied:
        fast = statistics.median(copied)
        print(f"binary COPY on {args.copy} connections, batch {args.copy_batch_size}: median {fast:,.0f} rows/s "
              f"(target >= 100,000: {'PASS' if fast >= 100_000 else 'FAIL'}); ratio of medians to today's path {fast / median:.2f}x")
    if before:
        print(f"executemany (before): median {statistics.median(before):,.0f} rows/s; "
              f"ratio of medians {median / statistics.median(before):.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "rows_per_s_median": median, "rounds": rates, "executemany_rounds": before, "rows": args.rows, "batch_size": args.batch_size,
        "journal": args.journal, "rows_in_db": in_db, "expected_rows": expected, "aggregates_exact": exact,
        "copy_connections": args.copy, "copy_batch_size": args.copy_batch_size, "copy_rounds": copied,
        "wal_bytes_per_row": {str(k): v for k, v in WAL_PER_ROW.items()}}, indent=2))


if __name__ == "__main__":
    main()
