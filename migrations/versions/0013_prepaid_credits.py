"""prepaid_credits: accounts.billing_mode and prepaid_since, and the credit ledger

Every existing account stays postpaid. credit_entries holds every change to a prepaid balance
(billing/credits/models.py); its external_id is unique (Stripe ids, expiry:<grant>). credit_settings:
an account's saved Stripe payment method and auto-recharge state.

Revision ID: 0013_prepaid_credits
Revises: 0012_ledger_partitioning
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0013_prepaid_credits"
down_revision = "0012_ledger_partitioning"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("accounts") as batch:
        batch.add_column(sa.Column("billing_mode", sa.String(16), nullable=False, server_default="postpaid"))
        batch.add_column(sa.Column("prepaid_since", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "credit_entries",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("amount_nanos", sa.BigInteger, nullable=False),
        sa.Column("grant_id", sa.BigInteger, nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("usage_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("admin_key_id", sa.Integer, nullable=True),
        sa.Column("external_id", sa.String(255), nullable=True, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_credit_entries_account_created", "credit_entries", ["account_id", "created_at"])
    op.create_table(
        "credit_settings",
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), primary_key=True, autoincrement=False),
        sa.Column("stripe_customer_id", sa.String(255), nullable=True),
        sa.Column("payment_method_id", sa.String(255), nullable=True),
        sa.Column("recharge_below_nanos", sa.BigInteger, nullable=True),
        sa.Column("recharge_amount_cents", sa.Integer, nullable=True),
        sa.Column("recharge_state", sa.String(16), nullable=False, server_default="idle"),
        sa.Column("recharge_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("recharge_payment_intent", sa.String(255), nullable=True),
        sa.Column("recharge_error", sa.Text, nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("credit_settings")
    op.drop_index("ix_credit_entries_account_created", table_name="credit_entries")
    op.drop_table("credit_entries")
    with op.batch_alter_table("accounts") as batch:
        batch.drop_column("prepaid_since")
        batch.drop_column("billing_mode")
