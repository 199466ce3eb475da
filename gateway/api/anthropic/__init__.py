"""Anthropic's Messages API: its request models, its route, its error shape."""
