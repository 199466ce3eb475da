"""Engines around engines: the fair scheduler, fallbacks, the cost-aware router."""
