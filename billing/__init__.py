"""Accounts, keys, the usage ledger and (later) quotas, prices and invoices."""
