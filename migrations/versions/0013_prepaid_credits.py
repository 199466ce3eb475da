"""prepaid_credits: reserved for issue 25: prepaid balance and credit ledger (no-op until that work lands)

Revision ID: 0013_prepaid_credits
Revises: 0012_ledger_partitioning
Create Date: 2026-12-02
"""

revision = "0013_prepaid_credits"
down_revision = "0012_ledger_partitioning"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
