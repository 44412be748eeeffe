"""Writes deploy/grafana/dashboards/vramwatch.json: the Grafana dashboard, generated.

    python deploy/grafana/build_dashboard.py          # rewrite the JSON
    python deploy/grafana/build_dashboard.py --check  # exit 1 if the JSON is out of date

Generated so that every panel follows the same rules (checked again on the JSON itself by
tests/deploy/test_deploy.py): the datasource is the ``$datasource`` variable, every legend of a
query that keeps ``run`` shows ``{{run}}``, the state colours and the low-headroom threshold
come from ``vramwatch.verdicts``, and the panel count does not depend on the number of
ranks (per-rank detail is one collapsed row for one rank picked in ``$focus``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from vramwatch.verdicts import LOW_HEADROOM_FRACTION, SEVERITY, STATES  # noqa: E402

OUT = Path(__file__).resolve().parent / "dashboards" / "vramwatch.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'run=~"$run", Hostname=~"$host", rank=~"$rank"'
FOCUS = 'run=~"$run", Hostname=~"$host", rank="$focus"'
#: Every per-rank series names its run, rank, host and GPU: a rank restarted on another GPU of its
#: host is two series (the GPU labels differ), which one legend without the GPU would not tell apart.
RANK_LEGEND = "{{run}} r{{rank}} {{Hostname}} GPU {{gpu}}"
#: The counters (retries, OOMs, ...) are keyed by the rank alone: one series across its processes
#: and GPUs, so a restart on another GPU neither splits nor resets them.
COUNTER_LEGEND = "{{run}} r{{rank}} {{Hostname}}"
#: Colour per state: only a leak is red; rising is a warning, not an alarm.
STATE_COLORS = {"plateau": "green", "warmup": "blue", "rising": "yellow", "fragmentation": "orange", "leak": "red"}
NOTHING_GROWING = "nothing growing"
DCGM = 'instance=~"$instance", gpu=~"$gpu"'
MIB = 1048576


def state_code_expr(selector: str, by: str = "run, Hostname, rank, gpu") -> str:
    """One number per rank: its state's severity + 1 (0 would be indistinguishable from no series)."""
    terms = [f'{SEVERITY[s] + 1} * vramwatch_trend_state{{state="{s}", {selector}}}' for s in STATES]
    return f"max by ({by}) (\n  " + "\n  + ignoring (state) ".join(terms) + "\n)"


def state_mappings() -> list[dict[str, Any]]:
    return [
        {"type": "value", "options": {str(SEVERITY[s] + 1): {"text": s, "color": STATE_COLORS[s], "index": i}}}
        for i, s in enumerate(STATES)
    ]


def thresholds(*steps: tuple[str, float | None]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}


HEADROOM_STEPS = thresholds(("red", None), ("green", LOW_HEADROOM_FRACTION))


class Layout:
    """Assigns ids and grid positions row by row (24 columns)."""

    def __init__(self) -> None:
        self.next_id = 1
        self.y = 0
        self.x = 0
        self.row_h = 0

    def place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self.newline()
        pos = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def newline(self) -> None:
        self.y += self.row_h
        self.x = 0
        self.row_h = 0

    def ident(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def target(ref: str, expr: str, legend: str = "", *, instant: bool = False, table: bool = False) -> dict[str, Any]:
    item: dict[str, Any] = {"datasource": DS, "refId": ref, "expr": expr, "legendFormat": legend,
                            "range": not instant, "instant": instant}
    if table:
        item["format"] = "table"
    return item


def timeseries(lay: Layout, title: str, description: str, targets: list[dict[str, Any]], unit: str, *,
               w: int = 12, h: int = 8, sort: str = "desc", calcs: tuple[str, ...] = ("lastNotNull", "max"),
               steps: dict[str, Any] | None = None, no_value: str | None = None,
               overrides: list[dict[str, Any]] | None = None, minimum: float | None = None) -> dict[str, Any]:
    """A time series; ``sort="asc"`` when the smallest value is the one that matters (headroom, time to OOM)."""
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {"lineWidth": 1, "fillOpacity": 0, "showPoints": "never", "spanNulls": False},
    }
    if steps:
        defaults["thresholds"] = steps
        defaults["custom"]["thresholdsStyle"] = {"mode": "dashed"}
    if no_value:
        defaults["noValue"] = no_value
    if minimum is not None:
        defaults["min"] = minimum
    sort_by = "Min" if sort == "asc" else "Max"
    return {
        "id": lay.ident(), "type": "timeseries", "title": title, "description": description,
        "datasource": DS, "gridPos": lay.place(w, h), "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {"displayMode": "table", "placement": "right", "showLegend": True, "calcs": list(calcs),
                       "sortBy": sort_by, "sortDesc": sort != "asc"},
            "tooltip": {"mode": "multi", "sort": sort},
        },
    }


def stat(lay: Layout, title: str, description: str, expr: str, legend: str, unit: str, steps: dict[str, Any], *,
         w: int = 4, no_value: str | None = None, calc: str = "lastNotNull",
         mappings: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit, "thresholds": steps, "color": {"mode": "thresholds"},
                                "mappings": mappings or []}
    if no_value:
        defaults["noValue"] = no_value
    return {
        "id": lay.ident(), "type": "stat", "title": title, "description": description, "datasource": DS,
        "gridPos": lay.place(w, 4), "targets": [target("A", expr, legend, instant=True)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"reduceOptions": {"calcs": [calc], "fields": "", "values": False}, "colorMode": "background",
                    "graphMode": "none", "textMode": "value_and_name", "orientation": "auto"},
    }


def row(lay: Layout, title: str, *, collapsed: bool = False, panels: list[dict[str, Any]] | None = None,
        ) -> dict[str, Any]:
    lay.newline()
    item = {"id": lay.ident(), "type": "row", "title": title, "collapsed": collapsed,
            "gridPos": {"x": 0, "y": lay.y, "w": 24, "h": 1}, "panels": panels or []}
    lay.y += 1
    return item


def by_name(name: str, **props: Any) -> dict[str, Any]:
    return {"matcher": {"id": "byName", "options": name},
            "properties": [{"id": k, "value": v} for k, v in props.items()]}


# ---------------------------------------------------------------------------- panels

def overview(lay: Layout) -> list[dict[str, Any]]:
    """Run-level panels: a fixed number, whatever the rank count."""
    ratio_steps = HEADROOM_STEPS
    panels = [row(lay, "Run overview")]
    panels.append(stat(
        lay, "Worst headroom (run)", "Smallest headroom of any rank at training steps, as a fraction of the "
        f"device (red under {LOW_HEADROOM_FRACTION:.0%}, the alert's threshold).",
        'run:vramwatch_headroom_ratio:min{run=~"$run"}', "{{run}}", "percentunit", ratio_steps))
    panels.append(stat(
        lay, "Worst checkpoint headroom (run)", "Smallest headroom of any rank at the peak of its latest "
        "checkpoint phase.",
        f"min by (run) (vramwatch_checkpoint_headroom_bytes{{{SEL}}} / vramwatch_device_total_bytes{{{SEL}}})",
        "{{run}}", "percentunit", ratio_steps, no_value="no checkpoint seen"))
    panels.append(stat(
        lay, "Soonest OOM", "Shortest projected time to OOM of any growing rank (the engine's estimate).",
        f"min by (run) (vramwatch_seconds_to_oom{{{SEL}}})", "{{run}}", "s",
        thresholds(("red", None), ("orange", 3600), ("yellow", 6 * 3600), ("green", 24 * 3600)),
        no_value=NOTHING_GROWING))
    states = [s for s in STATES if SEVERITY[s] >= SEVERITY["rising"]]
    panel = stat(
        lay, "Ranks rising / fragmenting / leaking", "Ranks per run in each state that needs a look.",
        f'sum by (run, state) (vramwatch_trend_state{{state=~"{"|".join(states)}", {SEL}}})', "{{run}} {{state}}",
        "none", thresholds(("green", None), ("yellow", 1)))
    panel["fieldConfig"]["overrides"] = [
        {"matcher": {"id": "byRegexp", "options": f".* {s}$"},
         "properties": [{"id": "thresholds", "value": thresholds(("green", None), (STATE_COLORS[s], 1))}]}
        for s in states
    ]
    panels.append(panel)
    panels.append(stat(
        lay, "OOMs in the time range", "Out-of-memory errors the allocator raised, per run, in the dashboard's "
        "time range.", f"sum by (run) (increase(vramwatch_ooms_total{{{SEL}}}[$__range]))", "{{run}}", "none",
        thresholds(("green", None), ("red", 0.5)), no_value="no OOM"))
    panels.append(stat(
        lay, "Rank skew (reserved, max - min)", "Spread of reserved memory across the run's ranks, as a fraction "
        "of the device: one rank far above the others runs out first.",
        f"(max by (run) (vramwatch_memory_reserved_bytes{{{SEL}}}) - min by (run) "
        f"(vramwatch_memory_reserved_bytes{{{SEL}}}))\n  / max by (run) (vramwatch_device_total_bytes{{{SEL}}})",
        "{{run}}", "percentunit", thresholds(("green", None), ("yellow", 0.03), ("red", 0.10))))
    timeline = {
        "id": lay.ident(), "type": "state-timeline", "title": "Worst state per run",
        "description": "The most severe trend-engine state of any rank, per run.", "datasource": DS,
        "gridPos": lay.place(24, 5),
        "targets": [target("A", f"max by (run) (\n{state_code_expr(SEL)}\n)", "{{run}}")],
        "fieldConfig": {"defaults": {"mappings": state_mappings(), "color": {"mode": "thresholds"},
                                     "thresholds": thresholds(("text", None))}, "overrides": []},
        "options": {"showValue": "never", "mergeValues": True, "rowHeight": 0.8,
                    "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "single", "sort": "none"}},
    }
    panels.append(timeline)
    return panels


#: Labels of every "Ranks now" query: no ``__name__`` or other label differs between them, so
#: Grafana's merge transformation joins them into one row per rank. ``instance`` is the
#: collector Prometheus scraped (honor_labels keeps run/rank; the target sets instance), i.e.
#: the shard that holds the rank: the rank link opens that shard's page.
TABLE_BY = "run, Hostname, rank, instance"
#: Columns of the "Ranks now" table: (refId, column, unit, expression per rank).
TABLE_COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    ("A", "state", "none", state_code_expr(SEL, TABLE_BY)),
    ("B", "headroom", "percentunit",
     f"vramwatch_headroom_bytes{{{SEL}}} / vramwatch_device_total_bytes{{{SEL}}}"),
    ("C", "checkpoint headroom", "percentunit",
     f"vramwatch_checkpoint_headroom_bytes{{{SEL}}} / vramwatch_device_total_bytes{{{SEL}}}"),
    ("D", "time to OOM", "s", f"vramwatch_seconds_to_oom{{{SEL}}}"),
    ("E", "steps to OOM", "none", f"vramwatch_steps_to_oom{{{SEL}}}"),
    ("F", "reserved", "bytes", f"vramwatch_memory_reserved_bytes{{{SEL}}}"),
    ("G", "process used (NVML)", "bytes", f"vramwatch_process_used_bytes{{{SEL}}}"),
    ("H", "fragmenting", "none", f"vramwatch_fragmentation{{{SEL}}}"),
    ("I", "OOMs", "none", f"vramwatch_ooms_total{{{SEL}}}"),
    ("J", "checkpoints", "none", f"vramwatch_checkpoints_total{{{SEL}}}"),
    ("K", "silent for", "s", f"time() - vramwatch_last_received_timestamp_seconds{{{SEL}}}"),
)

#: The collector page's hash route for one rank (dashboard/app.js parseRoute: #/run/NAME?rank=&host=&x=).
RANK_ROUTE = ("/#/run/${__data.fields.run:percentencode}?rank=${__data.fields.rank}"
              "&host=${__data.fields.Hostname:percentencode}&x=time&from=${__from}&to=${__to}")
#: First link: the shard that holds the rank (its scrape target). Second: $collector_url, for
#: setups where the target address is not reachable from the browser (compose's service name,
#: a pod IP, a proxy in front of the collectors).
RANK_LINKS = (
    {"title": "Rank ${__data.fields.rank} on its collector (${__data.fields.instance})",
     "url": "http://${__data.fields.instance}" + RANK_ROUTE, "targetBlank": True},
    {"title": "Rank ${__data.fields.rank} via ${collector_url}", "url": "${collector_url}" + RANK_ROUTE,
     "targetBlank": True},
)


def ranks_table(lay: Layout) -> dict[str, Any]:
    targets = []
    for ref, _name, _unit, expr in TABLE_COLUMNS:
        inner = expr if expr.startswith(f"max by ({TABLE_BY})") else f"max by ({TABLE_BY}) ({expr})"
        targets.append(target(ref, inner, instant=True, table=True))
    rename = {f"Value #{ref}": name for ref, name, _u, _e in TABLE_COLUMNS}
    overrides = [by_name(name, unit=unit) for _r, name, unit, _e in TABLE_COLUMNS if unit != "none"]
    overrides.append(by_name("state", mappings=state_mappings(),
                             **{"custom.cellOptions": {"type": "color-background"}}))
    overrides.append(by_name("headroom", thresholds=HEADROOM_STEPS,
                             **{"custom.cellOptions": {"type": "color-text"}}))
    overrides.append(by_name("checkpoint headroom", thresholds=HEADROOM_STEPS,
                             **{"custom.cellOptions": {"type": "color-text"}}))
    overrides.append(by_name("time to OOM", noValue=NOTHING_GROWING))
    overrides.append(by_name("fragmenting", mappings=[
        {"type": "value", "options": {"0": {"text": "no", "index": 0}, "1": {"text": "yes", "color": "orange",
                                                                             "index": 1}}}]))
    overrides.append(by_name("rank", links=[dict(link) for link in RANK_LINKS]))
    return {
        "id": lay.ident(), "type": "table", "title": "Ranks now",
        "description": "One row per rank, worst state first. Click a rank to open it on the collector that holds it "
                       "(its instance), or via $collector_url.",
        "datasource": DS, "gridPos": lay.place(24, 9), "targets": targets,
        "transformations": [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {"excludeByName": {"Time": True}, "renameByName": rename,
                                           "indexByName": {"run": 0, "rank": 1, "Hostname": 2, "instance": 3}}},
            {"id": "sortBy", "options": {"sort": [{"field": "state", "desc": True}]}},
        ],
        "fieldConfig": {"defaults": {"custom": {"align": "auto", "filterable": True}}, "overrides": overrides},
        "options": {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}},
    }


def ranks(lay: Layout) -> list[dict[str, Any]]:
    """Every selected rank as one series per panel: O(1) panels and queries at any scale."""
    panels = [row(lay, "Ranks (one series per rank)"), ranks_table(lay)]
    panels.append({
        "id": lay.ident(), "type": "state-timeline", "title": "Trend state per rank",
        "description": "The trend engine's state per rank over time.", "datasource": DS,
        "gridPos": lay.place(24, 8), "targets": [target("A", state_code_expr(SEL), RANK_LEGEND)],
        "fieldConfig": {"defaults": {"mappings": state_mappings(), "color": {"mode": "thresholds"},
                                     "thresholds": thresholds(("text", None))}, "overrides": []},
        "options": {"showValue": "never", "mergeValues": True, "rowHeight": 0.8,
                    "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "single", "sort": "none"}},
    })
    panels.append(timeseries(
        lay, "Reserved per rank", "Bytes the caching allocator holds (torch reserved).",
        [target("A", f"vramwatch_memory_reserved_bytes{{{SEL}}}", RANK_LEGEND)], "bytes"))
    panels.append(timeseries(
        lay, "Headroom per rank", "Capacity minus what the device holds at training steps, as a fraction of "
        "the device; the dashed line is the low-headroom threshold. Smallest first.",
        [target("A", f"vramwatch_headroom_bytes{{{SEL}}} / vramwatch_device_total_bytes{{{SEL}}}", RANK_LEGEND)],
        "percentunit", sort="asc", calcs=("min", "lastNotNull"), steps=HEADROOM_STEPS, minimum=0))
    panels.append(timeseries(
        lay, "Rank skew: reserved minus the run's median", "Positive: this rank holds more than the median rank.",
        [target("A", f"vramwatch_memory_reserved_bytes{{{SEL}}}\n  - on (run) group_left ()\n  "
                     f'quantile by (run) (0.5, vramwatch_memory_reserved_bytes{{run=~"$run"}})', RANK_LEGEND)],
        "bytes"))
    panels.append(timeseries(
        lay, "Time to OOM", "Projected time until the device is full at the current growth (present only while "
        "a rank grows). Soonest first.",
        [target("A", f"vramwatch_seconds_to_oom{{{SEL}}}", RANK_LEGEND)], "s", sort="asc",
        calcs=("min", "lastNotNull"), no_value=NOTHING_GROWING, minimum=0))
    panels.append(timeseries(
        lay, "Steps to OOM", "Projected training steps until the device is full at the current growth. Fewest "
        "first.", [target("A", f"vramwatch_steps_to_oom{{{SEL}}}", RANK_LEGEND)], "suffix: steps", sort="asc",
        calcs=("min", "lastNotNull"), no_value=NOTHING_GROWING, minimum=0))
    panels.append(timeseries(
        lay, "Leak slope per step", "Robust growth of memory at step boundaries, bytes per training step.",
        [target("A", f"vramwatch_leak_slope_bytes_per_step{{{SEL}}}", RANK_LEGEND)], "si:B/step",
        no_value=NOTHING_GROWING))
    panels.append(timeseries(
        lay, "Checkpoint headroom per rank", "Headroom at the peak of each rank's latest checkpoint phase, as a "
        "fraction of the device. Smallest first.",
        [target("A", f"vramwatch_checkpoint_headroom_bytes{{{SEL}}} / vramwatch_device_total_bytes{{{SEL}}}",
                RANK_LEGEND)],
        "percentunit", sort="asc", calcs=("min", "lastNotNull"), steps=HEADROOM_STEPS, minimum=0,
        no_value="no checkpoint seen"))
    panels.append(timeseries(
        lay, "Growth outside the allocator (NVML used - reserved)", "CUDA context, NCCL, cuBLAS workspaces, "
        "non-torch libraries: what torch.cuda statistics do not see.",
        [target("A", f"vramwatch_outside_allocator_bytes{{{SEL}}}", RANK_LEGEND)], "bytes"))
    panels.append(timeseries(
        lay, "Process used (NVML) per rank", "Bytes NVML attributes to the training process.",
        [target("A", f"vramwatch_process_used_bytes{{{SEL}}}", RANK_LEGEND)], "bytes"))
    panels.append(timeseries(
        lay, "Fragmentation: reserved - allocated, inactive split", "Memory the allocator holds but no tensor "
        "uses; inactive split bytes cannot be released.",
        [target("A", f"vramwatch_memory_reserved_bytes{{{SEL}}} - vramwatch_memory_allocated_bytes{{{SEL}}}",
                f"{RANK_LEGEND} reserved - allocated"),
         target("B", f"vramwatch_inactive_split_bytes{{{SEL}}}", f"{RANK_LEGEND} inactive split")], "bytes"))
    panels.append(timeseries(
        lay, "Allocator retries and OOMs per minute", "cudaMalloc retries (caches flushed, a device-wide sync), "
        "out-of-memory errors, and OOMs suspected from device memory alone (no OOM counter to confirm them).",
        [target("A", f"60 * rate(vramwatch_alloc_retries_total{{{SEL}}}[$__rate_interval])",
                f"{COUNTER_LEGEND} retries"),
         target("B", f"60 * rate(vramwatch_ooms_total{{{SEL}}}[$__rate_interval])", f"{COUNTER_LEGEND} OOMs"),
         target("C", f"60 * rate(vramwatch_suspected_ooms_total{{{SEL}}}[$__rate_interval])",
                f"{COUNTER_LEGEND} suspected OOMs")],
        "suffix:/min", minimum=0))
    return panels


def dcgm_of_ranks(metric: str) -> str:
    """A dcgm-exporter family filtered and labelled by the run and rank on each GPU: joined on UUID
    through UUID:vramwatch_rank:latest (one series per GPU). dcgm's own Hostname is its exporter
    pod's name on Kubernetes, so the rank's Hostname replaces it; its gpu index is kept."""
    return (f"max by (UUID, gpu, instance) ({metric}{{{DCGM}}})\n  * on (UUID) group_left (run, rank, Hostname)\n  "
            f"UUID:vramwatch_rank:latest{{{SEL}}}")


def gpu_context(lay: Layout) -> list[dict[str, Any]]:
    """dcgm-exporter's GPU-level view beside the per-rank one (its metrics are MiB, %, W, C)."""
    panels = [row(lay, "GPU context (dcgm-exporter)")]
    joined = (f"max by (UUID) (DCGM_FI_DEV_FB_USED) * {MIB}\n  * on (UUID) group_left (run, rank, Hostname, gpu)\n  "
              f"UUID:vramwatch_rank:latest{{{SEL}}}")
    panels.append(timeseries(
        lay, "torch reserved vs DCGM FB used", "Per rank: what the PyTorch allocator reserved and what "
        "dcgm-exporter reports used on that GPU. The gap is memory outside the allocator (CUDA context, NCCL, "
        "other processes). Joined on UUID through the UUID:vramwatch_rank:latest recording rule.",
        [target("A", f'vramwatch_memory_reserved_bytes{{{SEL}, UUID!=""}}', f"{RANK_LEGEND} torch reserved"),
         target("B", joined, f"{RANK_LEGEND} DCGM FB used")], "bytes", w=24, h=9,
        no_value="no dcgm-exporter series for these GPUs"))
    for title, expr, unit in (
        ("DCGM frame buffer used", f"{dcgm_of_ranks('DCGM_FI_DEV_FB_USED')} * {MIB}", "bytes"),
        ("DCGM GPU utilisation", dcgm_of_ranks("DCGM_FI_DEV_GPU_UTIL"), "percent"),
        ("DCGM power", dcgm_of_ranks("DCGM_FI_DEV_POWER_USAGE"), "watt"),
        ("DCGM temperature", dcgm_of_ranks("DCGM_FI_DEV_GPU_TEMP"), "celsius"),
    ):
        panels.append(timeseries(lay, title, "dcgm-exporter, per GPU ($instance, $gpu) that a selected rank "
                                 "(run, host, rank) reported on within 10 minutes.",
                                 [target("A", expr, RANK_LEGEND)], unit, w=6,
                                 no_value="no dcgm-exporter data for these ranks", calcs=("lastNotNull",)))
    return panels


def rank_detail(lay: Layout) -> list[dict[str, Any]]:
    """One rank (``$focus``, single-select) in detail: a collapsed row, never repeated per rank."""
    detail = Layout()
    detail.next_id, detail.y = lay.next_id, lay.y + 1
    legend = "{{run}} {{Hostname}} GPU {{gpu}} "
    inner = [
        timeseries(detail, "Rank $focus: allocated, reserved, peak, NVML used, plateau, checkpoint peak",
                   "The focused rank's memory families.",
                   [target(ref, f"{name}{{{FOCUS}}}", legend + label) for ref, name, label in (
                       ("A", "vramwatch_memory_allocated_bytes", "allocated"),
                       ("B", "vramwatch_memory_reserved_bytes", "reserved"),
                       ("C", "vramwatch_memory_peak_allocated_bytes", "peak allocated"),
                       ("D", "vramwatch_device_used_bytes", "NVML used"),
                       ("E", "vramwatch_process_used_bytes", "process used"),
                       ("F", "vramwatch_device_total_bytes", "capacity"),
                       ("G", "vramwatch_plateau_bytes", "plateau"),
                       ("H", "vramwatch_checkpoint_peak_bytes", "checkpoint peak"))],
                   "bytes", w=24, h=9),
        timeseries(detail, "Rank $focus: headroom at steps and at checkpoints", "Fraction of the device.",
                   [target("A", f"vramwatch_headroom_bytes{{{FOCUS}}} / vramwatch_device_total_bytes{{{FOCUS}}}",
                           legend + "at steps"),
                    target("B", f"vramwatch_checkpoint_headroom_bytes{{{FOCUS}}} / "
                                f"vramwatch_device_total_bytes{{{FOCUS}}}", legend + "at checkpoint")],
                   "percentunit", sort="asc", calcs=("min", "lastNotNull"), steps=HEADROOM_STEPS, minimum=0),
        timeseries(detail, "Rank $focus: leak slope", "Bytes per training step.",
                   [target("A", f"vramwatch_leak_slope_bytes_per_step{{{FOCUS}}}", legend + "slope")],
                   "si:B/step", no_value=NOTHING_GROWING),
    ]
    lay.next_id = detail.next_id
    return [row(lay, "Rank $focus in detail (pick it in the focus variable)", collapsed=True, panels=inner)]


def collector(lay: Layout) -> list[dict[str, Any]]:
    sub = Layout()
    sub.next_id, sub.y = lay.next_id, lay.y + 1
    inner = [
        timeseries(sub, "Ingest samples/s by result", "Samples per second each collector accepted, rejected or "
                   "dropped as duplicates.",
                   [target("A", "sum by (instance, result) (rate(vramwatch_ingest_samples_total[$__rate_interval]))",
                           "{{instance}} {{result}}")], "si:samples/s", w=8, calcs=("mean", "max")),
        timeseries(sub, "Ingest requests/s", "POSTs per second per collector.",
                   [target("A", "sum by (instance) (rate(vramwatch_ingest_requests_total[$__rate_interval]))",
                           "{{instance}}")], "reqps", w=8, calcs=("mean", "max")),
        timeseries(sub, "Ingest request latency p99", "99th percentile of the time to validate and store a POST.",
                   [target("A", "histogram_quantile(0.99, sum by (instance, le) "
                                "(rate(vramwatch_ingest_request_duration_seconds_bucket[$__rate_interval])))",
                           "{{instance}} p99")], "s", w=8),
        timeseries(sub, "Exported rank series per collector", "Ranks each collector exports on /metrics.",
                   [target("A", "vramwatch_series", "{{instance}}")], "none", w=12, calcs=("lastNotNull",)),
        timeseries(sub, "Seconds since the last sample per rank", "Collector's clock. Longest first.",
                   [target("A", f"time() - vramwatch_last_received_timestamp_seconds{{{SEL}}}", RANK_LEGEND)], "s",
                   w=12),
    ]
    lay.next_id = sub.next_id
    return [row(lay, "Collector", collapsed=True, panels=inner)]


# ---------------------------------------------------------------------------- dashboard

def query_variable(name: str, label: str, query: str, *, multi: bool = True, sort: int = 1,
                   description: str = "") -> dict[str, Any]:
    item: dict[str, Any] = {
        "name": name, "label": label, "description": description, "type": "query", "datasource": DS,
        "query": {"query": query, "refId": f"vramwatch-{name}"}, "definition": query, "refresh": 2,
        "includeAll": multi, "multi": multi, "sort": sort, "hide": 0, "options": [], "regex": "",
    }
    if multi:
        item["allValue"] = ".*"
        item["current"] = {"selected": True, "text": ["All"], "value": ["$__all"]}
    else:
        item["current"] = {}  # Grafana picks the first value
    return item


def variables() -> list[dict[str, Any]]:
    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus", "regex": "",
         "description": "The Prometheus that scrapes the vramwatch collectors (and dcgm-exporter).",
         "current": {"selected": False, "text": "${DS_PROMETHEUS}", "value": "${DS_PROMETHEUS}"},
         "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1},
        query_variable("run", "run", "label_values(vramwatch_step, run)"),
        query_variable("host", "host", 'label_values(vramwatch_step{run=~"$run"}, Hostname)'),
        query_variable("rank", "rank", 'label_values(vramwatch_step{run=~"$run", Hostname=~"$host"}, rank)', sort=3),
        query_variable("focus", "rank in detail",
                       f"label_values(vramwatch_step{{{SEL}}}, rank)", multi=False, sort=3,
                       description="The one rank the collapsed detail row shows."),
        query_variable("instance", "dcgm instance", "label_values(DCGM_FI_DEV_FB_USED, instance)"),
        query_variable("gpu", "dcgm gpu", 'label_values(DCGM_FI_DEV_FB_USED{instance=~"$instance"}, gpu)', sort=3),
        {"name": "collector_url", "label": "collector URL", "type": "textbox", "hide": 0,
         "description": "Base URL of a vramwatch collector's page as your browser reaches it: the dashboard "
                        "link, and the rank table's fallback where a rank's instance is not browsable.",
         "query": "http://localhost:8765",
         "current": {"selected": False, "text": "http://localhost:8765", "value": "http://localhost:8765"},
         "options": [{"selected": True, "text": "http://localhost:8765", "value": "http://localhost:8765"}]},
    ]


def annotation(name: str, expr: str, color: str, title: str, text: str, tags: str) -> dict[str, Any]:
    return {"name": name, "datasource": DS, "enable": True, "hide": False, "iconColor": color, "expr": expr,
            "step": "1m", "titleFormat": title, "textFormat": text, "tagKeys": tags, "useValueForTime": False}


def annotations() -> list[dict[str, Any]]:
    rank_text = "{{run}} rank {{rank}} ({{Hostname}})"
    return [
        {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
         "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"},
        # One mark per run per checkpoint (ranks checkpoint together); the counter sees the first
        # checkpoint and checkpoints whose peak equals the previous one.
        annotation("Checkpoints", f"sum by (run) (increase(vramwatch_checkpoints_total{{{SEL}}}[2m])) > 0",
                   "orange", "checkpoint", "{{run}}", "run"),
        # the collector's count across a rank's processes, one series per rank whatever its GPU: an OOM
        # and a restart within a second (on another GPU too) mark; the rank's last-OOM time marks an OOM
        # the first scrape already showed (a Prometheus restarted on empty storage: no rise to see)
        annotation("OOMs", f"(sum by (run, Hostname, rank) (increase(vramwatch_ooms_total{{{SEL}}}[2m])) > 0)\n"
                   f"or max by (run, Hostname, rank) (time() - vramwatch_last_oom_timestamp_seconds{{{SEL}}} < 120)",
                   "dark-red", "OOM", rank_text, "run,rank"),
        # an OOM suspected from device memory alone (no OOM counter: dcgm, nvidia-smi), marked the same way
        annotation("Suspected OOMs",
                   f"(sum by (run, Hostname, rank) (increase(vramwatch_suspected_ooms_total{{{SEL}}}[2m])) > 0)\n"
                   f"or max by (run, Hostname, rank) (time() - vramwatch_last_suspected_oom_timestamp_seconds"
                   f"{{{SEL}}} < 120)", "dark-orange", "suspected OOM (device memory)", rank_text, "run,rank"),
        # as VramwatchPlateauBreak counts them: a checkpoint's one-time ratchet (the allocator kept the
        # phase's segments, the plateau re-levels) is not a break worth a mark
        annotation("Plateau breaks",
                   f"max by (run, Hostname, rank) (increase(vramwatch_plateau_breaks_total{{{SEL}}}[2m])"
                   f" - increase(vramwatch_phase_ratchets_total{{{SEL}}}[2m])) > 0",
                   "yellow", "plateau break", rank_text, "run,rank"),
        annotation("Alerts", 'ALERTS{alertname=~"Vramwatch.*", alertstate="firing", run=~"$run"}',
                   "red", "{{alertname}}", "{{run}} rank {{rank}} ({{Hostname}}) {{severity}}",
                   "alertname,severity,run"),
    ]


def links() -> list[dict[str, Any]]:
    return [
        {"title": "vramwatch collector: run ${run}", "type": "link", "icon": "external link", "targetBlank": True,
         "tooltip": "The collector's own view of the selected run (select one run)",
         "url": "${collector_url}/#/run/${run:percentencode}?x=time&from=${__from}&to=${__to}",
         "keepTime": False, "includeVars": False},
        {"title": "vramwatch dashboards", "type": "dashboards", "tags": ["vramwatch"], "asDropdown": True,
         "keepTime": True, "includeVars": True},
    ]


def build() -> dict[str, Any]:
    lay = Layout()
    panels = overview(lay) + ranks(lay) + gpu_context(lay) + rank_detail(lay) + collector(lay)
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "description": "The Prometheus that "
                      "scrapes the vramwatch collectors", "type": "datasource", "pluginId": "prometheus",
                      "pluginName": "Prometheus"}],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            *({"type": "panel", "id": t, "name": t, "version": ""}
              for t in ("stat", "state-timeline", "table", "timeseries")),
        ],
        "uid": "vramwatch-overview",
        "title": "vramwatch: GPU memory per rank",
        "description": "Live GPU memory of training runs from the vramwatch collector: headroom, trend-engine "
                       "state, rank skew, time to OOM, checkpoints and OOMs, with dcgm-exporter's GPU view.",
        "tags": ["vramwatch", "gpu", "memory"],
        "timezone": "browser", "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "refresh": "30s", "time": {"from": "now-6h", "to": "now"}, "timepicker": {}, "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {"list": annotations()},
        "templating": {"list": variables()},
        "panels": panels,
        "links": links(),
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {Path(__file__).relative_to(ROOT)}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
