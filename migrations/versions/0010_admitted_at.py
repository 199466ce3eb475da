"""admitted_at: reserved for issue 22: admission time on ledger rows (no-op until that work lands)

Revision ID: 0010_admitted_at
Revises: 0009_stored_responses
Create Date: 2026-12-02
"""

revision = "0010_admitted_at"
down_revision = "0009_stored_responses"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
