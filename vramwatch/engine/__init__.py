"""Trend engine: online plateau / plateau-break / leak / fragmentation verdicts per series."""

from .core import FRAGMENTATION_ADVICE, STATES, EngineConfig, TrendEngine

__all__ = ["FRAGMENTATION_ADVICE", "STATES", "EngineConfig", "TrendEngine"]
