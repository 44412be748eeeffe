"""Ingest: request bodies, the samples route and the foreign-process channel."""
