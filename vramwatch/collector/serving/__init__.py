"""Serving: the ASGI door, the app, its guards, dependencies, responses and pages."""
