"""billing details per account, tax rates per country, gapless document numbers, credit notes, and
the invoice as a document: seller and buyer snapshots, issue and due dates, terms, subtotal and tax

Invoices issued before this revision keep their numbers and have no snapshots (they render as
before); their subtotal is their total and their tax 0, which is what they charged.

Revision ID: 0011_billing_details
Revises: 0010_admitted_at
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_billing_details"
down_revision = "0010_admitted_at"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    with op.batch_alter_table("invoices") as batch:
        batch.add_column(sa.Column("seller", sa.Text, nullable=True))
        batch.add_column(sa.Column("buyer", sa.Text, nullable=True))
        batch.add_column(_ts("issued_at", nullable=True))
        batch.add_column(_ts("due_at", nullable=True))
        batch.add_column(sa.Column("payment_terms", sa.String(200), nullable=True))
        batch.add_column(sa.Column("subtotal_cents", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("tax_rate", sa.Numeric(7, 3), nullable=True))
        batch.add_column(sa.Column("tax_cents", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("credit_applied_cents", sa.BigInteger, nullable=False, server_default="0"))
    op.execute("UPDATE invoices SET subtotal_cents = total_cents, issued_at = created_at")
    op.create_table(
        "billing_details",
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), primary_key=True, autoincrement=False),
        sa.Column("legal_name", sa.String(200), nullable=False),
        sa.Column("address_line1", sa.String(200), nullable=True),
        sa.Column("address_line2", sa.String(200), nullable=True),
        sa.Column("city", sa.String(100), nullable=True),
        sa.Column("postal_code", sa.String(20), nullable=True),
        sa.Column("region", sa.String(100), nullable=True),
        sa.Column("country", sa.String(2), nullable=False),
        sa.Column("email", sa.String(254), nullable=True),
        sa.Column("tax_id", sa.String(64), nullable=True),
        sa.Column("tax_id_type", sa.String(16), nullable=True),
        sa.Column("tax_rate", sa.Numeric(7, 3), nullable=True),
        _ts("updated_at"),
    )
    op.create_table(
        "tax_rates",
        sa.Column("country", sa.String(2), primary_key=True),
        sa.Column("rate", sa.Numeric(7, 3), nullable=False),
        _ts("updated_at"),
    )
    op.create_table(
        "document_sequences",
        sa.Column("seller", sa.String(200), primary_key=True),
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("last_number", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "credit_notes",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("number", sa.String(32), nullable=False, unique=True),
        sa.Column("invoice_id", sa.Integer, sa.ForeignKey("invoices.id"), nullable=False),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(32), nullable=True),
        sa.Column("memo", sa.Text, nullable=True),
        sa.Column("subtotal_cents", sa.BigInteger, nullable=False),
        sa.Column("tax_cents", sa.BigInteger, nullable=False),
        sa.Column("total_cents", sa.BigInteger, nullable=False),
        sa.Column("applies_to", sa.String(16), nullable=False),
        sa.Column("seller", sa.Text, nullable=True),
        sa.Column("buyer", sa.Text, nullable=True),
        _ts("issued_at"),
        sa.Column("shown_on_invoice_id", sa.Integer, sa.ForeignKey("invoices.id"), nullable=True),
        sa.Column("stripe_credit_note_id", sa.String(255), nullable=True, unique=True),
        sa.Column("stripe_error", sa.Text, nullable=True),
    )
    op.create_index("ix_credit_notes_invoice_id", "credit_notes", ["invoice_id"])
    op.create_index("ix_credit_notes_account_id", "credit_notes", ["account_id"])


def downgrade() -> None:
    op.drop_index("ix_credit_notes_account_id", table_name="credit_notes")
    op.drop_index("ix_credit_notes_invoice_id", table_name="credit_notes")
    op.drop_table("credit_notes")
    op.drop_table("document_sequences")
    op.drop_table("tax_rates")
    op.drop_table("billing_details")
    with op.batch_alter_table("invoices") as batch:
        for name in ("credit_applied_cents", "tax_cents", "tax_rate", "subtotal_cents", "payment_terms", "due_at", "issued_at",
                     "buyer", "seller"):
            batch.drop_column(name)
