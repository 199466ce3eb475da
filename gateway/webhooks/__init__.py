"""Webhooks the gateway receives from the services it bills through."""
