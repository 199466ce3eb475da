"""The ledger's table, unique key and one-statement Postgres batch: the SQL that both ledger writers'
Postgres paths use (billing/ledger/writer.py's array insert, billing/ledger/pg_copy.py's COPY staging).
"""

from __future__ import annotations

from billing.models import LedgerEntry
from billing.ledger.aggregates import COUNTS, HOURLY, LATENCY, SUMS

LEDGER = LedgerEntry.__table__


# The ledger's unique key: the request id and its admission instant, Postgres' partition key
# (billing/ledger/partitions.py: why that is still one row per request).
CONFLICT_KEY = ["request_id", "admitted_at"]


# Postgres: the whole batch as one array per column, one statement and one round trip; the
# driver binds 22 arrays instead of SQLAlchemy processing every row's parameters (the executemany
# path ran ~14k rows/s, this one several times that: bench/ledger_writer.py).
PG_COLUMNS = (
    ("request_id", "text"), ("account_id", "int4"), ("key_id", "int4"), ("model", "text"), ("prompt_tokens", "int4"),
    ("completion_tokens", "int4"), ("status", "text"), ("finish_reason", "text"), ("total_ms", "float8"),
    ("queue_ms", "float8"), ("ttft_ms", "float8"), ("estimated", "bool"), ("cost_nanos", "int8"), ("cached", "bool"), ("api", "text"),
    ("cached_tokens", "int4"), ("batch_id", "text"), ("postpaid", "bool"),
    ("price_version_id", "int4"), ("override_id", "int4"),
    ("created_at", "timestamptz"), ("admitted_at", "timestamptz"),
)
# The insert, together with what the rows it inserted add to the aggregates: one statement, so one round trip
# and no explicit transaction (a statement is atomic) instead of BEGIN, the insert, an upsert per
# aggregate table and COMMIT. The aggregates sum the insert's RETURNING, so a row already in the
# ledger (a replayed journal) adds nothing, as `add_to_aggregates` would have it. Hours and
# histogram buckets come computed (billing.ledger.aggregates's functions) as four more arrays, by request id.
_PG_ADDED = {  # what a group of new rows adds to each column of the hourly table
    "requests": "count(*)", "prompt_tokens": "sum(prompt_tokens)", "completion_tokens": "sum(completion_tokens)",
    "cost_nanos": "coalesce(sum(cost_nanos), 0)", "unpriced": "count(*) FILTER (WHERE cost_nanos IS NULL)",
    "errors": "count(*) FILTER (WHERE status IN ('error', 'interrupted'))",
    "cancelled": "count(*) FILTER (WHERE status = 'cancelled')", "ttft_count": "count(ttft_ms)",
    "total_ms_sum": "coalesce(sum(total_ms), 0)", "ttft_ms_sum": "coalesce(sum(ttft_ms), 0)",
    "cached_tokens": "coalesce(sum(cached_tokens), 0)",
}
_ADDED = COUNTS + SUMS  # KeyError at import if the table gains a column this statement does not fill
_N = len(PG_COLUMNS)
PG_BATCH = (
    f"WITH ins AS (INSERT INTO {LEDGER.name} ({', '.join(c for c, _ in PG_COLUMNS)}) "
    f"SELECT * FROM unnest({', '.join(f'${i}::{t}[]' for i, (_, t) in enumerate(PG_COLUMNS, 1))}) "
    f"ON CONFLICT ({', '.join(CONFLICT_KEY)}) DO NOTHING "
    "RETURNING request_id, account_id, key_id, model, prompt_tokens, completion_tokens, status, total_ms, ttft_ms, cost_nanos, cached_tokens), "
    f"fresh AS (SELECT ins.*, d.hour, d.total_bucket, d.ttft_bucket FROM ins JOIN unnest(${_N + 1}::text[], "
    f"${_N + 2}::timestamptz[], ${_N + 3}::int2[], ${_N + 4}::int2[]) AS d(request_id, hour, total_bucket, ttft_bucket) "
    "USING (request_id)), "
    f"usage AS (INSERT INTO {HOURLY.name} (hour, account_id, key_id, model, {', '.join(_ADDED)}) "
    f"SELECT hour, account_id, key_id, model, {', '.join(_PG_ADDED[c] for c in _ADDED)} FROM fresh "
    "GROUP BY hour, account_id, key_id, model ORDER BY hour, account_id, key_id, model "  # one lock order in every writer
    "ON CONFLICT (hour, account_id, key_id, model) DO UPDATE SET "
    f"{', '.join(f'{c} = {HOURLY.name}.{c} + EXCLUDED.{c}' for c in _ADDED)} RETURNING 1), "
    # After `usage`, as every writer takes them (the COPY fast path's upserts too): the CTEs of one
    # statement run in no set order, and two writers taking the two tables in opposite orders
    # deadlock. The one-time filter reads `usage` to its end before this insert takes a row.
    f"latency AS (INSERT INTO {LATENCY.name} (hour, model, metric, bucket, count) "
    "SELECT hour, model, metric, bucket, count(*) FROM (SELECT hour, model, 'total' AS metric, total_bucket AS bucket FROM fresh "
    "UNION ALL SELECT hour, model, 'ttft', ttft_bucket FROM fresh WHERE ttft_ms IS NOT NULL) AS m "
    "WHERE (SELECT count(*) FROM usage) >= 0 "
    "GROUP BY hour, model, metric, bucket ORDER BY hour, model, metric, bucket "
    f"ON CONFLICT (hour, model, metric, bucket) DO UPDATE SET count = {LATENCY.name}.count + EXCLUDED.count) "
    "SELECT count(*) FROM ins"
)
