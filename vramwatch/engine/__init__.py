"""Trend engine: online plateau / plateau-break / leak / fragmentation verdicts per series."""

from vramwatch.engine.config import EngineConfig
from vramwatch.engine.core import STATES, TrendEngine
from vramwatch.engine.events import FRAGMENTATION_ADVICE
from vramwatch.engine.summary import Summary

__all__ = ["FRAGMENTATION_ADVICE", "STATES", "EngineConfig", "Summary", "TrendEngine"]
