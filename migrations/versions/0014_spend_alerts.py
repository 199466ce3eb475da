"""spend_alerts: reserved for issue 25: spend alerts and webhook deliveries (no-op until that work lands)

Revision ID: 0014_spend_alerts
Revises: 0013_prepaid_credits
Create Date: 2026-12-02
"""

revision = "0014_spend_alerts"
down_revision = "0013_prepaid_credits"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
