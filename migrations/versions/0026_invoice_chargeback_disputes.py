"""invoice_chargebacks: every dispute of an invoice's payments, with the amount it takes back

0024 stored one dispute per invoice (invoices.chargeback_dispute_id) and made a charged-back invoice
owed in full. An invoice may be paid by several payments and a payment disputed more than once (partial
or re-filed disputes), and a dispute may take back only part of a payment: one row per (invoice,
dispute), and invoices.chargeback_cents, the sum taken back by those not won nor settled (kept with
charged_back_at in the same transaction, billing/stripe/invoice_disputes.py).

invoices.chargeback_dispute_id is kept (the earliest dispute owed again) for the processes of the code
before this one, which still read it during a rolling update. A chargeback recorded by 0024 becomes a row owed in full (what 0024 made owed; its dispute's next
event re-reads the amount), status `unknown` until then; a settled one (`settled:<id>`) a settled row.
The downgrade keeps one dispute id per invoice: the earliest open one, else a settled one.

Revision ID: 0026_invoice_chargeback_disputes
Revises: 0025_ledger_price_stamp
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0026_invoice_chargeback_disputes"
down_revision = "0025_ledger_price_stamp"
branch_labels = None
depends_on = None

SETTLED = "settled:"


def upgrade() -> None:
    op.create_table(
        "invoice_chargebacks",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("invoice_id", sa.Integer, sa.ForeignKey("invoices.id"), nullable=False),
        sa.Column("dispute_id", sa.String(255), nullable=False),
        sa.Column("payment_intent", sa.String(255), nullable=True),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("disputed_cents", sa.BigInteger, nullable=False),
        sa.Column("amount_cents", sa.BigInteger, nullable=False),
        sa.Column("disputed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("settled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("invoice_id", "dispute_id", name="uq_invoice_chargebacks_dispute"),
    )
    op.create_index("ix_invoice_chargebacks_invoice_id", "invoice_chargebacks", ["invoice_id"])
    # Plain ALTERs: on SQLite a batch (table rebuild) of `invoices` drops the table, which the foreign
    # keys of invoice_lines and invoice_chargebacks refuse once there are invoices.
    op.add_column("invoices", sa.Column("chargeback_cents", sa.BigInteger, nullable=False, server_default="0"))
    op.execute(sa.text(
        "INSERT INTO invoice_chargebacks (invoice_id, dispute_id, status, currency, disputed_cents, amount_cents, disputed_at,"
        " settled_at, updated_at)"
        " SELECT id, chargeback_dispute_id, 'unknown', currency, total_cents, total_cents, charged_back_at, NULL, CURRENT_TIMESTAMP"
        " FROM invoices WHERE chargeback_dispute_id IS NOT NULL AND charged_back_at IS NOT NULL"
        f" AND chargeback_dispute_id NOT LIKE '{SETTLED}%'"))
    op.execute(sa.text(
        "INSERT INTO invoice_chargebacks (invoice_id, dispute_id, status, currency, disputed_cents, amount_cents, disputed_at,"
        " settled_at, updated_at)"
        f" SELECT id, substr(chargeback_dispute_id, {len(SETTLED) + 1}), 'unknown', currency, total_cents, total_cents,"
        " COALESCE(paid_at, created_at), CURRENT_TIMESTAMP, CURRENT_TIMESTAMP"
        f" FROM invoices WHERE chargeback_dispute_id LIKE '{SETTLED}%'"))
    op.execute(sa.text("UPDATE invoices SET chargeback_cents = total_cents WHERE charged_back_at IS NOT NULL"))
    # chargeback_dispute_id stays, kept as it was by billing/stripe/invoice_disputes.py (refresh_invoice):
    # processes of the code before this one still read it while a rolling update replaces them.


def downgrade() -> None:
    op.execute(sa.text(
        "UPDATE invoices SET chargeback_dispute_id = ("
        " SELECT CASE WHEN c.settled_at IS NULL AND c.amount_cents > 0 THEN c.dispute_id"
        f" ELSE '{SETTLED}' || c.dispute_id END"
        " FROM invoice_chargebacks c WHERE c.invoice_id = invoices.id"
        " ORDER BY CASE WHEN c.settled_at IS NULL AND c.amount_cents > 0 THEN 0 ELSE 1 END, c.disputed_at, c.id LIMIT 1)"))
    op.execute(sa.text("ALTER TABLE invoices DROP COLUMN chargeback_cents"))  # not a batch: see upgrade()
    op.drop_index("ix_invoice_chargebacks_invoice_id", table_name="invoice_chargebacks")
    op.drop_table("invoice_chargebacks")
