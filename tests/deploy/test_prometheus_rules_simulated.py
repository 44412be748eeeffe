"""The shipped alert rules (production ``for:`` durations) against what the collector really
exports for simulated runs.

Each scenario is played through the real LiveState + TrendEngine; once per simulated
minute ``/metrics`` is rendered and parsed, which gives a promtool ``input_series`` of
exactly the families the rules read. promtool then checks that non-leaking scenarios
(warm-up, checkpoints, eval phases, sawtooth cache, unmarked spikes, noise) raise no
alert at all, and that each fault scenario raises the alert written for it.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml
from prometheus_helpers import (
    DASHBOARD,
    RULES,
    alert_rules,
    exposed_samples,
    grafana_to_promql,
    promql_metric_names,
    run_promtool,
)

from vramwatch.collector.exporters.metrics import build_registry, render
from vramwatch.collector.state.live import LiveState
from vramwatch.probe.simulated import simulate_trace

T0 = 1_700_000_000.0  # simulated start; promtool time 0
TIMESTAMP_FAMILIES = {"vramwatch_last_received_timestamp_seconds", "vramwatch_last_sample_timestamp_seconds",
                      "vramwatch_last_oom_timestamp_seconds", "vramwatch_process_start_timestamp_seconds"}

QUIET = {  # scenario: steps (1 s each)
    "healthy": 3000,
    "long_warmup": 4200,
    "checkpoint": 4200,
    "eval": 3600,
    "sawtooth": 3600,
    "periodic_spikes": 3600,
    "dropped": 3600,
}
FIRES = {  # scenario: (steps, alert that must be firing at the end)
    "late_step": (3700, "VramwatchPlateauBreak"),
    "fast_leak": (3300, "VramwatchMemoryLeak"),
    "outside_leak": (4000, "VramwatchGrowthOutsideAllocator"),
    "fragmentation": (4600, "VramwatchAllocRetriesRising"),
}


def rule_metric_names() -> set[str]:
    names: set[str] = set()
    for rule in alert_rules().values():
        names |= promql_metric_names(rule["expr"])
    return names


def exported_series(scenario: str, steps: int) -> tuple[dict[str, list[float | None]], int]:
    """{promtool series selector: value per simulated minute} as /metrics showed them."""
    samples = list(simulate_trace(scenario, steps=steps, run=scenario, host="node-a", rank=0, start_ts=T0))
    return exported_from(samples)


def exported_from(samples: list[dict], wanted: set[str] | None = None, *, after_minutes: int = 0,
                  ) -> tuple[dict[str, list[float | None]], int]:
    """Play samples (any ranks, in time order) into a LiveState; render /metrics once a minute,
    ``after_minutes`` more after the last sample."""
    wanted = rule_metric_names() if wanted is None else wanted
    samples = sorted(samples, key=lambda s: s["ts"])
    minutes = int((samples[-1]["ts"] - T0) // 60) + 1 + after_minutes
    live = LiveState()
    clock = [T0]
    # the simulated clock: ranks are judged (running, dead) at the simulated minute; never age out
    registry, _ = build_registry(live, finished_after_s=1e12, clock=lambda: clock[0])
    series: dict[str, list[float | None]] = {}
    index = 0
    for minute in range(minutes + 1):
        now = clock[0] = T0 + 60 * minute
        batch = []
        while index < len(samples) and samples[index]["ts"] <= now:
            batch.append(samples[index])
            index += 1
        if batch:
            live.ingest(batch, received_at=batch[-1]["ts"])
        for name, labels, value in exposed_samples(render(registry, None)[0].decode()):
            if name not in wanted:
                continue
            if name in TIMESTAMP_FAMILIES:
                value -= T0
            selector = name + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
            series.setdefault(selector, [None] * (minutes + 1))[minute] = value
    return series, minutes


def promtool_values(values: list[float | None]) -> str:
    return " ".join("_" if v is None else repr(float(v)) for v in values)


def run_group(tmp_path, group: dict) -> tuple[int, str, dict[str, set[str]]]:
    """promtool test rules on one group against the shipped rules; (rc, output, failures by group)."""
    rules_copy = tmp_path / "rules.yml"
    rules_copy.write_text(RULES.read_text())
    test_file = tmp_path / "sim.test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(rules_copy)], "evaluation_interval": "1m",
                                         "tests": [group]}, sort_keys=False, width=100000))
    result = run_promtool("test", "rules", str(test_file))
    output = result.stdout + result.stderr
    failures: dict[str, set[str]] = {}
    name = None
    for line in output.splitlines():
        named = re.match(r"\s+name: (.*),$", line)
        if named:
            name = named.group(1)
            continue
        alert_line = re.match(r"\s+alertname: (\w+), time: (\S+),", line)
        if alert_line:
            failures.setdefault(name, set()).add(alert_line.group(1))
    return result.returncode, output, failures


def input_series(series: dict[str, list[float | None]]) -> list[dict[str, str]]:
    return [{"series": s, "values": promtool_values(v)} for s, v in series.items()]


@pytest.mark.parametrize("scenario", list(QUIET))
def test_no_alert_on_a_run_that_is_not_failing(tmp_path, scenario) -> None:
    series, minutes = exported_series(scenario, QUIET[scenario])
    assert minutes >= 45
    assert any(s.startswith("vramwatch_trend_state{") for s in series)
    checks = [
        {"eval_time": f"{t}m", "alertname": alert, "exp_alerts": []}
        for t in range(5, minutes + 1, 5) for alert in alert_rules()
    ]
    rc, output, failures = run_group(tmp_path, {"name": f"quiet: {scenario}", "interval": "1m",
                                                "input_series": input_series(series), "alert_rule_test": checks})
    assert rc == 0, f"alerts fired on {scenario}: {failures}\n{output[-4000:]}"


@pytest.mark.parametrize("scenario", list(FIRES))
def test_fault_raises_its_alert(tmp_path, scenario) -> None:
    steps, alert = FIRES[scenario]
    series, minutes = exported_series(scenario, steps)
    # Expecting silence at the end makes promtool print what fired; the check must fail
    # on exactly this alert, with this run's labels.
    group = {"name": f"fires: {scenario}", "interval": "1m", "input_series": input_series(series),
             "alert_rule_test": [{"eval_time": f"{minutes}m", "alertname": alert, "exp_alerts": []}]}
    rc, output, failures = run_group(tmp_path, group)
    assert rc != 0 and failures == {f"fires: {scenario}": {alert}}, output[-4000:]
    got = output.split("got:", 1)[1]
    assert f'alertname="{alert}"' in got and f'run="{scenario}"' in got and 'rank="0"' in got, got


@pytest.mark.parametrize("scenario", ["fast_leak"])
def test_leak_alert_reports_the_engines_time_to_oom(tmp_path, scenario) -> None:
    series, minutes = exported_series(scenario, FIRES[scenario][0])
    seconds = next(v for s, v in series.items() if s.startswith("vramwatch_seconds_to_oom{"))
    assert seconds[minutes] is not None and seconds[minutes] > 0


def fired_ranks(output: str) -> dict[str, set[str]]:
    """{alertname: ranks it fired for} from promtool's report of unexpected alerts."""
    fired: dict[str, set[str]] = {}
    for block in re.split(r"\n\s+alertname: ", output)[1:]:
        alert = block.split(",", 1)[0]
        got = block.split("got:", 1)[1]
        fired.setdefault(alert, set()).update(re.findall(r'rank="(\d+)"', got))
    return fired


def test_multi_rank_run_alerts_name_only_the_bad_ranks(tmp_path) -> None:
    """8 ranks: rank 3 leaks (the scenario's bad rank), rank 6 dies at step 2400 while the
    others keep going. Only rank 3 may leak/break and only rank 6 may be silent."""
    samples = []
    for rank in range(8):
        trace = simulate_trace("multi_rank", steps=3600, run="multi", host=f"node-{rank // 4}", rank=rank,
                               start_ts=T0)
        samples += [s for s in trace if rank != 6 or s["step"] < 2400]
    series, minutes = exported_from(samples)
    # judged at the run's last minute, while the other ranks still send (once the whole run is
    # quiet for its window the silent-rank alert rightly resolves: a finished run stays quiet)
    checks = [{"eval_time": f"{minutes - 1}m", "alertname": alert, "exp_alerts": []} for alert in alert_rules()]
    rc, output, _ = run_group(tmp_path, {"name": "multi-rank", "interval": "1m",
                                         "input_series": input_series(series), "alert_rule_test": checks})
    assert rc != 0
    fired = fired_ranks(output)
    assert fired.get("VramwatchMemoryLeak") == {"3"}, output[-4000:]
    assert fired.get("VramwatchHookSilent") == {"6"}, output[-4000:]
    assert set(fired) <= {"VramwatchMemoryLeak", "VramwatchHookSilent", "VramwatchPlateauBreak",
                          "VramwatchHeadroomLow"}, fired
    assert fired.get("VramwatchPlateauBreak", {"3"}) == {"3"}
    assert fired.get("VramwatchHeadroomLow", {"3"}) == {"3"}


def test_checkpoint_annotation_marks_every_checkpoint_once(tmp_path) -> None:
    """vramwatch_checkpoints_total counts each checkpoint phase from 0, so the dashboard's
    annotation query marks the first checkpoint and the later ones whose peak is unchanged
    (what changes(vramwatch_checkpoint_peak_bytes) missed), and nothing between them."""
    samples = list(simulate_trace("checkpoint", steps=4200, run="ckpt", host="node-a", rank=0, start_ts=T0))
    checkpoint_minutes = sorted({int((s["ts"] - T0) // 60) + (0 if (s["ts"] - T0) % 60 == 0 else 1)
                                 for s in samples if s["phase"] == "checkpoint"})
    assert len(checkpoint_minutes) == 4
    series, minutes = exported_from(samples, {"vramwatch_checkpoints_total", "vramwatch_checkpoint_peak_bytes"})
    (counter,) = [v for k, v in series.items() if k.startswith("vramwatch_checkpoints_total{")]
    first = next(m for m, v in enumerate(counter) if v is not None)
    assert counter[first] == 0 and counter[-1] == 4  # exposed from the start: the first checkpoint is 0 -> 1
    assert [m for m in range(first + 1, minutes + 1) if counter[m] != counter[m - 1]] == checkpoint_minutes
    dashboard = json.loads(DASHBOARD.read_text())
    (annotation,) = [a for a in dashboard["annotations"]["list"] if a.get("name") == "Checkpoints"]
    expr = "(" + grafana_to_promql(annotation["expr"]) + ") * 0 + 1"
    marked = {m for c in checkpoint_minutes for m in (c, c + 1)}  # a 2m window after each checkpoint
    tests = [{"expr": expr, "eval_time": f"{m}m",
              "exp_samples": [{"labels": '{run="ckpt"}', "value": 1}] if m in marked else []}
             for m in range(2, minutes + 1)]
    test_file = tmp_path / "ckpt.test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [
        {"name": "checkpoint annotations", "interval": "1m", "input_series": input_series(series),
         "promql_expr_test": tests}]}, sort_keys=False, width=100000))
    result = run_promtool("test", "rules", str(test_file))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]


def test_checkpoint_count_is_the_engines_and_survives_restarts_and_event_eviction() -> None:
    """vramwatch_checkpoints_total is the engine's own count (not rebuilt from its bounded
    event list): a restarted rank (a new process, steps going back) keeps counting, and more
    checkpoints than the event list keeps are all counted."""
    from vramwatch.engine import TrendEngine

    engine = TrendEngine()
    first = list(simulate_trace("checkpoint", steps=4200, run="r", host="h", rank=0, start_ts=T0))
    seen = sum(1 for s in first if s["phase"] == "checkpoint")
    for sample in first:
        engine.update(sample)
    assert seen == 4 and engine.summary()["checkpoints"] == seen
    again = [{**s, "incarnation": "second", "ts": s["ts"] + 5000} for s in first]  # restarted from step 0
    for sample in again:
        engine.update(sample)
    assert engine.summary()["checkpoints"] == 2 * seen
    assert sum(1 for e in engine.events if e["type"] == "checkpoint_spike") <= 2 * seen


@pytest.mark.parametrize("scenario", ["checkpoint", "late_step"])
def test_plateau_break_annotation_skips_checkpoint_ratchets_as_the_alert_does(tmp_path, scenario) -> None:
    """The Grafana "Plateau breaks" annotation marks what VramwatchPlateauBreak counts: a
    checkpoint whose segments the allocator kept re-levels the plateau (a phase ratchet) and is
    not marked; a break of the training loop itself is."""
    steps = {"checkpoint": 4200, "late_step": 3700}[scenario]
    samples = list(simulate_trace(scenario, steps=steps, run="pb", host="node-a", rank=0, start_ts=T0))
    series, minutes = exported_from(samples, {"vramwatch_plateau_breaks_total", "vramwatch_phase_ratchets_total"})
    (breaks,) = [v for k, v in series.items() if k.startswith("vramwatch_plateau_breaks_total{")]
    (ratchets,) = [v for k, v in series.items() if k.startswith("vramwatch_phase_ratchets_total{")]
    loop = [None if b is None else b - (r or 0) for b, r in zip(breaks, ratchets, strict=True)]
    changes = [m for m in range(1, minutes + 1) if loop[m] is not None and loop[m - 1] is not None
               and loop[m] != loop[m - 1]]
    if scenario == "checkpoint":
        assert breaks[-1] >= 1 and ratchets[-1] == breaks[-1] and not changes  # it ratcheted, and only that
    else:
        assert changes
    marked = {m for c in changes for m in (c, c + 1)}
    dashboard = json.loads(DASHBOARD.read_text())
    (annotation,) = [a for a in dashboard["annotations"]["list"] if a.get("name") == "Plateau breaks"]
    expr = "(" + grafana_to_promql(annotation["expr"]) + ") * 0 + 1"
    labels = '{Hostname="node-a", rank="0", run="pb"}'
    tests = [{"expr": expr, "eval_time": f"{m}m",
              "exp_samples": [{"labels": labels, "value": 1}] if m in marked else []} for m in range(2, minutes + 1)]
    test_file = tmp_path / "pb.test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [
        {"name": "plateau break annotations", "interval": "1m", "input_series": input_series(series),
         "promql_expr_test": tests}]}, sort_keys=False, width=100000))
    result = run_promtool("test", "rules", str(test_file))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]


def firing_minutes(output: str) -> dict[str, set[int]]:
    """{alertname: minutes it fired at} from promtool's report of unexpected alerts."""
    fired: dict[str, set[int]] = {}
    for alert, minute in re.findall(r"alertname: (\w+), time: (\d+)m", output):
        fired.setdefault(alert, set()).add(int(minute))
    return fired


def test_a_fast_leak_pages_before_its_oom_and_the_oom_pages_at_once(tmp_path) -> None:
    """A leak that fills the device about 6 minutes after it starts, through the real engine and
    /metrics: the OOM-imminent page fires minutes before the OOM (the leak alert's for: 5m would
    come after it), and the OOM alert at the first evaluation that sees the OOM, for 10 minutes."""
    samples = list(simulate_trace("leak_to_oom", steps=3300, run="fast", host="node-a", rank=0, start_ts=T0,
                                  leak_onset=2600, leak_rate_frac=3.5e-4))
    oom_ts = next(s["ts"] for s in samples if s.get("ooms") or s.get("oom_marked"))
    onset_ts = next(s["ts"] for s in samples if s["step"] == 2600)
    assert 300 <= oom_ts - onset_ts <= 420  # the phenomenon: about 6 minutes from the first leaked byte
    oom_minute = math.ceil((oom_ts - T0) / 60)  # the first scrape that can show it
    series, minutes = exported_from(samples, after_minutes=15)
    checks = [{"eval_time": f"{m}m", "alertname": alert, "exp_alerts": []}
              for m in range(40, minutes + 1) for alert in ("VramwatchOOMImminent", "VramwatchOOM")]
    _rc, output, _ = run_group(tmp_path, {"name": "fast leak", "interval": "1m",
                                         "input_series": input_series(series), "alert_rule_test": checks})
    fired = firing_minutes(output)
    assert fired.get("VramwatchOOMImminent") and min(fired["VramwatchOOMImminent"]) < oom_minute, output[-3000:]
    assert min(fired["VramwatchOOM"]) == oom_minute
    assert fired["VramwatchOOM"] == set(range(oom_minute, oom_minute + 10)), output[-3000:]
