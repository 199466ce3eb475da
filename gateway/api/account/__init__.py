"""A customer's own account over HTTP: usage, invoices, balance and statements."""
