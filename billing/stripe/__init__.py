"""Stripe: checkout top-ups, invoice sync and webhooks."""
