"""Tollgate: a token-metered, OpenAI-compatible LLM serving gateway."""

__version__ = "0.1.0"
