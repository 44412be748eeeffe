"""The repository speaks of the product: no work logs under docs/, and no issue numbers or
references to work logs in the package, the dashboard, the docs, deploy/, bench/ or the README.

The scan reads every text file of those trees (a few MB, well under a second); third-party
files (dashboard/vendor) are not ours to word and are left out."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = ("vramwatch", "dashboard", "docs", "deploy", "bench")
FILES = ("README.md",)
SKIP_DIRS = {"__pycache__", "vendor", "node_modules"}

#: "issue 14", "Issue #3", "issues 12", "issue_10" (in a name), and any path into docs/notes
WORK_TALK = re.compile(r"(?<![a-z])(issues? ?#?\d+|issue_\d+)|docs/notes", re.IGNORECASE)


def text_files() -> Iterator[Path]:
    """Every text file in scope: binary files (a NUL byte: images, compiled code) are skipped."""
    paths = [ROOT / name for name in FILES]
    for tree in TREES:
        paths += sorted(p for p in (ROOT / tree).rglob("*")
                        if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(ROOT).parts))
    for path in paths:
        data = path.read_bytes()
        if b"\0" not in data:
            yield path


def offenders() -> list[str]:
    found = []
    for path in text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            match = WORK_TALK.search(line)
            if match:
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}: {line.strip()[:100]}")
    return found


def test_there_are_no_work_logs_under_docs() -> None:
    assert not (ROOT / "docs" / "notes").exists(), (
        "docs/notes/ holds work logs: move their lasting facts into the product docs and delete it")


def test_code_and_docs_cite_no_issue_numbers_and_no_work_logs() -> None:
    assert sum(1 for _ in text_files()) > 100  # the scan reached the trees it guards
    found = offenders()
    assert not found, "say what the product does, not which issue or log it came from:\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "handled as in issue 14", "(issue #3)", "Issue 10: every resource", "issues 12 and 13",
    "see docs/notes/ingest.md", "fits_issue_10s_budget", "issue12",
])
def test_the_scan_recognises_work_talk(text: str) -> None:
    assert WORK_TALK.search(text)


@pytest.mark.parametrize("text", [
    "ISSUE_OLD_MS = 188.0", "a tissue 5 cm", "Megatron-LM 1380", "open an issue on GitHub",
    "docs/notebook.md", "NCCL #1264",
])
def test_the_scan_leaves_product_text_alone(text: str) -> None:
    assert not WORK_TALK.search(text)
