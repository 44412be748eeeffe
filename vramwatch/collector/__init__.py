"""The collector daemon: ingest over HTTP, SQLite store, live engines, /metrics, dashboard.

Needs the ``server`` extra (FastAPI, uvicorn, prometheus_client); the hook never imports it.
"""
