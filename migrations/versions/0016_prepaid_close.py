"""prepaid_close: prepaid statements, incremental usage posting, balance alerts that re-arm on a
rise, and a custom price's cached-input price

- prepaid_statements: one numbered statement per prepaid account and closed month.
- credit_usage_marks: how far each prepaid account's usage is posted (ledger ids), so a posting
  batch reads only new ledger rows. Accounts without a mark start from the sum of their usage rows.
- alert_rules.rearmed: a balance_below rule fires again only after the balance was back at or
  above its threshold. Existing rules start at 0 (crossings already recorded keep their keys).
- price_overrides.cached_input_per_million: NULL (every existing override) keeps billing cached
  prompt tokens at the custom input price.

Revision ID: 0016_prepaid_close
Revises: 0015_cached_input_price
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0016_prepaid_close"
down_revision = "0015_cached_input_price"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    with op.batch_alter_table("price_overrides") as batch:
        batch.add_column(sa.Column("cached_input_per_million", sa.Numeric(18, 3), nullable=True))
    with op.batch_alter_table("alert_rules") as batch:
        batch.add_column(sa.Column("rearmed", sa.Integer, nullable=False, server_default="0"))
    op.create_table(
        "credit_usage_marks",
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), primary_key=True, autoincrement=False),
        sa.Column("posted_id", sa.BigInteger, nullable=True),
        sa.Column("posted_nanos", sa.BigInteger, nullable=False, server_default="0"),
        _ts("posted_at", nullable=True),
        sa.Column("frontier_id", sa.BigInteger, nullable=True),
        _ts("frontier_at", nullable=True),
    )
    op.create_table(
        "prepaid_statements",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("number", sa.String(32), nullable=False, unique=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("period", sa.String(7), nullable=False),
        _ts("period_start"),
        _ts("period_end"),
        sa.Column("opening_nanos", sa.BigInteger, nullable=False),
        sa.Column("credits_nanos", sa.BigInteger, nullable=False),
        sa.Column("usage_nanos", sa.BigInteger, nullable=False),
        sa.Column("late_nanos", sa.BigInteger, nullable=False),
        sa.Column("closing_nanos", sa.BigInteger, nullable=False),
        sa.Column("content", sa.Text, nullable=False),
        sa.Column("seller", sa.Text, nullable=True),
        sa.Column("buyer", sa.Text, nullable=True),
        _ts("issued_at"),
        sa.UniqueConstraint("account_id", "period", name="uq_prepaid_statements_account_period"),
    )
    op.create_index("ix_prepaid_statements_account_id", "prepaid_statements", ["account_id"])


def downgrade() -> None:
    op.drop_index("ix_prepaid_statements_account_id", table_name="prepaid_statements")
    op.drop_table("prepaid_statements")
    op.drop_table("credit_usage_marks")
    with op.batch_alter_table("alert_rules") as batch:
        batch.drop_column("rearmed")
    with op.batch_alter_table("price_overrides") as batch:
        batch.drop_column("cached_input_per_million")
