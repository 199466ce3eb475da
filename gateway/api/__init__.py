"""The public HTTP APIs, one folder per protocol: each owns its request models and error shape."""
