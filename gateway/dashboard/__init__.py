"""The dashboards served by the gateway: pages, sessions, templates and static files."""
