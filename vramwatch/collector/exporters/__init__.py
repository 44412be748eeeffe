"""Exporters: Prometheus exposition, OTLP push, and the device watch."""
