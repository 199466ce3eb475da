"""spend_alerts: alert_rules, alert_events (one per crossing), alert_deliveries

Revision ID: 0014_spend_alerts
Revises: 0013_prepaid_credits
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0014_spend_alerts"
down_revision = "0013_prepaid_credits"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "alert_rules",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("key_id", sa.Integer, sa.ForeignKey("api_keys.id"), nullable=True),
        sa.Column("metric", sa.String(16), nullable=False),
        sa.Column("threshold", sa.BigInteger, nullable=True),
        sa.Column("percent", sa.Integer, nullable=True),
        sa.Column("url", sa.String(2000), nullable=False),
        sa.Column("secret", sa.String(128), nullable=False),
        _ts("created_at"),
    )
    op.create_index("ix_alert_rules_account_id", "alert_rules", ["account_id"])
    op.create_table(
        "alert_events",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("rule_id", sa.Integer, sa.ForeignKey("alert_rules.id"), nullable=False),
        sa.Column("account_id", sa.Integer, nullable=False),
        sa.Column("crossing", sa.String(64), nullable=False),
        sa.Column("value", sa.BigInteger, nullable=False),
        sa.Column("threshold", sa.BigInteger, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        _ts("delivered_at", nullable=True),
        _ts("created_at"),
        sa.UniqueConstraint("rule_id", "crossing", name="uq_alert_events_rule_crossing"),
    )
    op.create_index("ix_alert_events_account_id", "alert_events", ["account_id"])
    op.create_table(
        "alert_deliveries",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("event_id", sa.Integer, sa.ForeignKey("alert_events.id"), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("status_code", sa.Integer, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        _ts("created_at"),
    )
    op.create_index("ix_alert_deliveries_event_id", "alert_deliveries", ["event_id"])


def downgrade() -> None:
    op.drop_index("ix_alert_deliveries_event_id", table_name="alert_deliveries")
    op.drop_table("alert_deliveries")
    op.drop_index("ix_alert_events_account_id", table_name="alert_events")
    op.drop_table("alert_events")
    op.drop_index("ix_alert_rules_account_id", table_name="alert_rules")
    op.drop_table("alert_rules")
