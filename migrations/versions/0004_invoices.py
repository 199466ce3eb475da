"""price overrides per account, billing periods, invoices and their lines, Stripe links, webhook events

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "price_overrides",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("input_per_million", sa.Numeric(18, 3), nullable=True),
        sa.Column("output_per_million", sa.Numeric(18, 3), nullable=True),
        sa.Column("multiplier", sa.Numeric(12, 6), nullable=True),
        _ts("effective_from"),
        _ts("created_at"),
        sa.UniqueConstraint("account_id", "model", "effective_from", name="uq_price_overrides_account_model_effective"),
    )
    op.create_index("ix_price_overrides_account_id", "price_overrides", ["account_id"])
    op.create_table(
        "billing_periods",
        sa.Column("period", sa.String(7), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("accounts_total", sa.Integer, nullable=False),
        sa.Column("accounts_done", sa.Integer, nullable=False),
        _ts("started_at"),
        _ts("closed_at", nullable=True),
    )
    op.create_table(
        "invoices",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("number", sa.String(32), nullable=False, unique=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("period", sa.String(7), nullable=False),
        _ts("period_start"),
        _ts("period_end"),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("total_cents", sa.BigInteger, nullable=False),
        sa.Column("price_versions", sa.Text, nullable=False),
        _ts("created_at"),
        _ts("paid_at", nullable=True),
        _ts("payment_failed_at", nullable=True),
        sa.Column("stripe_invoice_id", sa.String(255), nullable=True, unique=True),
        sa.Column("stripe_status", sa.String(32), nullable=True),
        sa.Column("stripe_total_cents", sa.BigInteger, nullable=True),
        _ts("stripe_synced_at", nullable=True),
        _ts("stripe_sent_at", nullable=True),
        sa.Column("stripe_error", sa.Text, nullable=True),
        sa.UniqueConstraint("account_id", "period", name="uq_invoices_account_period"),
    )
    op.create_index("ix_invoices_period", "invoices", ["period"])
    op.create_table(
        "invoice_lines",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("invoice_id", sa.Integer, sa.ForeignKey("invoices.id"), nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("usage_period", sa.String(7), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("direction", sa.String(8), nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
        sa.Column("unit_price", sa.Numeric(30, 9), nullable=True),
        sa.Column("amount_cents", sa.BigInteger, nullable=False),
        sa.Column("price_version_id", sa.Integer, nullable=True),
        sa.Column("override_id", sa.Integer, nullable=True),
        sa.Column("description", sa.Text, nullable=False),
        sa.Column("stripe_item_id", sa.String(255), nullable=True, unique=True),
        sa.UniqueConstraint("invoice_id", "position", name="uq_invoice_lines_position"),
    )
    op.create_index("ix_invoice_lines_invoice_id", "invoice_lines", ["invoice_id"])
    op.create_table(
        "billing_accounts",
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), primary_key=True, autoincrement=False),
        sa.Column("stripe_customer_id", sa.String(255), nullable=True, unique=True),
        sa.Column("state", sa.String(16), nullable=False),
        _ts("delinquent_since", nullable=True),
        sa.Column("subscription_id", sa.String(255), nullable=True),
        sa.Column("subscription_status", sa.String(32), nullable=True),
        _ts("subscription_delinquent_since", nullable=True),
        _ts("updated_at"),
    )
    op.create_table(
        "stripe_events",
        sa.Column("id", sa.String(255), primary_key=True),
        sa.Column("type", sa.String(128), nullable=False),
        _ts("created"),
        _ts("processed_at"),
    )


def downgrade() -> None:
    op.drop_table("stripe_events")
    op.drop_table("billing_accounts")
    op.drop_index("ix_invoice_lines_invoice_id", table_name="invoice_lines")
    op.drop_table("invoice_lines")
    op.drop_index("ix_invoices_period", table_name="invoices")
    op.drop_table("invoices")
    op.drop_table("billing_periods")
    op.drop_index("ix_price_overrides_account_id", table_name="price_overrides")
    op.drop_table("price_overrides")
