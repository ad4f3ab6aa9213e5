"""Reusable real test services (a fault-injecting HTTP server) shared by several test areas."""
