"""ledger_partitioning: ledger_entries range-partitioned by month of admitted_at on Postgres

Postgres: today's table is renamed aside, a partitioned `ledger_entries` with the same columns
(LIKE ... INCLUDING DEFAULTS: the id sequence goes on) is created, with one partition per month from
the oldest row's month to three months ahead in the `ledger_partitions` schema and a DEFAULT
partition, the rows are copied over (one INSERT ... SELECT) and the old table is dropped. A unique
key on a partitioned table must hold the partition key: `(request_id, admitted_at)`, and the
primary key is `(id, admitted_at)` (billing/ledger/partitions.py says why that is still one row per request).

SQLite stays one table; its unique key becomes the same `(request_id, admitted_at)` so that every
writer has one conflict target.

Revision ID: 0012_ledger_partitioning
Revises: 0011_billing_details
Create Date: 2026-12-02
"""

from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0012_ledger_partitioning"
down_revision = "0011_billing_details"
branch_labels = None
depends_on = None

SCHEMA = "ledger_partitions"  # frozen copies of billing/ledger/partitions.py's names as of this revision
OLD = "ledger_entries_unpartitioned"
INDEXES = (
    ("ix_ledger_account_created", "account_id, created_at"),
    ("ix_ledger_account_admitted", "account_id, admitted_at"),
    ("ix_ledger_entries_key_id", "key_id"),
)
AHEAD = 3
UNNAMED_UNIQUE = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def _month(year: int, month: int) -> datetime:
    return datetime(year + (month - 1) // 12, (month - 1) % 12 + 1, 1, tzinfo=timezone.utc)


def _months(first: datetime, last: datetime) -> list[datetime]:
    out, index = [], first.year * 12 + first.month - 1
    while True:
        start = _month(index // 12, index % 12 + 1)
        if start > last:
            return out
        out.append(start)
        index += 1


def _upgrade_postgres() -> None:
    bind = op.get_bind()
    op.execute(f"ALTER TABLE ledger_entries RENAME TO {OLD}")
    for name in [r[0] for r in bind.execute(sa.text("SELECT indexname FROM pg_indexes WHERE tablename = :t"), {"t": OLD})]:
        op.execute(f"ALTER INDEX {name} RENAME TO {name}_old")
    op.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
    op.execute(f"CREATE TABLE ledger_entries (LIKE {OLD} INCLUDING DEFAULTS) PARTITION BY RANGE (admitted_at)")
    op.execute("ALTER TABLE ledger_entries ADD CONSTRAINT ledger_entries_pkey PRIMARY KEY (id, admitted_at)")
    op.execute("ALTER TABLE ledger_entries ADD CONSTRAINT uq_ledger_request_admitted UNIQUE (request_id, admitted_at)")
    for name, columns in INDEXES:
        op.execute(f"CREATE INDEX {name} ON ledger_entries ({columns})")
    op.execute("ALTER SEQUENCE ledger_entries_id_seq OWNED BY ledger_entries.id")
    now = datetime.now(timezone.utc)
    oldest = bind.execute(sa.text(f"SELECT min(admitted_at) FROM {OLD}")).scalar() or now
    ahead = now.year * 12 + now.month - 1 + AHEAD
    for start in _months(min(oldest, now), _month(ahead // 12, ahead % 12 + 1)):
        end = _month(start.year, start.month + 1)
        op.execute(f"CREATE TABLE {SCHEMA}.ledger_entries_{start.year:04d}_{start.month:02d} PARTITION OF ledger_entries "
                   f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')")
    op.execute(f"CREATE TABLE {SCHEMA}.ledger_entries_default PARTITION OF ledger_entries DEFAULT")
    op.execute(f"INSERT INTO ledger_entries SELECT * FROM {OLD}")
    op.execute(f"DROP TABLE {OLD}")


def _downgrade_postgres() -> None:
    """Back to one table with every row still attached (archived partitions are not brought back)."""
    op.execute("ALTER TABLE ledger_entries RENAME TO ledger_entries_partitioned")
    for name in ("ledger_entries_pkey", "uq_ledger_request_admitted", *(n for n, _ in INDEXES)):
        op.execute(f"ALTER INDEX {name} RENAME TO {name}_p")
    op.execute("CREATE TABLE ledger_entries (LIKE ledger_entries_partitioned INCLUDING DEFAULTS)")
    op.execute("INSERT INTO ledger_entries SELECT * FROM ledger_entries_partitioned")
    op.execute("ALTER SEQUENCE ledger_entries_id_seq OWNED BY ledger_entries.id")
    op.execute("DROP TABLE ledger_entries_partitioned")  # its attached partitions go with it
    op.execute(f"DROP SCHEMA {SCHEMA} CASCADE")  # and detached ones kept there
    op.execute("ALTER TABLE ledger_entries ADD CONSTRAINT ledger_entries_pkey PRIMARY KEY (id)")
    op.execute("ALTER TABLE ledger_entries ADD CONSTRAINT ledger_entries_request_id_key UNIQUE (request_id)")
    for name, columns in INDEXES:
        op.execute(f"CREATE INDEX {name} ON ledger_entries ({columns})")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _upgrade_postgres()
        return
    # 0001 made request_id's unique constraint without a name: the convention names it as reflected.
    with op.batch_alter_table("ledger_entries", naming_convention=UNNAMED_UNIQUE) as batch:
        batch.drop_constraint("uq_ledger_entries_request_id", type_="unique")
        batch.create_unique_constraint("uq_ledger_request_admitted", ["request_id", "admitted_at"])


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _downgrade_postgres()
        return
    with op.batch_alter_table("ledger_entries") as batch:
        batch.drop_constraint("uq_ledger_request_admitted", type_="unique")
        batch.create_unique_constraint("uq_ledger_entries_request_id", ["request_id"])
