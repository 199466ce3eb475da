"""Prepaid credit: balances and the credit ledger."""
