"""Nothing leaves the machine unasked: every chart of the dashboard and of the HTML report keeps
PNG export and offers no plotly cloud action ("Share chart..." uploads the figure to plotly's
chart-studio), and the read-auth cookie is ``Secure`` when the page came over TLS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from test_dashboard import DEMO_RUN, Page, browser, collector, run_url

from vramwatch.collector.server import BackgroundServer
from vramwatch.report import write_report

__all__ = ["browser", "collector"]  # fixtures re-exported for pytest

#: what each drawn chart's plotly context and mode bar show (the bar appears on hover)
CHARTS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => ({
    id: gd.id,
    cloud: gd._context.showSendToCloud, server: gd._context.plotlyServerURL,
    studio: !!gd._context.showEditInChartStudio, link: !!gd._context.showLink,
    buttons: Array.from(gd.querySelectorAll('.modebar-btn')).map(b => b.getAttribute('data-title'))}))"""


def _check_charts(p: Any) -> list[dict[str, Any]]:
    p.wait_for_function("document.querySelectorAll('#chart-rank .main-svg').length > 0", timeout=30_000)
    p.hover("#chart-rank")
    charts = p.evaluate(CHARTS)
    assert charts, "no chart drawn"
    for chart in charts:
        assert chart["cloud"] is False and chart["server"] == "" and not chart["studio"] and not chart["link"], chart
        assert not [b for b in chart["buttons"] if b and ("Share" in b or "Studio" in b or "Cloud" in b)], chart
    rank = next(c for c in charts if c["id"] == "chart-rank")
    assert "Download plot as a PNG" in rank["buttons"], rank  # export to a file stays
    return charts


def test_no_chart_of_the_dashboard_offers_a_cloud_action(collector: dict[str, Any], browser: Any) -> None:
    page = Page(browser)
    try:
        page.page.goto(run_url(collector["url"], DEMO_RUN))
        page.ready()
        charts = _check_charts(page.page)
        assert {"chart-rank", "chart-heatmap"} <= {c["id"] for c in charts}
        # and nothing was asked of a host other than the collector
        assert [u for u in page.requests if not u.startswith(collector["url"])] == []
    finally:
        page.close()


def test_no_chart_of_the_report_offers_a_cloud_action(collector: dict[str, Any], browser: Any,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    write_report(collector["db"], DEMO_RUN, out)
    page = Page(browser)
    try:
        page.page.goto(out.as_uri() + f"#/run/{DEMO_RUN}")
        page.ready()
        _check_charts(page.page)
        assert [u for u in page.requests if not u.startswith("file:")] == []
    finally:
        page.close()


@pytest.mark.parametrize(("proto", "secure"), [("https", True), ("http", False), (None, False)])
def test_the_read_cookie_is_secure_when_the_page_came_over_tls(tmp_path, proto: str | None, secure: bool) -> None:
    """TLS ends at a reverse proxy in front of the collector (it has none of its own); uvicorn
    trusts that proxy's X-Forwarded-Proto from the addresses in --forwarded-allow-ips
    (loopback by default)."""
    token = "s3cret-token"
    with BackgroundServer(str(tmp_path / "vw.db"), token=token, auth_read=True) as srv:
        headers = {"X-Forwarded-Proto": proto} if proto else {}
        reply = httpx.get(f"{srv.url}/?token={token}", headers=headers, timeout=10)
        assert reply.status_code == 200
        cookie = reply.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        assert ("secure" in [part.strip() for part in cookie.split(";")]) is secure, cookie
