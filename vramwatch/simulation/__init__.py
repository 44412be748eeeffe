"""Simulation: token scenarios, the procedure's stories and the demo's runs (never imported by the server)."""
