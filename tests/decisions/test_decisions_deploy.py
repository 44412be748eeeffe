"""Decision families on a real collector's /metrics, and the VramwatchTokensNearLimit rule under promtool."""

from __future__ import annotations

import time

import pytest
import yaml
from helpers import ending_at
from prometheus_helpers import RULE_TESTS, RULES, exposed_samples, post_samples, run_promtool, scrape

from vramwatch.collector.server import BackgroundServer
from vramwatch.simulation.tokens import token_trace, token_truth

ALERT = "VramwatchTokensNearLimit"
# the rule's own expression, evaluated on scraped values (the promtool tests pin its PromQL)
NEAR = 0.95


def running(samples: list[dict]) -> list[dict]:
    """The trace as a run still going: its last sample 5 s ago (a rank whose process ended has its
    gauges withdrawn from /metrics)."""
    return ending_at(samples, time.time() - 5)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[tuple[str, str, str], float]:
    db = tmp_path_factory.mktemp("decisions-metrics") / "vw.db"
    with BackgroundServer(str(db)) as srv:
        post_samples(srv.url, running(token_trace("varlen", steps=3000, run="roomy", seed=1)))
        # the same job with activations 30 % larger: its long batches are near the wall
        post_samples(srv.url, running(token_trace("varlen", steps=3000, run="tight", seed=1, act_frac=0.47)))
        post_samples(srv.url, running(token_trace("varlen", steps=300, run="young", seed=1)))
        text = scrape(srv.url).text
    return {(name, labels.get("run", ""), labels.get("rank", "")): value
            for name, labels, value in exposed_samples(text) if name.startswith("vramwatch_")}


def test_max_tokens_gauge_matches_the_truth(families) -> None:
    truth = token_truth("varlen", seed=1)
    assert families[("vramwatch_max_tokens_per_step", "roomy", "0")] == pytest.approx(truth.max_tokens(0.05), rel=0.02)
    assert 16000 < families[("vramwatch_tokens_per_step_max_observed", "roomy", "0")] <= 16384


def test_readiness_gauge(families) -> None:
    assert families[("vramwatch_readiness", "roomy", "0")] == 0  # ready
    assert families[("vramwatch_readiness", "young", "0")] == 1  # not_ready: 300 steps, no checkpoint


def test_the_near_limit_condition_separates_tight_from_roomy(families) -> None:
    def ratio(run: str) -> float:
        return (families[("vramwatch_tokens_per_step_max_observed", run, "0")]
                / families[("vramwatch_max_tokens_per_step", run, "0")])

    assert ratio("roomy") < 0.8
    assert ratio("tight") >= NEAR
    truth = token_truth("varlen", seed=1, act_frac=0.47)
    assert truth.max_tokens(0.05) < 16384 / NEAR  # the truth agrees: the longest batches are within 5 %


def test_rule_group_is_self_contained_and_keeps_its_guard(tmp_path) -> None:
    groups = {g["name"]: g for g in yaml.safe_load(RULES.read_text())["groups"]}
    (rule,) = groups["vramwatch-decisions"]["rules"]
    assert rule["alert"] == ALERT and rule["for"] == "5m"
    assert "0.95 * vramwatch_max_tokens_per_step" in rule["expr"]
    passing = run_promtool("test", "rules", str(RULE_TESTS))
    assert passing.returncode == 0, passing.stdout + passing.stderr
    # without its for: the 3-minute blip of the noisy plateau fires: the quiet case has teeth
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    text = RULES.read_text()
    head, tail = text.split("- name: vramwatch-decisions", 1)
    (tmp_path / "rules" / "vramwatch.rules.yml").write_text(head + "- name: vramwatch-decisions" +
                                                          tail.replace("for: 5m", "for: 0m", 1))
    (tmp_path / "tests" / "t.yml").write_text(RULE_TESTS.read_text())
    weakened = run_promtool("test", "rules", str(tmp_path / "tests" / "t.yml"))
    assert weakened.returncode != 0
    assert ALERT in weakened.stdout + weakened.stderr and "noisy plateau" in weakened.stdout + weakened.stderr


def test_the_shipped_rule_fires_on_the_tight_rank_of_a_simulated_run(tmp_path) -> None:
    """The real LiveState's /metrics, once a simulated minute, through promtool with the shipped rules."""
    from test_prometheus_rules_simulated import T0, exported_from, fired_ranks, input_series, run_group

    from vramwatch.simulation.tokens import token_trace as trace

    samples = trace("varlen", steps=3000, run="tok", rank=0, seed=1, start_ts=T0, world_size=2)
    samples += trace("varlen", steps=3000, run="tok", rank=1, seed=2, start_ts=T0, world_size=2, act_frac=0.49)
    series, minutes = exported_from(samples)
    assert any(s.startswith("vramwatch_max_tokens_per_step{") for s in series)
    checks = [{"eval_time": f"{minutes}m", "alertname": alert, "exp_alerts": []}
              for alert in _alerts()]
    rc, output, _ = run_group(tmp_path, {"name": "tokens", "interval": "1m", "input_series": input_series(series),
                                         "alert_rule_test": checks})
    assert rc != 0  # expecting silence makes promtool print what fired
    assert fired_ranks(output) == {ALERT: {"1"}}, output[-3000:]


def _alerts() -> list[str]:
    return [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
