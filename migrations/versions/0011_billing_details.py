"""billing_details: reserved for issue 22: buyer billing details, tax, invoice numbering, credit notes (no-op until that work lands)

Revision ID: 0011_billing_details
Revises: 0010_admitted_at
Create Date: 2026-12-02
"""

revision = "0011_billing_details"
down_revision = "0010_admitted_at"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
