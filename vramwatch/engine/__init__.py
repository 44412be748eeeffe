"""Trend engine: online plateau / plateau-break / leak / fragmentation verdicts per series."""

from .config import EngineConfig
from .core import STATES, TrendEngine
from .events import FRAGMENTATION_ADVICE
from .summary import Summary

__all__ = ["FRAGMENTATION_ADVICE", "STATES", "EngineConfig", "Summary", "TrendEngine"]
