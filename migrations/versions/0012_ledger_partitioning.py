"""ledger_partitioning: reserved for issue 24: ledger partitioned by month on Postgres (no-op until that work lands)

Revision ID: 0012_ledger_partitioning
Revises: 0011_billing_details
Create Date: 2026-12-02
"""

revision = "0012_ledger_partitioning"
down_revision = "0011_billing_details"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
