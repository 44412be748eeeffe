"""Dashboard views over the store: whatever the timestamps, a heatmap's size is bounded by the request."""

from __future__ import annotations

import orjson
import pytest
from helpers import make_sample

from vramwatch.collector.reads.charts import max_columns, run_heatmap
from vramwatch.collector.store import Store
from vramwatch.report import report_data

DAY = 86400.0


@pytest.fixture
def stepped_clock_db(tmp_path):
    """Two ranks, 2,000 steps a second apart; rank 0's clock stepped back 3 days for one sample."""
    path = tmp_path / "clock.db"
    store = Store(path)
    t0 = 1_760_000_000.0
    for rank in (0, 1):
        samples = [make_sample(i, run="clock", rank=rank, ts=t0 + i) for i in range(2000)]
        if rank == 0:
            samples[1200]["ts"] = t0 - 3 * DAY
        store.insert(samples)
    store.close()
    return path


@pytest.mark.parametrize("cols", [16, 240, 1000])
def test_a_stepped_clock_cannot_stretch_the_wall_time_heatmap(stepped_clock_db, cols: int) -> None:
    store = Store(stepped_clock_db, readonly=True)
    doc = run_heatmap(store, "clock", field="headroom", x="ts", cols=cols)
    store.close()
    assert doc is not None
    assert 0 < len(doc["x"]) <= max_columns(cols) and all(len(row) == len(doc["x"]) for row in doc["z"])
    assert doc["outside"] == 1  # the lone early sample is counted, not drawn over three days
    covered = doc["x"][-1] - doc["x"][0] + doc["bucket"]
    assert covered >= 1999  # the 2,000 s of real data are all on the axis
    assert len(orjson.dumps(doc)) < 64 * 1024


def test_the_step_heatmap_keeps_every_cell(stepped_clock_db) -> None:
    store = Store(stepped_clock_db, readonly=True)
    doc = run_heatmap(store, "clock", field="reserved", x="step", cols=64)
    store.close()
    assert doc["outside"] == 0 and 32 <= len(doc["x"]) <= 64


def test_the_report_of_a_stepped_clock_run_stays_small(stepped_clock_db) -> None:
    data = report_data(str(stepped_clock_db), "clock")
    for x in ("step", "ts"):
        for doc in data["heatmap"][x].values():
            assert len(doc["x"]) <= max_columns(240)
    assert len(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)) < 2 * 2**20


def test_the_report_shares_one_point_budget_across_ranks(tmp_path) -> None:
    from vramwatch.probe.simulated import simulate_trace
    from vramwatch.report import REPORT_POINTS, points_per_rank

    path = tmp_path / "wide.db"
    store = Store(path)
    for rank in range(24):
        store.insert(list(simulate_trace("checkpoint", steps=1500, run="wide", rank=rank)))
    store.close()
    data = report_data(str(path), "wide")
    sizes = [len(doc["x"]) for doc in data["series"].values()]
    assert len(sizes) == 24 and max(sizes) <= points_per_rank(24) < 1500
    assert sum(sizes) <= REPORT_POINTS
    assert points_per_rank(1) == 2000 and points_per_rank(10_000) == 250


def test_scattered_timestamps_cannot_grow_the_heatmap_cache(tmp_path) -> None:
    import random

    from vramwatch.collector.reads.charts import MAX_CACHED_BUCKETS, heatmap_cache

    rng = random.Random(5)
    store = Store(tmp_path / "scatter.db")
    # every sample somewhere in ten years: each would be a bucket of its own
    store.insert([make_sample(i, run="scatter", ts=1_500_000_000.0 + rng.random() * 10 * 365 * DAY)
                  for i in range(40_000)])
    doc = run_heatmap(store, "scatter", field="reserved", x="ts", cols=1000)
    entry = heatmap_cache(store.path)._entries[("scatter", "ts")]
    assert all(len(sb.buckets) <= MAX_CACHED_BUCKETS for sb in entry.series.values())
    assert len(doc["x"]) <= max_columns(1000) and doc["outside"] + sum(v is not None for v in doc["z"][0]) > 0
    store.close()
