"""Spend alerts: rules, crossings and webhook deliveries."""
