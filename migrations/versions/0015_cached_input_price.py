"""cached_input_price: reserved for issue 25: cached-input price per million (no-op until that work lands)

Revision ID: 0015_cached_input_price
Revises: 0014_spend_alerts
Create Date: 2026-12-02
"""

revision = "0015_cached_input_price"
down_revision = "0014_spend_alerts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
