"""credit_settings.recharge_claim_cents: the amount of the auto-recharge charge in flight

A charge whose answer from Stripe was lost is sent again with the same idempotency key, which Stripe
answers only for the same parameters: the amount is the claim's, not whatever the settings say by
then. A claim pending when this runs charges the amount set now.

Revision ID: 0019_recharge_claim_amount
Revises: 0018_batch_line_admitted
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0019_recharge_claim_amount"
down_revision = "0018_batch_line_admitted"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("credit_settings") as batch:
        batch.add_column(sa.Column("recharge_claim_cents", sa.Integer, nullable=True))
    op.execute("UPDATE credit_settings SET recharge_claim_cents = recharge_amount_cents WHERE recharge_state = 'pending'")


def downgrade() -> None:
    with op.batch_alter_table("credit_settings") as batch:
        batch.drop_column("recharge_claim_cents")
