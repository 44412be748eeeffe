"""The Grafana dashboard check: a pure reading of the dashboard JSON for what a Grafana user
would hit (panels repeated per rank, tables merging into several rows per rank, legends without
the run, unknown metrics, panels off ``$datasource``, links to undefined variables or dropped
fields), plus Grafana's merge transformation and data-link rendering simulated for the tests
that run the dashboard's queries on a real Prometheus.

(Not named test_*: it holds no tests; the deploy and Prometheus tests import it.)
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote

from prometheus_helpers import promql_metric_names

from vramwatch.collector.exporters.metrics import RANK_LABELS, SERIES_FAMILIES

#: dcgm-exporter's families the dashboard reads (its default-counters.csv names, metrics in MiB, %, W, C).
DCGM_METRICS = {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP"}
DATASOURCE_VAR = "${datasource}"
#: the collector's families keyed by the rank alone (no gpu label): its counters, last-OOM time, ...
RANK_KEYED = {f.name + ("_total" if f.kind == "counter" else "") for f in SERIES_FAMILIES
              if f.label_names == RANK_LABELS}
_ANY_AGGREGATION = re.compile(r"\b(?:sum|min|max|avg|count|group|topk|bottomk|quantile)\s+by\s*\(")
_AGGREGATION = re.compile(r"\s*(?:sum|min|max|avg|count|group|topk|bottomk)\s+by\s*\(([^)]*)\)\s*\(", re.S)


def dashboard_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows and the panels inside collapsed rows included."""
    out: list[dict[str, Any]] = []

    def walk(items: list[dict[str, Any]]) -> None:
        for panel in items:
            out.append(panel)
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return out


def outer_grouping(expr: str) -> frozenset[str] | None:
    """Labels of ``agg by (...) ( ... )`` when that aggregation is the whole expression, else None."""
    match = _AGGREGATION.match(expr)
    if not match:
        return None
    depth = 0
    for index in range(match.end() - 1, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[index], 0)
        if depth == 0:
            if expr[index + 1:].strip():
                return None  # e.g. "max by (run) (x) > 0" or "... - min by (run) (y)": not the outer node
            return frozenset(label.strip() for label in match.group(1).split(",") if label.strip())
    return None


def keeps_run_label(expr: str) -> bool:
    grouping = outer_grouping(expr)
    return "$run" in expr and (grouping is None or "run" in grouping)


def keeps_gpu_label(expr: str) -> bool:
    """A per-rank or per-GPU query (it selects by ``$rank``, ``$focus`` or ``$gpu``) whose result
    keeps the ``gpu`` label: a rank restarted on another GPU is two of its series."""
    if not any(v in expr for v in ("$rank", "$focus", "$gpu")):
        return False
    if promql_metric_names(expr) <= RANK_KEYED:  # one series per rank across its GPUs
        return False
    grouping = outer_grouping(expr)
    if grouping is not None:
        return "gpu" in grouping
    # not one aggregation: raw series keep it, and so does a join (the many side's labels);
    # arithmetic between aggregations keeps only what they all group by
    return not _ANY_AGGREGATION.search(expr) or bool(re.search(r"\bgroup_(left|right)\b", expr))


def check_dashboard(dashboard: dict[str, Any], known_metrics: set[str]) -> list[str]:
    """Problems a Grafana user would hit; [] when there are none. Pure: reads only the JSON.

    - duplicate rows per rank: a row or panel repeated over a multi-value variable (one copy
      per rank: ~1000 panels at 512 ranks), or a merged table whose queries do not all
      aggregate to the same labels (``__name__`` or another label kept: one row per query);
    - a legend of a query that keeps ``run`` without ``{{run}}`` (run is multi-select), or of a
      per-rank query that keeps ``gpu`` without ``{{gpu}}`` (a rank restarted on another GPU
      would draw two lines under one legend);
    - a metric name that is neither exposed, recorded nor dcgm-exporter's;
    - a panel or query not on the ``$datasource`` variable (an import into another Grafana breaks);
    - a link naming a variable the dashboard does not define, or a table field (``${__data.fields.X}``)
      its queries aggregate away (Grafana renders it empty: a link to ``http:///#/run/...``).
    """
    problems: list[str] = link_problems(dashboard)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    if variables.get("datasource", {}).get("type") != "datasource":
        problems.append("no $datasource variable")
    if not any(i.get("type") == "datasource" and i.get("pluginId") == "prometheus"
               for i in dashboard.get("__inputs", [])):
        problems.append("no __inputs entry for the Prometheus datasource")
    for panel in dashboard_panels(dashboard):
        title = panel.get("title", "?")
        repeat = panel.get("repeat")
        if repeat and (variables.get(repeat, {}).get("multi") or variables.get(repeat, {}).get("includeAll")):
            problems.append(f"{title}: repeated per value of multi-value ${repeat} (one copy per rank)")
        targets = panel.get("targets", [])
        if panel.get("type") != "row" and targets and panel.get("datasource", {}).get("uid") != DATASOURCE_VAR:
            problems.append(f"{title}: panel datasource is not {DATASOURCE_VAR}")
        if any(t.get("id") == "merge" for t in panel.get("transformations", [])):
            groupings = {outer_grouping(t["expr"]) for t in targets}
            if None in groupings or len(groupings) != 1:
                problems.append(f"{title}: merged queries do not aggregate to one label set: {groupings}")
        for item in targets:
            if item.get("datasource", {}).get("uid") != DATASOURCE_VAR:
                problems.append(f"{title} {item['refId']}: query datasource is not {DATASOURCE_VAR}")
            if item.get("format") != "table" and keeps_run_label(item["expr"]) and "{{run}}" not in item.get(
                    "legendFormat", ""):
                problems.append(f"{title} {item['refId']}: legend lacks {{{{run}}}}")
            if item.get("format") != "table" and keeps_gpu_label(item["expr"]) and "{{gpu}}" not in item.get(
                    "legendFormat", ""):
                problems.append(f"{title} {item['refId']}: legend lacks {{{{gpu}}}}")
            for name in promql_metric_names(item["expr"]) - known_metrics:
                problems.append(f"{title} {item['refId']}: unknown metric {name}")
    for item in dashboard["annotations"]["list"]:
        if "expr" not in item:
            continue
        if item["datasource"].get("uid") != DATASOURCE_VAR:
            problems.append(f"annotation {item['name']}: datasource is not {DATASOURCE_VAR}")
        if keeps_run_label(item["expr"]) and "{{run}}" not in item.get("textFormat", ""):
            problems.append(f"annotation {item['name']}: text lacks {{{{run}}}}")
        for name in promql_metric_names(item["expr"]) - known_metrics:
            problems.append(f"annotation {item['name']}: unknown metric {name}")
    for variable in variables.values():
        if variable["type"] != "query":
            continue
        if variable["datasource"].get("uid") != DATASOURCE_VAR:
            problems.append(f"variable {variable['name']}: datasource is not {DATASOURCE_VAR}")
        for name in promql_metric_names(variable["query"]["query"]) - known_metrics:
            problems.append(f"variable {variable['name']}: unknown metric {name}")
    return problems


#: Grafana's own variables a link may use (besides ``__data``/``__value``/``__series``/``__field``).
GRAFANA_BUILTINS = frozenset({"__from", "__to", "__interval", "__interval_ms", "__range", "__range_s",
                              "__dashboard", "__user", "__org", "__url_time_range", "__all_variables",
                              "__timezone", "__rate_interval"})
_LINK_REF = re.compile(r"\$\{([A-Za-z_][\w.]*)(?::(\w+))?\}|\$([A-Za-z_]\w*)")


def panel_links(panel: dict[str, Any]) -> list[dict[str, Any]]:
    """Panel links and data links (field defaults and overrides) of one panel."""
    config = panel.get("fieldConfig", {})
    links = [*panel.get("links", []), *config.get("defaults", {}).get("links", [])]
    for override in config.get("overrides", []):
        links += [lk for prop in override["properties"] if prop["id"] == "links" for lk in prop["value"]]
    return links


def table_fields(panel: dict[str, Any]) -> set[str] | None:
    """Field names a data link can read in a table panel: every query's labels (when each query
    aggregates ``by (...)``), its value columns and their renamed names; None when unknown."""
    fields = {"Time"}
    for item in panel.get("targets", []):
        grouping = outer_grouping(item["expr"])
        if grouping is None:
            return None
        fields |= grouping | {f"Value #{item['refId']}"}
    for transformation in panel.get("transformations", []):
        fields |= set(transformation.get("options", {}).get("renameByName", {}).values())
    return fields


def link_problems(dashboard: dict[str, Any]) -> list[str]:
    """Links that would render wrong: undefined variables, fields the panel's queries drop."""
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    owners = [("dashboard", dashboard.get("links", []), None)]
    owners += [(p.get("title", "?"), panel_links(p), p) for p in dashboard_panels(dashboard)]
    problems = []
    for title, links, panel in owners:
        for link in links:
            for match in _LINK_REF.finditer(link.get("url", "") + " " + link.get("title", "")):
                name = match.group(1) or match.group(3)
                if name.startswith("__data.fields."):
                    field = name.removeprefix("__data.fields.")
                    fields = table_fields(panel) if panel and panel.get("type") == "table" else None
                    if fields is None or field not in fields:
                        problems.append(f"{title}: link uses field {field!r} that its queries do not keep")
                elif name.split(".")[0] in ("__data", "__value", "__series", "__field"):
                    continue
                elif name not in GRAFANA_BUILTINS and name not in variables:
                    problems.append(f"{title}: link uses undefined variable ${name}")
    return list(dict.fromkeys(problems))  # once per panel, however many links repeat it


def interpolate_link(url: str, fields: dict[str, str], variables: dict[str, str]) -> str:
    """A data link as Grafana renders it for one table row: ``${__data.fields.X}`` from the row,
    ``${var}`` from the variables; the ``percentencode`` format as encodeURIComponent."""
    def value(match: re.Match[str]) -> str:
        name, fmt = match.group(1) or match.group(3), match.group(2)
        raw = fields[name.removeprefix("__data.fields.")] if name.startswith("__data.fields.") else variables[name]
        return quote(raw, safe="") if fmt == "percentencode" else raw

    return _LINK_REF.sub(value, url)


def merged_rows(frames: list[list[dict[str, str]]]) -> list[dict[str, str]]:
    """Grafana's merge transformation on instant table frames (one dict of labels per row).

    Rows of different frames become one row when every column they share has equal values;
    a column only one of them has (another query's ``__name__``) keeps them apart when both
    have it with different values.
    """
    merged: list[dict[str, str]] = []
    for frame in frames:
        for labels in frame:
            for existing in merged:
                shared = set(existing) & set(labels)
                if shared and all(existing[k] == labels[k] for k in shared):
                    existing.update(labels)
                    break
            else:
                merged.append(dict(labels))
    return merged
