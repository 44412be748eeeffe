"""Fakes at the seams the hook cannot exercise here (no GPU, no NVML driver)."""
