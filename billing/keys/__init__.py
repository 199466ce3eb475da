"""Accounts and API keys."""
