"""How many ledger rows per second the LedgerWriter sustains into Postgres (batched inserts).

A fresh Postgres database at the head migration; a producer records UsageRecords (spread over
50 keys and 3 models, so the hourly aggregates see realistic fan-out) in bursts, yielding to
the event loop between bursts as request handlers would; the writer drains them in batches
(one statement per batch: `INSERT ... ON CONFLICT DO NOTHING RETURNING` and the aggregate upserts
of the rows it inserted, as data-modifying CTEs). rows/s = rows / (first record -> flush done); the rows are then counted in the database.
With --journal, each record() also appends to the local journal as the gateway does by default.
Each round runs the gateway's insert (one `INSERT ... SELECT FROM unnest(arrays)` per batch) and,
for comparison in the same run, SQLAlchemy's executemany insert it replaced (`--no-compare` skips it).
`--copy N` adds, in the same rounds, the binary COPY path (billing/ledger/pg_copy.py: COPY into a staging
table and one insert + aggregates statement, on N connections at once, batches of --copy-batch-size):
the ledger is partitioned by month (migration 0012), the journal on as the gateway has it, and after
the run the hourly aggregates are checked to equal sums over the ledger.

`--copy N` times two COPY variants in each round: the exact path alone (COPY into a staging table, then
INSERT ... ON CONFLICT into the ledger: what the COPY path was before) and the fast path (COPY straight
into the month's partition, the aggregates summed here; the exact path only for a part with a row
already in the ledger). `--ceiling` also times Postgres alone: COPY of the same rows, encoded before
the clock starts, into the partition with no aggregates and no Python work, on the same connections:
the most any client could get from this Postgres on this machine at that moment.
Every figure has the 1-minute load average beside it, and CPU seconds per row of this process and
of the Postgres backends that served the round (from /proc: same machine only), so a loaded
machine's figures can be read as CPU cost.

    python bench/ledger_writer.py --rows 100000 --batch-size 1000 --rounds 3 --journal --copy 2 --no-compare --ceiling
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import fresh_database  # noqa: E402
from billing.db import create_engine  # noqa: E402
from billing.ledger import writer as ledger, pg_copy as ledger_copy  # noqa: E402
from billing.ledger.writer import LedgerWriter, UsageRecord  # noqa: E402
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
                    copy_connections: int = 0, path: str = "insert") -> float:
    engine = create_engine(database_url)
    journal = None
    if journal_dir is not None:
        from billing.ledger.journal import LedgerJournal

        journal = LedgerJournal(journal_dir / uuid.uuid4().hex)
    writer = LedgerWriter(engine, batch_size=batch_size, journal=journal, copy_connections=copy_connections)
    if journal is not None:
        writer.recover()
    writer.start()
    batch = records(rows, uuid.uuid4().hex[:12])
    lsn = await wal_position(database_url)
    backends_before = await backend_cpu(database_url)
    cpu = time.process_time()
    started = time.perf_counter()
    for i in range(0, rows, burst):
        for r in batch[i : i + burst]:
            writer.record(r)
        await asyncio.sleep(0)  # request handlers interleave with the writer
    await writer.flush(timeout=600)
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu
    backends = await backend_cpu(database_url)
    pg_cpu = sum(t - backends_before.get(pid, 0.0) for pid, t in backends.items())
    WAL_PER_ROW.setdefault(path, []).append((await wal_position(database_url) - lsn) / rows)
    CPU_PER_ROW.setdefault(path, []).append((cpu / rows * 1e6, pg_cpu / rows * 1e6))
    await writer.close()
    await engine.dispose()
    if writer.write_errors:
        raise SystemExit(f"{writer.write_errors} failed batch writes")
    return rows / elapsed


WAL_PER_ROW: dict[str, list[float]] = {}  # per path, bytes of WAL per row each round
CPU_PER_ROW: dict[str, list[tuple[float, float]]] = {}  # per path, (this process, Postgres backends) CPU us per row
TICK = os.sysconf("SC_CLK_TCK")


async def backend_cpu(database_url: str) -> dict[int, float]:
    """CPU seconds (user + system) so far of every Postgres backend connected to this database but
    the one asking, read from /proc (Postgres runs on this machine)."""
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        pids = await conn.fetch("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
    finally:
        await conn.close()
    out = {}
    for (pid,) in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / TICK
    return out


async def ceiling(database_url: str, rows: int, connections: int) -> float:
    """Postgres alone: the same rows as binary COPY data made before the clock starts, copied into
    this month's partition on `connections` connections at once, one transaction each; no aggregates."""
    import asyncpg

    batch = records(rows, uuid.uuid4().hex[:12])
    table = ledger_copy._month_partition([{"hour": batch[0].admitted_at}])
    assert table is not None
    conns = [await asyncpg.connect(database_url) for _ in range(connections)]
    try:
        names = ledger_copy._NAMES
        await conns[0].execute(f"CREATE TEMP TABLE encode (LIKE {ledger.LEDGER.name} INCLUDING DEFAULTS)")
        size = -(-rows // connections)
        datas = []
        for i in range(0, rows, size):  # asyncpg encodes, Postgres hands the binary COPY data back
            await conns[0].copy_records_to_table("encode", records=list(map(ledger_copy._ROW, batch[i:i + size])), columns=names)
            out = io.BytesIO()
            await conns[0].copy_from_query(f"SELECT {', '.join(names)} FROM encode", output=out, format="binary")
            await conns[0].execute("TRUNCATE encode")
            datas.append(out.getvalue())
        before = {pid: t for pid, t in (await backend_cpu(database_url)).items()}

        async def one(conn: Any, data: bytes) -> None:
            async with conn.transaction():
                await conn.copy_to_table(table, schema_name="ledger_partitions", source=io.BytesIO(data), columns=names, format="binary")

        started = time.perf_counter()
        await asyncio.gather(*(one(c, d) for c, d in zip(conns, datas)))
        elapsed = time.perf_counter() - started
        after = await backend_cpu(database_url)
        CPU_PER_ROW.setdefault("ceiling", []).append((0.0, sum(t - before.get(p, 0.0) for p, t in after.items()) / rows * 1e6))
        # These rows have no aggregates: they go again, so the exactness check covers the writers' rows.
        await conns[0].execute(f"DELETE FROM ledger_partitions.{table} WHERE request_id LIKE $1", batch[0].request_id.split("-")[0] + "-%")
        return rows / elapsed
    finally:
        for c in conns:
            await c.close()


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


def _load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def _median_cpu(path: str) -> str:
    cpu = CPU_PER_ROW.get(path, [])
    if not cpu:
        return ""
    return (f"CPU per row: this process {statistics.median(c for c, _ in cpu):.1f} us, "
            f"Postgres backends {statistics.median(p for _, p in cpu):.1f} us (medians)")


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
                        help="also time both binary COPY paths on N connections in each round (billing/ledger/pg_copy.py)")
    parser.add_argument("--copy-batch-size", type=int, default=5000)
    parser.add_argument("--ceiling", action="store_true", help="also time Postgres alone: COPY of pre-encoded rows (needs --copy)")
    parser.add_argument("--json", default="bench/results/ledger_writer.json")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    rates: list[float] = []
    before: list[float] = []
    staged: list[float] = []
    copied: list[float] = []
    ceilings: list[float] = []
    loads: list[float] = []
    with fresh_database() as db, tempfile.TemporaryDirectory(prefix="ledger-bench-") as tmp:
        upgrade(db)
        for i in range(args.rounds):
            journal = Path(tmp) if args.journal else None
            ledger.PG_ARRAY_INSERT = True
            rate = asyncio.run(one_round(db, args.rows, args.batch_size, args.burst, journal))
            rates.append(rate)
            line = f"round {i + 1}: one INSERT {rate:9,.0f} rows/s ({_load()})"
            if args.compare:
                ledger.PG_ARRAY_INSERT = False
                old = asyncio.run(one_round(db, args.rows, args.batch_size, args.burst, journal, path="executemany"))
                before.append(old)
                line += f"; executemany {old:9,.0f} rows/s ({_load()})"
                ledger.PG_ARRAY_INSERT = True
            if args.copy:
                ledger_copy.FAST_PATH = False
                slow = asyncio.run(one_round(db, args.rows, args.copy_batch_size, args.burst, journal,
                                             copy_connections=args.copy, path="copy-staged"))
                staged.append(slow)
                line += f"; COPY via staging x{args.copy} {slow:9,.0f} rows/s ({_load()})"
                ledger_copy.FAST_PATH = True
                fast = asyncio.run(one_round(db, args.rows, args.copy_batch_size, args.burst, journal,
                                             copy_connections=args.copy, path="copy-direct"))
                copied.append(fast)
                line += f"; COPY direct x{args.copy} {fast:9,.0f} rows/s ({_load()})"
                if args.ceiling:
                    top = asyncio.run(ceiling(db, args.rows, args.copy))
                    ceilings.append(top)
                    line += f"; Postgres alone {top:9,.0f} rows/s ({_load()})"
            loads.append(os.getloadavg()[0])
            print(line, flush=True)
        in_db = asyncio.run(count_rows(db))
        exact = asyncio.run(aggregates_exact(db))
    median = statistics.median(rates)
    expected = args.rounds * args.rows * (1 + bool(args.compare) + 2 * bool(args.copy))  # the ceiling's rows are deleted
    print(f"\nshared machine, load average {min(loads):.1f}-{max(loads):.1f} over the rounds; journal {'on' if args.journal else 'off'}")
    print(f"today's path, one INSERT ... unnest per {args.batch_size} rows: median {median:,.0f} rows/s "
          f"(target >= {TARGET:,}: {'PASS' if median >= TARGET else 'FAIL'}); {_median_cpu('insert')}")
    print(f"rows in the database {in_db:,} of {expected:,} ({'ok' if in_db == expected else 'MISSING'}); "
          f"hourly aggregates == sums over the ledger: {'yes' if exact else 'NO'}")
    if before:
        print(f"executemany (before): median {statistics.median(before):,.0f} rows/s; {_median_cpu('executemany')}")
    if staged:
        print(f"COPY via the staging table (the exact path alone) on {args.copy} connections, batch {args.copy_batch_size}: "
              f"median {statistics.median(staged):,.0f} rows/s; {_median_cpu('copy-staged')}")
    if copied:
        fast = statistics.median(copied)
        print(f"COPY straight into the partition on {args.copy} connections, batch {args.copy_batch_size}: median {fast:,.0f} rows/s "
              f"(target >= 100,000: {'PASS' if fast >= 100_000 else 'FAIL'}); {fast / median:.2f}x today's path; {_median_cpu('copy-direct')}")
    if ceilings:
        print(f"Postgres alone (COPY of pre-encoded rows, no aggregates, no Python): median {statistics.median(ceilings):,.0f} rows/s; "
              f"{_median_cpu('ceiling')}")
    for path, wal in sorted(WAL_PER_ROW.items()):
        print(f"WAL per row ({path}): min {min(wal):,.0f}, median {statistics.median(wal):,.0f} bytes over {len(wal)} rounds "
              "(the cluster's WAL: other databases' writes in the same window count too)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "rows_per_s_median": median, "rounds": rates, "executemany_rounds": before, "rows": args.rows, "batch_size": args.batch_size,
        "journal": args.journal, "rows_in_db": in_db, "expected_rows": expected, "aggregates_exact": exact,
        "copy_connections": args.copy, "copy_batch_size": args.copy_batch_size, "copy_staged_rounds": staged,
        "copy_direct_rounds": copied, "postgres_alone_rounds": ceilings, "load_average_1m": loads,
        "cpu_us_per_row": {k: v for k, v in CPU_PER_ROW.items()},
        "wal_bytes_per_row": {str(k): v for k, v in WAL_PER_ROW.items()}}, indent=2))


if __name__ == "__main__":
    main()
