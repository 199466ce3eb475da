"""The server's plumbing: hardening, errors and their handlers, request ids and logs, the JSON response, drain, metrics."""
